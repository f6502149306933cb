"""The node agent: runs one node's command and owns its whole process tree, on every backend.

Every node of every controller-supervised target runs under this agent: a local process of the
controller, a process on an SSH host, or an srun step's task. It is started as

    python -I -S -c "$BOOT" harness-agent RUN_ID node NODE_RANK attempt ATTEMPT

and reads itself, and its arguments GRACE SILENCE WATCH COMMAND CLEANUP HOOK STANDBY SECRETS HOLD STORE NODES COLLAPSE,
from the first line of its stdin (harness.targets.boot), so it imports nothing but the standard library (not even
site-packages): hosts need Python, not the harness. It obeys the controller's words on the rest of its
stdin and says its messages among the node's output on its stdout: harness.node.protocol defines both,
with what each means. Here: the node's command in a session of its own, its output read by the agent and said
through harness.node.link; the process tree it owns, by run id and as a child subreaper (the sweep that TERM,
KILL and the end of the node share); what the agent does when the controller goes silent or away: it holds
the node, running, for HOLD seconds (supervision.grace), keeping what it says for the controller that takes
it back (harness.node.link, `harness attach`); past HOLD (or at once where HOLD is 0, or for a standby) it
stops it: TERM, GRACE seconds, then KILL, so that a lost controller never leaves a job running for good;
a standby node (STANDBY: the source of harness.node.standby, installed beside the rank hook and
run by COMMAND: the next attempt's torchrun and workers started early, their imports done while the attempt
before runs) that waits on its stdin for the GO word's order, then is its attempt's node; and, in an srun
step, SIGUSR1 ignored (Slurm's time-limit warning, which the training processes
catch). SECRETS (JSON: name -> value) join the environment COMMAND runs in: carried on stdin, they are on no command
line and in no file (harness/spec/secrets.py). What it sees of the ranks is harness.node.observer's, every WATCH
seconds or less often where the job's NODES would send the controller too many (protocol.sample_interval). Its
ranks' identical lines, held COLLAPSE seconds (0: none), go as one (protocol.RankLines).

The agent finds its node's processes through harness.node.proctable, as `harness stop` does. It
keeps a private directory (HARNESS_AGENT_DIR in the node's environment, removed at the end, or by the
next agent on the host when this one was SIGKILLed) that holds HOOK as sitecustomize.py
(harness.node.rank_hook: the node's setup line puts the directory first on PYTHONPATH), the sockets
on which the ranks serve their Flight Recorder (harness.node.collectives), and torchrun's log files
(TORCHRUN_LOG_DIR).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from harness.node.link import AGENT_DIRECTORY, IDENTITY, ControllerLink, Link
from harness.node.observer import RankObserver
from harness.node.oom import oom_counts, oom_kills
from harness.node.proctable import is_alive, kill_run_processes, process_tree, signal_all, start_ticks
from harness.node.protocol import (
    RESULTS_FOLDER,
    Kind,
    RankLines,
    Word,
    escape_output,
    message_line,
    oom_body,
    parse_word,
    result_bodies,
)
from harness.node.store_port import keep_store, release_store

PR_SET_CHILD_SUBREAPER = 36
SWEEP_SECONDS = 2.0  # how long KILL keeps sweeping for processes that appear while it kills
STARTED_POLL = 0.5  # seconds between looks for the node's ranks, until they exist (Kind.STARTED)
READ_BYTES = 1 << 16  # a pipe's capacity: one read takes all the node wrote meanwhile
# torchrun's --log-dir, as its environment twin: where its workers' output goes before torchrun echoes it (--tee). The
# agent's directory, so that no rank writes to the run's record (the record's disk may be full) nor to a folder that
# outlives the node; a job's own PET_LOG_DIR, or --log-dir in its arguments, still wins.
TORCHRUN_LOG_DIR = "PET_LOG_DIR"
FREE_SECONDS = 1.0  # how often what torchrun has read of those files is given back to the file system
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
BLOCK = 4096
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


class Agent:
    """One node's command in a session of its own, and the means to end all of it."""

    def __init__(self, run_id: str, node_rank: str, attempt: str, grace: float, silence: float, watch: float,
                 command: str, cleanup: str, hook: str, standby: str = "", secrets: dict[str, str] | None = None,
                 hold: float = 0.0, store_port: int | None = None, nodes: int = 1, collapse: float = 0.0) -> None:
        self.run_id = run_id
        self.node_rank = node_rank
        self.attempt = attempt
        self.grace = grace
        self.silence = silence
        self.watch = watch
        self.nodes = nodes  # the job's: its samples are paced by them (protocol.sample_interval)
        self.collapse = collapse  # seconds its ranks' lines are held for identical copies (0: not at all)
        self.cleanup = cleanup
        self.hold = hold
        self.began = time.time()
        self.oom_before = oom_counts()
        self.ended = threading.Event()
        self._cleaned = False
        self._kill_lock = threading.Lock()
        self.directory, unhooked = _private_directory(hook, standby)
        self.link = ControllerLink(run_id, Link(0, 1), self.directory)
        self._name()
        self.observer = RankObserver(run_id, self.directory, unhooked, self.say)
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans below us are re-parented to us
        hooked = {"HARNESS_AGENT_DIR": self.directory, "HARNESS_AGENT_PID": str(os.getpid()),
                  TORCHRUN_LOG_DIR: os.path.join(self.directory, "torchrun")} if self.directory else {}
        self.standing_by = threading.Event()  # a standby: no samples until the GO word
        self.stop_asked = False  # the controller said TERM or KILL: its node is not held when it goes
        if standby:
            self.standing_by.set()
        self.store_port = store_port  # the node hosts the job's store there, kept from the host's other users
        if store_port is not None:
            why_open = keep_store(run_id, store_port)
            self.say(Kind.STORE, why_open or "")
            self.store_port = None if why_open else store_port
        self.child = subprocess.Popen(["/bin/sh", "-c", command], start_new_session=True,
                                      stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      env={**os.environ, **(secrets or {}), **hooked})
        self._pump = threading.Thread(target=self._pass_output, daemon=True)
        self.passed = 0  # bytes of the node's output passed on
        self.passing = False  # a chunk of it is being passed on (a slow controller's pipe may be full)
        self.observer.launcher = self.child.pid
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

    def say(self, kind: Kind, body: str) -> None:
        self.link.write(message_line(kind, body))

    def _pass_output(self) -> None:
        """The node's output, as it comes, to the controller (or the spool while there is none), no byte of it a
        message's (escape_output)."""
        assert self.child.stdout is not None
        fd = self.child.stdout.fileno()
        held = RankLines(self.collapse) if self.collapse > 0 else None
        while True:
            if held is not None and held.due is not None:
                wait = held.due - time.monotonic()
                if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                    self._pass(held.flush())
                    continue
            chunk = os.read(fd, READ_BYTES)
            if not chunk:
                break
            self._pass(chunk if held is None else held.take(chunk, time.monotonic()))
            self.passed += len(chunk)
        if held is not None:
            self._pass(held.flush())

    def _pass(self, output: bytes) -> None:
        if output:
            self.passing = True
            self.link.write(escape_output(output))
            self.passing = False

    def _name(self) -> None:
        """Say in the private directory whose node this is: harness.node.link finds it by that."""
        if self.directory is not None:
            with contextlib.suppress(OSError), open(os.path.join(self.directory, IDENTITY), "w",
                                                    encoding="utf-8") as handle:
                handle.write(f"{self.run_id} {self.node_rank} {self.attempt}\n")

    def obey_controller(self) -> None:
        """Follow the controller's words; when its link ends without them, hold the node for a controller to
        take it back (harness.node.link) until HOLD seconds have passed, then stop it."""
        link = self.link.current
        while link is not None:
            silent = self._obey(link)
            newer = None if self.link.incoming.empty() else self.link.incoming.get()
            if newer is None and not self._holds():
                if silent and not self.ended.is_set():
                    self.say_text(f"harness node agent: no word from the controller for {self.silence:g} s: "
                                  f"stopping the node\n")
                break
            self.link.lose(link)
            if newer is None and not self.ended.is_set():
                why = f"no word from it for {self.silence:g} s" if silent else "its link ended"
                self.say_text(f"harness node agent: lost the controller ({why}); the node runs on, held "
                              f"{self.hold:g} s (supervision.grace) for `harness attach {self.run_id}`\n")
            link = self._taken_back(newer)
            if link is not None and self.observer.started is not None:  # its rendezvous deadline: long met
                self.say(Kind.STARTED, self.observer.started)
            if link is None and not self.ended.is_set():
                self.say_text(f"harness node agent: no controller took the node back within supervision.grace "
                              f"({self.hold:g} s): stopping the node\n")
        self.signal_group(signal.SIGTERM)
        self.ended.wait(self.grace)
        self.kill()

    def say_text(self, line: str) -> None:
        self.link.write(line.encode())

    def _holds(self) -> bool:
        """Whether a lost controller's node is held for another (not a standby's: it has no job yet)."""
        return self.hold > 0 and self.link.reachable and not self.standing_by.is_set() and not self.stop_asked

    def _obey(self, link: Link) -> bool:
        """The link's words until its end (False) or its silence (True), or a newer controller came."""
        pending = b""
        while True:
            chunk = self.link.wait_word(link, self.silence)
            if not chunk:
                return chunk is None and self.link.incoming.empty()
            *words, pending = (pending + chunk).split(b"\n")
            for line in words:
                word, argument = parse_word(line) or (Word.PING, "")
                if word is Word.TERM:
                    self.stop_asked = True
                    self.signal_group(signal.SIGTERM)
                elif word is Word.KILL:
                    self.stop_asked = True
                    self.kill()
                elif word is Word.STACKS and argument:
                    threading.Thread(target=self.observer.send_stacks, args=(argument,), daemon=True).start()
                elif word is Word.PING and argument:
                    with contextlib.suppress(ValueError):
                        self.observer.clock.heard(float(argument), time.time())
                elif word is Word.GO and self.standing_by.is_set():
                    self.go(argument)

    def _taken_back(self, newer: Link | None) -> Link | None:
        """The link of the controller that took the node back (newer, or one that comes), its spool replayed to
        it; None: none did within HOLD seconds of the loss."""
        deadline = (self.link.lost_at or time.time()) + self.hold
        while True:
            link, newer = newer or self.link.await_controller(deadline), None
            if link is None or self.link.attach(link):
                return link
            link.close()

    def await_delivery(self) -> None:
        """Until what the agent said last reached a controller, or none can take the node back any more."""
        while self._holds() and not self.link.delivered() and self.link.lost_at is not None \
                and time.time() < self.link.lost_at + self.hold:
            time.sleep(0.1)

    def go(self, order: str) -> None:
        """The standby becomes its attempt's node: its identity is the order's, the order goes to the waiting
        torchrun, and the samples begin."""
        env = json.loads(order)["env"]
        self.node_rank, self.attempt = env["NODE_RANK"], env["HARNESS_ATTEMPT"]
        self.began, self.oom_before = time.time(), oom_counts()
        self._name()
        assert self.child.stdin is not None
        with contextlib.suppress(OSError):  # a torchrun that died waiting: its end is the node's
            self.child.stdin.write(order.encode() + b"\n")
            self.child.stdin.close()
        self.standing_by.clear()
        self._sample()

    def _sample(self) -> None:
        threading.Thread(target=self.observer.watch_start, args=(STARTED_POLL, self.ended), daemon=True).start()
        if self.watch > 0:
            threading.Thread(target=self.observer.sample_every, args=(self.watch, self.ended, self.nodes),
                             daemon=True).start()

    def _free_read_output(self) -> None:
        """What torchrun has echoed of its workers' output given back, every FREE_SECONDS while the node runs."""
        if self.directory is None:
            return
        logs, freed = os.path.join(self.directory, "torchrun"), dict[str, int]()
        while not self.ended.wait(FREE_SECONDS):
            free_what_was_read(logs, self.child.pid, freed)

    def run(self) -> int:
        self._pump.start()
        threading.Thread(target=self._free_read_output, daemon=True).start()
        threading.Thread(target=self.obey_controller, daemon=True).start()
        if not self.standing_by.is_set():
            self._sample()
        code = self.child.wait()
        self.ended.set()
        with self._kill_lock:  # not while a KILL runs the cleanup, a child of ours with our environment
            self._sweep()  # workers that outlived their torchrun, daemons the job left behind
        # Its last output before its exit, however slowly the controller reads it; a process that escaped the sweep
        # holding the pipe (its output has stopped) is not waited for.
        while self._pump.is_alive():
            passed = self.passed
            self._pump.join(timeout=SWEEP_SECONDS)
            if self.passed == passed and not self.passing:
                break
        if code != 0 and (killed := oom_kills(self.observer.seen, self.began, self.oom_before)):
            self.say(Kind.OOM, oom_body(killed))
        self._send_results()
        return code

    def _send_results(self) -> None:
        """What the ranks of a function launch left (harness.api.rank), to the controller."""
        folder = os.path.join(self.directory or "", RESULTS_FOLDER)
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(folder) if self.directory else [], key=lambda n: (len(n), n)):
                if name.isdigit():
                    with open(os.path.join(folder, name), "rb") as result:
                        for body in result_bodies(int(name), result.read()):
                            self.say(Kind.RESULT, body)

    def end(self, code: int) -> None:
        """The node's end said, and kept for a controller to take while one may come; then nothing is left."""
        if self.store_port is not None:
            release_store(self.run_id, self.store_port)
        self.say(Kind.NODE_EXIT, str(code))
        self.await_delivery()
        self.link.close()
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def free_what_was_read(logs: str, reader: int, freed: dict[str, int]) -> None:
    """The blocks of the files under logs (torchrun's copies of its workers' output) that reader (torchrun: --tee
    tails each file and echoes what it reads) has read, given back to the file system: a chatty job then takes no
    more of the node's disk than torchrun has yet to echo. Each file keeps its size, a hole where it was read
    (fallocate's PUNCH_HOLE; where the file system has none, the file stays whole). freed: path -> bytes freed."""
    try:
        descriptors = os.listdir(f"/proc/{reader}/fd")
    except OSError:
        return
    for fd in descriptors:
        try:
            path = os.readlink(f"/proc/{reader}/fd/{fd}")
            if not path.startswith(logs + os.sep):
                continue
            with open(f"/proc/{reader}/fdinfo/{fd}", encoding="ascii") as info:
                fields = dict(line.split(":", 1) for line in info if ":" in line)
            read = int(fields["pos"]) // BLOCK * BLOCK
            if int(fields["flags"], 8) & os.O_ACCMODE != os.O_RDONLY or read <= freed.get(path, 0):
                continue
            file = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                if _libc.fallocate(file, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, read) == 0:
                    freed[path] = read
            finally:
                os.close(file)
        except (OSError, KeyError, ValueError):
            continue



