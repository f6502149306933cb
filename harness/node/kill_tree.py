"""End a process and everything below it, on its own machine: SIGTERM, `grace` seconds, then SIGKILL
to the whole tree as it was before the TERM (children of a dead parent are re-parented and lost).

    python -c BOOT kill-tree PID GRACE      (shipped with harness.node.boot; standard library only)

A remote command that overruns its deadline is ended this way: closing its SSH channel alone would
leave it running.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from harness.node.proctable import process_tree, signal_all


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def kill_tree(root: int, grace: float) -> None:
    doomed = set(process_tree(root)[0]) | {root}
    if alive(root):
        os.kill(root, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_all(sorted(doomed | set(process_tree(root)[0])), signal.SIGKILL)


if __name__ == "__main__":
    kill_tree(int(sys.argv[1]), float(sys.argv[2]))
