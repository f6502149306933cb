"""The node agent: runs one node's command and owns its whole process tree, on every backend.

Every node of every controller-supervised target runs under this agent: a local process of the
controller, a process on an SSH host, or an srun step's task. It is started as

    python -I -S -c "$BOOT" harness-agent RUN_ID node NODE_RANK attempt ATTEMPT

and reads itself, and its arguments GRACE SILENCE COMMAND [CLEANUP], from the first line of its
stdin (harness.node.boot), so it imports nothing but the standard library (not even
site-packages): hosts need Python, not the harness. The protocol, on the rest of its stdin and
on its stdout:
- `TERM` from the controller: SIGTERM to the node's process group;
- `KILL`: SIGKILL to the group, then a sweep of every process whose environment carries this
  run's HARNESS_RUN_ID, NODE_RANK and HARNESS_ATTEMPT (torchrun starts its workers in sessions of
  their own, out of the group's reach; an agent of an earlier attempt, cut off and late, must not
  touch the next attempt's node on the same machine), repeated until none is left, then CLEANUP
  once (e.g. removing the node's container, which a SIGKILLed `docker run` leaves behind);
- `PING`: nothing to do; the controller says it every few seconds;
- end of stdin, or SILENCE seconds without a word: the controller or its connection is gone (a
  host cut off by a dropped network stays silent instead of closing). TERM, GRACE seconds, then
  KILL: a lost controller never leaves a job running;
- stdout carries the node's combined output, then one line `EXIT_MARKER CODE` once the node has
  ended (a negative CODE is the signal that ended it).

The agent finds its node's processes through harness.node.proctable, as `harness stop` does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time

from harness.node.proctable import kill_run_processes, process_tree, signal_all

EXIT_MARKER = "\x1eharness-node-exit"
PR_SET_CHILD_SUBREAPER = 36
SWEEP_SECONDS = 2.0  # how long KILL keeps sweeping for processes that appear while it kills


class Agent:
    """One node's command in a session of its own, and the means to end all of it."""

    def __init__(self, run_id: str, node_rank: str, attempt: str, grace: float, silence: float, command: str,
                 cleanup: str) -> None:
        self.run_id = run_id
        self.node_rank = node_rank
        self.attempt = attempt
        self.grace = grace
        self.silence = silence
        self.cleanup = cleanup
        self.ended = threading.Event()
        self._cleaned = False
        self._kill_lock = threading.Lock()
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans below us are re-parented to us
        self.child = subprocess.Popen(["/bin/sh", "-c", command], start_new_session=True, stdin=subprocess.DEVNULL)
        # A command the OS refuses to run (too long, no /bin/sh) raises here: main() reports it.

    def signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, sig)

    def _sweep(self) -> None:
        """SIGKILL, until none is left, every process of this node: by run id, and every descendant of the
        agent, which as a subreaper adopts the orphans of double forks that also dropped the run id."""
        deadline = time.monotonic() + SWEEP_SECONDS
        while True:
            below, dead = process_tree(os.getpid())
            killed = kill_run_processes(self.run_id, self.node_rank, self.attempt) + signal_all(below, signal.SIGKILL)
            if not killed or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        for pid in dead:  # reap adopted orphans; not waitpid(-1): the node's own status is Popen's
            if pid != self.child.pid:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    def kill(self) -> None:
        """SIGKILL the group and sweep until no process of this node is left; then the cleanup, once."""
        with self._kill_lock:
            self.signal_group(signal.SIGKILL)
            self._sweep()
            if self.cleanup and not self._cleaned:
                self._cleaned = True
                subprocess.run(["/bin/sh", "-c", self.cleanup], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=60, check=False)

    def obey_controller(self) -> None:
        """Follow the controller's words until its end of stdin, or its silence, then stop the node."""
        pending = b""
        while True:
            readable, _, _ = select.select([0], [], [], self.silence)
            chunk = os.read(0, 4096) if readable else b""
            if not chunk:
                break
            *words, pending = (pending + chunk).split(b"\n")
            for word in words:
                if word.strip() == b"TERM":
                    self.signal_group(signal.SIGTERM)
                elif word.strip() == b"KILL":
                    self.kill()
        if not readable and not self.ended.is_set():
            with contextlib.suppress(OSError):
                sys.stdout.write(f"harness node agent: no word from the controller for {self.silence:g} s: "
                                 f"stopping the node\n")
                sys.stdout.flush()
        self.signal_group(signal.SIGTERM)
        self.ended.wait(self.grace)
        self.kill()

    def run(self) -> int:
        threading.Thread(target=self.obey_controller, daemon=True).start()
        code = self.child.wait()
        self.ended.set()
        with self._kill_lock:  # not while a KILL runs the cleanup, a child of ours with our environment
            self._sweep()  # workers that outlived their torchrun, daemons the job left behind
        return code


def main(argv: list[str]) -> None:
    run_id, node_rank, attempt, grace, silence, command = argv[:6]
    cleanup = argv[6] if len(argv) > 6 else ""
    try:
        agent = Agent(run_id, node_rank, attempt, float(grace), float(silence), command, cleanup)
    except OSError as exc:
        sys.stdout.write(f"harness node agent: cannot run the node's command: {exc.strerror or exc}\n")
        code = 127
    else:
        code = agent.run()
    try:
        sys.stdout.write(f"{EXIT_MARKER} {code}\n")
        sys.stdout.flush()
    except OSError:  # the controller is gone; there is nobody to tell
        pass
    os._exit(code if code >= 0 else 128 - code)  # no exit-time flush into a closed pipe


if __name__ == "__main__":
    main(sys.argv[1:])
