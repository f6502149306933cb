"""The node agent: runs one node's command and owns its whole process tree, on every backend.

Every node of every controller-supervised target runs under this agent: a local process of the
controller, a process on an SSH host, or an srun step's task. It is started as

    python -I -S -c "$BOOT" harness-agent RUN_ID node NODE_RANK attempt ATTEMPT

and reads itself, and its arguments GRACE SILENCE WATCH COMMAND [CLEANUP], from the first line of its
stdin (harness.node.boot), so it imports nothing but the standard library (not even
site-packages): hosts need Python, not the harness. Its protocol (harness.node.protocol): the words
it obeys on the rest of its stdin, and the messages it says among the node's output on its stdout:
- `TERM`: SIGTERM to the node's process group;
- `KILL`: SIGKILL to the group, then a sweep of every process whose environment carries this
  run's HARNESS_RUN_ID, NODE_RANK and HARNESS_ATTEMPT (torchrun starts its workers in sessions of
  their own, out of the group's reach; an agent of an earlier attempt, cut off and late, must not
  touch the next attempt's node on the same machine), repeated until none is left, then CLEANUP
  once (e.g. removing the node's container, which a SIGKILLed `docker run` leaves behind);
- `PING`: nothing to do; the controller says it every few seconds;
- `STACKS TAG`: every rank's Python stack (harness.node.stacks), answered as `stacks` messages, then
  `stacks-done TAG`;
- end of stdin, or SILENCE seconds without a word: the controller or its connection is gone (a
  host cut off by a dropped network stays silent instead of closing). TERM, GRACE seconds, then
  KILL: a lost controller never leaves a job running;
- in an srun step, it and the node's command ignore SIGUSR1 (Slurm's time-limit warning, which the
  training processes catch);
- it says `health` every WATCH seconds (WATCH 0: never), `oom` before the exit when the kernel's OOM
  killer ended a rank (harness.node.oom), and `node-exit CODE` once the node has ended.

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

from harness.node.oom import oom_counts, oom_kills
from harness.node.proctable import kill_run_processes, process_tree, signal_all, stat_fields
from harness.node.protocol import Kind, Word, health_bodies, message_line, oom_body, parse_word, stacks_bodies
from harness.node.ranks import as_seen, children_of, find_ranks, python_children, sample, source_line
from harness.node.stacks import dump, py_spy_path

PR_SET_CHILD_SUBREAPER = 36
SWEEP_SECONDS = 2.0  # how long KILL keeps sweeping for processes that appear while it kills


class Agent:
    """One node's command in a session of its own, and the means to end all of it."""

    def __init__(self, run_id: str, node_rank: str, attempt: str, grace: float, silence: float, watch: float,
                 command: str, cleanup: str) -> None:
        self.run_id = run_id
        self.node_rank = node_rank
        self.attempt = attempt
        self.grace = grace
        self.silence = silence
        self.watch = watch
        self.cleanup = cleanup
        self.ranks: dict[int, int] = {}  # rank -> pid, as last found
        self.seen: dict[int, int] = {}  # pid -> rank, of every rank found (for the OOM killer's record)
        self.began = time.time()
        self.oom_before = oom_counts()
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
            for line in words:
                word, argument = parse_word(line) or (Word.PING, "")
                if word is Word.TERM:
                    self.signal_group(signal.SIGTERM)
                elif word is Word.KILL:
                    self.kill()
                elif word is Word.STACKS and argument:
                    threading.Thread(target=self.send_stacks, args=(argument,), daemon=True).start()
        if not readable and not self.ended.is_set():
            with contextlib.suppress(OSError):
                sys.stdout.write(f"harness node agent: no word from the controller for {self.silence:g} s: "
                                 f"stopping the node\n")
                sys.stdout.flush()
        self.signal_group(signal.SIGTERM)
        self.ended.wait(self.grace)
        self.kill()

    def watch_ranks(self) -> None:
        """Every WATCH seconds, how far each rank has run (what the controller judges hangs and slow ranks by)."""
        while not self.ended.wait(self.watch):
            below, _ = process_tree(os.getpid())
            self.ranks = find_ranks(below, self.run_id) or self.ranks
            self.seen.update({pid: rank for rank, pid in self.ranks.items()})
            for body in health_bodies(time.time(), sample(self.ranks, below)):
                say(Kind.HEALTH, body)

    def send_stacks(self, tag: str) -> None:
        """Every rank's stack, and its DataLoader workers', read in parallel; each frame with its source
        line as this node has it."""
        below, _ = process_tree(os.getpid())
        ranks = find_ranks(below, self.run_id) or self.ranks
        states = sample(ranks, below)
        py_spy = py_spy_path()
        tree = children_of(below)
        answers: dict[int, object] = {}

        def threads_of(pid: int, state: str) -> object:
            threads = dump(pid, py_spy, stopped=state in ("T", "t")) if py_spy else \
                "py-spy is not installed beside the job's Python or on PATH"
            if isinstance(threads, list):
                for thread in threads:
                    for frame in thread["frames"]:
                        frame["code"] = source_line(pid, frame["file"], frame["line"])
                        frame["file"] = as_seen(pid, frame["file"])
            return threads

        def read(rank: int, pid: int) -> None:
            state = states[rank].state if rank in states else "gone"
            workers = []
            for child in python_children(pid, tree):  # its DataLoader workers: a hang may be theirs
                child_state = (stat_fields(child) or [b"gone"])[0].decode()
                workers.append({"pid": child, "state": child_state, "threads": threads_of(child, child_state)})
            answers[rank] = {"pid": pid, "state": state, "threads": threads_of(pid, state), "workers": workers}

        readers = [threading.Thread(target=read, args=item, daemon=True) for item in ranks.items()]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        for rank, answer in sorted(answers.items()):
            for body in stacks_bodies(tag, rank, answer):
                say(Kind.STACKS, body)
        say(Kind.STACKS_DONE, tag)

    def run(self) -> int:
        threading.Thread(target=self.obey_controller, daemon=True).start()
        if self.watch > 0:
            threading.Thread(target=self.watch_ranks, daemon=True).start()
        code = self.child.wait()
        self.ended.set()
        with self._kill_lock:  # not while a KILL runs the cleanup, a child of ours with our environment
            self._sweep()  # workers that outlived their torchrun, daemons the job left behind
        if code != 0 and (killed := oom_kills(self.seen, self.began, self.oom_before)):
            say(Kind.OOM, oom_body(killed))
        return code


