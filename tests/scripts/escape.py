"""A torchrun script that leaves a daemon behind and succeeds: the daemon double-forks, starts a session
of its own and drops the environment (so HARNESS_RUN_ID with it), as `Popen(env=..., start_new_session=True)`
followed by a classic daemonize does. Its pid goes to the file named by DAEMON_PID_FILE.
"""

import os
import subprocess
import sys

DAEMON = """
import os, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
"""

if __name__ == "__main__":
    target = os.environ["DAEMON_PID_FILE"]
    subprocess.Popen([sys.executable, "-c", DAEMON, target], env={"PATH": "/usr/bin:/bin"}, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()
    while not os.path.exists(target):
        pass
    with open(target) as handle:
        print(f"daemon {handle.read()} started", flush=True)
