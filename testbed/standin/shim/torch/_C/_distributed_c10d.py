"""The stand-in worker server: testbed/standin/collectives.py."""

from testbed.standin.collectives import WorkerServer as _WorkerServer  # noqa: F401
