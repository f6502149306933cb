"""The stand-in torchrun: testbed/standin/launcher.py."""

from testbed.standin.launcher import main

if __name__ == "__main__":
    main()
