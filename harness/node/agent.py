"""The node agent: runs one node's command and owns its whole process tree, on every backend.

Every node of every controller-supervised target runs under this agent: a local process of the
controller, a process on an SSH host, or an srun step's task. It is started as

    python -I -S -c "$BOOT" harness-agent RUN_ID node NODE_RANK attempt ATTEMPT

and reads itself, and its arguments GRACE SILENCE WATCH COMMAND CLEANUP HOOK, from the first line of its
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

The agent finds its node's processes through harness.node.proctable, as `harness stop` does. It
keeps a private directory (HARNESS_AGENT_DIR in the node's environment, removed at the end, or by the
next agent on the host when this one was SIGKILLed) that
holds HOOK as sitecustomize.py (harness.node.rank_hook: the node's setup line puts the directory first
on PYTHONPATH) and the sockets on which the ranks serve their Flight Recorder (harness.node.collectives).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from harness.node.collectives import READ_SECONDS, arrivals, last_entries, progress, read_trace
from harness.node.oom import oom_counts, oom_kills
from harness.node.proctable import is_alive, kill_run_processes, process_tree, signal_all, start_ticks, stat_fields
from harness.node.protocol import (
    Kind,
    Word,
    arrivals_bodies,
    health_bodies,
    message_line,
    oom_body,
    parse_word,
    stacks_bodies,
)
from harness.node.ranks import as_seen, children_of, find_ranks, python_children, sample, source_line
from harness.node.stacks import dump, py_spy_path

PR_SET_CHILD_SUBREAPER = 36
SWEEP_SECONDS = 2.0  # how long KILL keeps sweeping for processes that appear while it kills


class Agent:
    """One node's command in a session of its own, and the means to end all of it."""

    def __init__(self, run_id: str, node_rank: str, attempt: str, grace: float, silence: float, watch: float,
                 command: str, cleanup: str, hook: str) -> None:
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
        self.arrived: dict[int, int] = {}  # rank -> when it enqueued the newest collective sent (ns)
        self.directory, self.unhooked = _private_directory(hook)
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans below us are re-parented to us
        hooked = {"HARNESS_AGENT_DIR": self.directory} if self.directory else {}
        self.child = subprocess.Popen(["/bin/sh", "-c", command], start_new_session=True, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **hooked})
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
            samples = sample(self.ranks, below)
            traces = self.traces({rank: found.state for rank, found in samples.items()})
            now = time.time()
            for rank, trace in traces.items():
                if isinstance(trace, list):
                    completed, pending = progress(trace, time.time_ns())
                    samples[rank] = samples[rank]._replace(completed=completed, pending=round(pending, 2))
                    if new := arrivals(trace, self.arrived.get(rank, 0)):
                        self.arrived[rank] = new[-1][2]
                        for body in arrivals_bodies(now, rank, new):
                            say(Kind.ARRIVALS, body)
            for body in health_bodies(now, samples):
                say(Kind.HEALTH, body)

    def traces(self, states: dict[int, str]) -> dict[int, list[dict[str, object]] | str]:
        """Each rank's Flight Recorder entries (or why not), read in parallel: one rank slow to answer
        holds up nobody else's. states: each rank's scheduler state (a stopped rank's server cannot answer)."""
        found: dict[int, list[dict[str, object]] | str] = {}

        def read(rank: int) -> None:
            found[rank] = read_trace(self.directory, rank) if self.directory else self.unhooked

        ranks = [rank for rank, state in states.items() if state not in ("T", "t", "Z")]
        found.update({rank: f"the rank is {'a zombie' if state == 'Z' else 'stopped'}"
                      for rank, state in states.items() if rank not in ranks})
        readers = [threading.Thread(target=read, args=(rank,), daemon=True) for rank in ranks]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 2 * READ_SECONDS
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        return {rank: found.get(rank, "its worker server did not answer in time") for rank in states}

    def send_stacks(self, tag: str) -> None:
        """Every rank's stack, and its DataLoader workers', read in parallel; each frame with its source
        line as this node has it."""
        below, _ = process_tree(os.getpid())
        ranks = find_ranks(below, self.run_id) or self.ranks
        states = sample(ranks, below)
        py_spy = py_spy_path()
        tree = children_of(below)
        answers: dict[int, dict[str, object]] = {}

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
        traces = self.traces({rank: states[rank].state for rank in ranks if rank in states})
        for reader in readers:
            reader.join()
        for rank, answer in answers.items():
            trace = traces.get(rank, "the rank is gone")
            answer["collectives"] = last_entries(trace) if isinstance(trace, list) else trace
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
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        if code != 0 and (killed := oom_kills(self.seen, self.began, self.oom_before)):
            say(Kind.OOM, oom_body(killed))
        return code


AGENT_DIRECTORY = re.compile(r"^harness-agent-(\d+)-(\d+)-")  # its agent's pid and start time


def _private_directory(hook: str) -> tuple[str | None, str]:
    """(a directory of the agent's own, mode 0700 so that no other user can put code there, holding the
    rank hook as sitecustomize.py, ""); or (None, why) where the node's temporary directory takes none:
    the ranks then run without the hook, and their collectives are not read, for that reason. Its name
    says whose it is, so that the next agent here removes it when its own agent was killed before it could."""
    remove_orphaned(tempfile.gettempdir())
    try:
        directory = tempfile.mkdtemp(prefix=f"harness-agent-{os.getpid()}-{start_ticks(os.getpid())}-")
        with open(os.path.join(directory, "sitecustomize.py"), "w", encoding="utf-8") as handle:
            handle.write(hook)
    except OSError as exc:
        return None, f"the agent could not install the rank hook in {tempfile.gettempdir()}: {exc.strerror or exc}"
    return directory, ""


def remove_orphaned(parent: str) -> None:
    """This user's agent directories in parent whose agent is gone (SIGKILLed: it removes its own otherwise)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            if (found := AGENT_DIRECTORY.match(name)) and not is_alive(int(found.group(1)), int(found.group(2))):
                with contextlib.suppress(OSError):
                    if os.stat(path).st_uid == os.getuid():
                        shutil.rmtree(path)


_SAY_LOCK = threading.Lock()


def say(kind: Kind, body: str) -> None:
    """One message line in one write(2): atomic on the pipe, whatever the workers write meanwhile."""
    data = message_line(kind, body)
    with _SAY_LOCK, contextlib.suppress(OSError):
        sys.stdout.flush()
        os.write(1, data)


def main(argv: list[str]) -> None:
    run_id, node_rank, attempt, grace, silence, watch, command, cleanup, hook = argv[:9]
    if "SLURM_STEP_ID" in os.environ:
        # Slurm's time-limit warning reaches every process of the step (scancel --signal=USR1): the training
        # processes catch it and checkpoint; the agent and torchrun (which inherits this) must live on.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        agent = Agent(run_id, node_rank, attempt, float(grace), float(silence), float(watch), command, cleanup, hook)
    except OSError as exc:
        sys.stdout.write(f"harness node agent: cannot run the node's command: {exc.strerror or exc}\n")
        code = 127
    else:
        code = agent.run()
    say(Kind.NODE_EXIT, str(code))  # when the controller is gone, there is nobody to tell
    os._exit(code if code >= 0 else 128 - code)  # no exit-time flush into a closed pipe


if __name__ == "__main__":
    main(sys.argv[1:])