def _private_directory(hook: str, standby: str = "") -> tuple[str | None, str]:
    """(a directory of the agent's own, mode 0700 so that no other user can put code there, holding the
    rank hook as sitecustomize.py (and a standby's program as standby.py), ""); or (None, why) where the node's
    temporary directory takes none: the ranks then run without the hook, and their collectives are not read,
    for that reason (a standby cannot run: its node starts afresh). Its name says whose it is, so that the next
    agent here removes it when its own agent was killed before it could."""
    remove_orphaned(tempfile.gettempdir())
    try:
        directory = tempfile.mkdtemp(prefix=f"harness-agent-{os.getpid()}-{start_ticks(os.getpid())}-")
        for name, text in (("sitecustomize.py", hook), ("standby.py", standby)):
            if text:
                with open(os.path.join(directory, name), "w", encoding="utf-8") as handle:
                    handle.write(text)
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


def main(argv: list[str]) -> None:
    run_id, node_rank, attempt, grace, silence, watch, command, cleanup, hook, standby, secrets, hold, store, nodes, \
        collapse = argv[:15]
    if "SLURM_STEP_ID" in os.environ:
        # Slurm's time-limit warning reaches every process of the step (scancel --signal=USR1): the training
        # processes catch it and checkpoint; the agent and torchrun (which inherits this) must live on.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        agent = Agent(run_id, node_rank, attempt, float(grace), float(silence), float(watch), command, cleanup, hook,
                      standby, json.loads(secrets), float(hold), int(store) if store else None, int(nodes),
                      float(collapse))
    except OSError as exc:
        sys.stdout.write(f"harness node agent: cannot run the node's command: {exc.strerror or exc}\n")
        sys.stdout.flush()
        os.write(1, message_line(Kind.NODE_EXIT, "127"))
        os._exit(127)
    code = agent.run()
    agent.end(code)
    os._exit(code if code >= 0 else 128 - code)  # no exit-time flush into a closed pipe


if __name__ == "__main__":
    main(sys.argv[1:])