_SAY_LOCK = threading.Lock()


def say(kind: Kind, body: str) -> None:
    """One message line in one write(2): atomic on the pipe, whatever the workers write meanwhile."""
    data = message_line(kind, body)
    with _SAY_LOCK, contextlib.suppress(OSError):
        sys.stdout.flush()
        os.write(1, data)


def main(argv: list[str]) -> None:
    run_id, node_rank, attempt, grace, silence, watch, command = argv[:7]
    cleanup = argv[7] if len(argv) > 7 else ""
    if "SLURM_STEP_ID" in os.environ:
        # Slurm's time-limit warning reaches every process of the step (scancel --signal=USR1): the training
        # processes catch it and checkpoint; the agent and torchrun (which inherits this) must live on.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        agent = Agent(run_id, node_rank, attempt, float(grace), float(silence), float(watch), command, cleanup)
    except OSError as exc:
        sys.stdout.write(f"harness node agent: cannot run the node's command: {exc.strerror or exc}\n")
        code = 127
    else:
        code = agent.run()
    say(Kind.NODE_EXIT, str(code))  # when the controller is gone, there is nobody to tell
    os._exit(code if code >= 0 else 128 - code)  # no exit-time flush into a closed pipe


if __name__ == "__main__":
    main(sys.argv[1:])
