"""The controller's end of the node agent protocol (harness.node.agent), whatever carries the bytes.

A target starts the agent with `agent_argv` (a local pipe, an SSH channel, an srun step) and wraps
the stream in an AgentNode subclass; `start_all` sends the agent itself as the first line of its
stdin (harness.targets.boot), and the supervisor then sees one NodeProcess contract on every target.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import queue
import shlex
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

from harness.node.protocol import (
    COLLAPSE_ABOVE,
    COLLAPSE_SECONDS,
    MARKER,
    Kind,
    Message,
    Word,
    split_line,
    unescape_output,
    word_line,
)
from harness.plan.planner import NodePlan
from harness.plan.shell import shell_command, standby_command, standby_order, why_cold
from harness.spec.job import JobSpec
from harness.spec.secrets import env_apart
from harness.targets.base import Messages, NodeProcess, Outcome
from harness.targets.boot import BOOT, shipped, source

OUTPUT_DRAIN_SECONDS = 5.0  # after the agent ended, how long its last lines may take to be read
PING_SECONDS = 2.0  # how often the controller tells each agent it is still there
# Linux's longest single argument to execve (32 pages of 4 KiB): the node's shell line is one (`sh -c LINE`).
MAX_ARG_STRLEN = 32 * 4096
RANK_HOOK = source("rank_hook")  # the agent installs it for the node's Pythons (harness.node.rank_hook)
STANDBY = source("standby")  # ... and a standby's program (harness.node.standby)
READ_BYTES = 1 << 16  # a pipe's default capacity: one read takes all a busy node wrote meanwhile


def agent_argv(python: str, node: NodePlan) -> list[str]:
    """The agent under `python -I -S`: no site-packages, so it can only ever use the standard library.
    Its code and the node's command come on stdin (agent_program): `ps` shows the run and the node."""
    return [python, "-I", "-S", "-c", BOOT, "harness-agent", node.env["HARNESS_RUN_ID"], "node",
            node.env["NODE_RANK"], "attempt", node.env["HARNESS_ATTEMPT"]]


def agent_program(node: NodePlan, grace: float, silence: float, watch: float, hold: float = 0.0,
                  standby: bool = False, secrets: Mapping[str, str] | None = None, nodes: int = 1) -> bytes:
    """The first line of the agent's stdin: the agent, and what it runs. silence: seconds without a
    word from the controller after which the agent takes it for gone; hold: how long it then holds its node for
    another (supervision.grace; 0: it stops it at once); watch: seconds between its health samples (0: none);
    nodes: the job's, which make them less frequent where the controller would take too many (protocol.paced), and
    say whether its agent collapses its ranks' identical lines (protocol.RankLines: a job of more than COLLAPSE_ABOVE
    ranks, a node of several);
    standby: the node's torchrun and workers started to wait for its order (Standbys); secrets: values for the
    node's environment that go nowhere else (spec/secrets.py). The node's env values whose names look secret go with
    them, not on the node's line: the agent runs that line as `sh -c LINE`, whose command line any user may read."""
    plain, hidden = env_apart(node.env)
    command = shell_command(replace(node, env=plain))
    if len(command.encode()) >= MAX_ARG_STRLEN:  # the node's exec would fail there (a standby's worker's, started
        raise OSError(errno.E2BIG, os.strerror(errno.E2BIG))  # cold, too): fail here, before any start
    if standby:
        command = standby_command(replace(node, env=plain))
    return shipped("agent", [*_identity(node).values(), f"{grace:g}", f"{silence:g}", f"{watch:g}", command,
                             shlex.join(node.cleanup), RANK_HOOK, STANDBY if standby else "",
                             json.dumps(hidden | dict(secrets or {})), f"{hold:g}",
                             "" if node.store_port is None else str(node.store_port), str(nodes),
                             f"{collapse_seconds(nodes, len(node.ranks)):g}"])


def collapse_seconds(nodes: int, ranks: int) -> float:
    """How long a node's agent holds its ranks' lines for identical copies (0: it says each as it comes)."""
    return COLLAPSE_SECONDS if ranks > 1 and nodes * ranks > COLLAPSE_ABOVE else 0.0


def relay_argv(python: str, node: NodePlan) -> list[str]:
    """harness.node.link on the node's host: the way back to its agent, once that agent lost its controller."""
    return [python, "-I", "-S", "-c", BOOT, "harness-relay", *_identity(node).values()]


def relay_program(node: NodePlan, resume_from: int | None) -> bytes:
    """resume_from: where in the agent's stream the run's logs of the node end (None: not known)."""
    return shipped("link", [*_identity(node).values(), "" if resume_from is None else str(resume_from)])


def agent_silence(connect_timeout: float) -> float:
    """How long an agent waits for a word before it takes the controller for gone: several pings and
    a connection timeout's worth of margin, so that a busy controller is never mistaken for a lost one."""
    return max(5 * PING_SECONDS, 3 * connect_timeout)


def _identity(node: NodePlan) -> dict[str, str]:
    """What the node's processes carry in their environment: run, node and attempt (the agent sweeps by them)."""
    return {key: node.env[key] for key in ("HARNESS_RUN_ID", "NODE_RANK", "HARNESS_ATTEMPT")}


def agent_env(node: NodePlan) -> dict[str, str]:
    """The agent carries its node's identity too, so that a sweep by run id also finds a stuck agent."""
    return _identity(node)


def _agent_times(spec: JobSpec) -> tuple[float, float, float]:
    return spec.timeouts.stop_grace, agent_silence(spec.timeouts.connect), spec.health.sample_seconds


def start_all(nodes: Iterable[NodePlan], start: Callable[[NodePlan], AgentNode], spec: JobSpec,
              standbys: Standbys | None = None, secrets: Mapping[str, str] | None = None,
              held: bool = False, no_standby: str = "") -> list[NodeProcess]:
    """Every node or none: if one cannot start, the ones already started are killed. A node with a standby
    on its host gets it (its order sent); the others a new agent, which gets its program first (see
    agent_program) with secrets (spec/secrets.py), and say why they start cold (no_standby: the target's reason,
    where it keeps none). held: the agents hold their nodes for supervision.grace when the controller is lost (a
    target where `harness attach` reaches them; others stop them at once)."""
    started: list[AgentNode] = []
    try:
        for node in nodes:
            warm, why = standbys.take(node) if standbys is not None else (None, no_standby)
            started.append(warm or start(node))
            if warm is None:
                started[-1].cold = why
                started[-1].boot(agent_program(node, *_agent_times(spec), spec.supervision.grace if held else 0.0,
                                               secrets=secrets, nodes=spec.nnodes))
                started[-1].talk()
    except BaseException:
        for process in started:
            process.kill()
        raise
    return list(started)


def attach_all(nodes: Iterable[NodePlan], start: Callable[[NodePlan], AgentNode],
               resume: Mapping[int, int]) -> list[NodeProcess]:
    """A relay to every node's agent (start runs relay_argv where the node runs); a node whose agent is gone
    ends at once, without an exit code: lost. resume: by node rank, where in its agent's stream the run's logs of
    it end (record.stream.resume_points): the agent sends it again from there."""
    attached: list[AgentNode] = []
    for node in nodes:
        attached.append(start(node))
        attached[-1].position = resume.get(node.node_rank, 0)
        attached[-1].boot(relay_program(node, resume.get(node.node_rank)))
        attached[-1].talk()
    return list(attached)


def same_place(standby: NodePlan, node: NodePlan) -> bool:
    """Whether a standby started as `standby` can become `node`: the same host, interpreter, directory and
    setup (the rest is the order's)."""
    return (standby.host, standby.argv[0], standby.workdir, standby.setup) == (node.host, node.argv[0], node.workdir,
                                                                                node.setup)


def standing_by(node: NodePlan) -> NodePlan:
    """node as a standby: an identity of its own (NODE_RANK `standby-HOST`), which its agent and every process it
    starts carry in their environment for good (harness.node.proctable finds them by it). The plan's rank is not the
    one of the node it will be (the next attempt may leave a host out): on a machine that several hosts share
    (simulated nodes, testbed/cluster.py), a node's end would otherwise sweep the standby-born node that carries
    its rank, agent and ranks."""
    return replace(node, env={**node.env, "NODE_RANK": f"standby-{node.host}"})


class Standbys:
    """The nodes of an attempt started before it, one per host: each an agent whose torchrun and warm workers have
    done their imports (node/standby.py) and wait for its order -- the first attempt's while the controller checks
    the job, a restart's while the attempt before runs. The attempt takes the one on each of its hosts (start_all)
    and starts the others afresh, saying why; a standby that died, or stands where its node would not (another
    interpreter, directory, setup), is ended instead."""

    def __init__(self) -> None:
        self._on: dict[str, AgentNode] = {}
        self._failed: dict[str, str] = {}  # host -> why its standby could not start
        self._lock = threading.Lock()

    def stand_by(self, nodes: Sequence[NodePlan], start: Callable[[NodePlan], AgentNode], spec: JobSpec,
                 secrets: Mapping[str, str] | None = None, as_planned: bool = False) -> None:
        """One standby on each host of nodes that has none; a host where it cannot start simply has none. The
        standbys on other hosts (down since) are ended. secrets: as start_all's. as_planned: nodes are their attempt's
        as it will start (the first attempt's plan), and each standby is its node from its start, with its identity
        (its setup sees its NODE_RANK); else each has one of its own (standing_by). Once it is its attempt's node, its
        agent holds it for supervision.grace when the controller is lost, as start_all's held agents do (every target
        with standbys has them)."""
        wanted = {node.host for node in nodes}
        with self._lock:
            gone = [self._on.pop(host) for host in list(self._on) if host not in wanted]
        for agent in gone:  # an unreachable host's may take its connection's timeout to be seen gone
            threading.Thread(target=agent.end, daemon=True).start()
        for node in nodes:
            with self._lock:
                if why_cold(node) or node.host in self._on:
                    continue
            standby = node if as_planned else standing_by(node)
            try:
                program = agent_program(standby, *_agent_times(spec), spec.supervision.grace, standby=True,
                                        secrets=secrets, nodes=spec.nnodes)
                agent = start(standby)
            except Exception as exc:  # noqa: BLE001 - whatever the transport (or the OS) refuses, it has none
                with self._lock:
                    self._failed[node.host] = f"its standby could not start ({exc})"
                continue
            agent.boot(program)
            agent.talk()
            with self._lock:
                self._on[node.host] = agent
                self._failed.pop(node.host, None)

    def take(self, node: NodePlan) -> tuple[AgentNode | None, str]:
        """The standby on node's host, now node; or None and why there is none it can be."""
        with self._lock:
            agent = self._on.pop(node.host, None)
            failed = self._failed.pop(node.host, "")
        if agent is None:
            return None, why_cold(node) or failed or "no standby was started for it"
        if not agent.running():
            agent.end()
            return None, "its standby ended before its order"
        if not same_place(agent.node, node):
            agent.end()
            return None, "its standby was started with another interpreter, directory or setup"
        agent.go(node, standby_order(agent.node, node))
        return agent, ""

    def hosts(self) -> set[str]:
        with self._lock:
            return set(self._on)

    def stand_down(self) -> None:
        """End every standby (the run is over, or its hosts changed)."""
        with self._lock:
            ending, self._on = list(self._on.values()), {}
        for agent in ending:
            agent.kill()
        for agent in ending:
            agent.end()


class AgentNode(ABC):
    """One node as the supervisor sees it: lines in, TERM/KILL words out, the exit code from the agent."""

    def __init__(self, node: NodePlan) -> None:
        self.node = node
        self.started_as = node  # a standby's plan, once it became self.node: the identity its processes carry
        self.messages: Messages = queue.Queue()  # the agent's messages but node-exit
        self._exit_code: int | None = None
        self._output_done = threading.Event()
        self._send_lock = threading.Lock()
        self._talking = False
        self.warm = False  # a standby that became this node (Standbys)
        self.cold = ""  # why it did not (start_all)
        # While its agent replays what it kept unwatched: the time its node said the block output() yields (None:
        # live), and the UNWATCHED message's fields (lost_at, bytes, dropped) once it came.
        self.said_at: float | None = None
        self.unwatched: dict[str, float | None] | None = None
        self.replayed = threading.Event()  # the agent's replay is over (or the output ended): live from here
        # Where in the agent's stream (its bytes, but the replay's own messages) the lines output() has yielded end,
        # and where the lines it has read end: a new controller is sent the stream again from the former.
        self.position = 0
        self._read_to = 0
        self.relinked = False  # _chunks gives a new link's first chunk: the stream comes again from self.position
        # Read by the controller's one reading thread (control/output.py's Streams) instead of a thread of its own:
        # what it read for this node, and whether the link ended (drive()).
        self._fed: collections.deque[bytes] | None = None
        self._fed_all = False

    def readable(self) -> int | None:
        """The descriptor a selector may wait on for this link's output, read then by read_ready (None: the link is
        read by a thread of its own, through _chunks)."""
        return None

    def read_ready(self) -> bytes | None:
        """What the link holds now, once readable() said it holds something (b"": it ended; None: nothing whole yet);
        OSError where it broke."""
        raise NotImplementedError

    def drive(self) -> None:
        """From now on output() takes what feed() is given, not what _chunks reads, and yields None whenever it has
        nothing more to work on: the controller's reading thread reads every such node (control/output.py's Streams)."""
        self._fed = collections.deque()

    def feed(self, data: bytes) -> None:
        """What the reading thread read (b"": the end of the link)."""
        assert self._fed is not None
        if data:
            self._fed.append(data)
        else:
            self._fed_all = True

    def _fed_chunks(self) -> Iterator[bytes | None]:
        assert self._fed is not None
        while self._fed or not self._fed_all:
            yield self._fed.popleft() if self._fed else None

    @abstractmethod
    def _chunks(self) -> Iterable[bytes]:
        """The agent's raw stdout as it arrives, in chunks of any size, until it ends (raising
        OSError/EOFError when the link breaks)."""

    @abstractmethod
    def _send(self, data: bytes) -> None:
        """Write to the agent's stdin (raising OSError when the agent is gone)."""

    @abstractmethod
    def _wait_agent(self) -> str:
        """Block until the agent has ended; say how it ended, for when it reported no exit code."""

    @abstractmethod
    def running(self) -> bool:
        """Whether the agent still runs (a standby's, before it is taken)."""

    @abstractmethod
    def _agent_lost(self) -> None:
        """The agent ended without reporting, so it may not have stopped its node: what the backend can do."""

    def output(self) -> Iterator[str | None]:
        """The node's lines, in blocks of whole lines as they arrive (each line ends with a newline); the
        agent's messages go to self.messages (node-exit is kept as the exit code). A message may follow a
        worker's unfinished line: that part joins the worker's next line. Chunks without a message (nearly
        all) pass whole: the stream costs per read, not per line. None: a driven node (drive()) has been given
        nothing more yet."""
        pending = b""  # the start of a line whose end has not arrived
        unfinished = b""  # a worker's text before a message on the same line
        unfinished_at = 0  # where it starts in the stream
        self._read_to = self.position
        try:
            for chunk in self._chunks() if self._fed is None else self._fed_chunks():
                if chunk is None:
                    yield None
                    continue
                if self.relinked:
                    pending, unfinished, self._read_to, self.relinked = b"", b"", self.position, False
                data = pending + chunk
                cut = data.rfind(b"\n") + 1
                pending, whole = data[cut:], data[:cut]
                if not whole:
                    continue
                if MARKER not in whole:
                    self._read_to += len(whole)
                    self.position = self._read_to
                    yield _text(unfinished + whole)
                    unfinished = b""
                    continue
                text = []
                for raw in whole.splitlines(keepends=True):
                    node_text, message = split_line(raw)
                    if node_text and not unfinished:
                        unfinished_at = self._read_to
                    self._read_to += len(raw)
                    if node_text is raw:
                        text.append(unfinished + raw)
                        unfinished = b""
                        continue
                    unfinished += node_text
                    if message is not None and message.kind in (Kind.AT, Kind.UNWATCHED, Kind.WATCHED):
                        self._read_to -= len(raw) - len(node_text)  # the replay's own words: not of the stream
                        if message.kind is not Kind.UNWATCHED and text:
                            self.position = unfinished_at if unfinished else self._read_to
                            yield _text(b"".join(text))  # at the time it was said
                            text = []
                    self._take(message)
                if text:
                    self.position = unfinished_at if unfinished else self._read_to
                    yield _text(b"".join(text))
                elif not unfinished:  # messages only, all taken: nothing of them to be sent again
                    self.position = self._read_to
            if rest := unfinished + pending:
                self.position = self._read_to + len(pending)
                yield _text(rest).rstrip("\r\n") + "\n"
        except (OSError, EOFError):
            return
        finally:
            self.said_at = None
            self.replayed.set()
            self._output_done.set()

    def _take(self, message: Message | None) -> None:
        if message is None:
            return
        with contextlib.suppress(ValueError, TypeError):  # a damaged replay message loses its times, not the node
            if message.kind is Kind.NODE_EXIT:
                self._exit_code = int(message.body)
            elif message.kind is Kind.UNWATCHED:
                self.unwatched = {key: float(value) if value is not None else None
                                  for key, value in json.loads(message.body).items()}
                self.said_at = self.unwatched.get("lost_at")
                if (begin := self.unwatched.get("from")) is not None:
                    self._read_to = int(begin)
            elif message.kind is Kind.AT:
                self.said_at = float(message.body)
            elif message.kind is Kind.WATCHED:
                self.said_at = None
                self.replayed.set()
                self._read_to = int(json.loads(message.body)["at"])
            else:
                self.messages.put(message._replace(received=time.time()))

    def wait(self) -> Outcome:
        lost = self._wait_agent()
        self._output_done.wait(timeout=OUTPUT_DRAIN_SECONDS)
        if self._exit_code is None:
            self._agent_lost()
            return Outcome(exit_code=None, error=lost)
        return Outcome.from_returncode(self._exit_code)

    def boot(self, program: bytes) -> None:
        """Send the agent its program; an agent that died at once is reported by wait(), not here."""
        with self._send_lock, contextlib.suppress(OSError, EOFError):
            self._send(program)

    def _word(self, word: Word, argument: str = "") -> None:
        with self._send_lock, contextlib.suppress(OSError, EOFError):  # an ended agent needs no word
            self._send(word_line(word, argument))

    def talk(self) -> None:
        """PING every PING_SECONDS until the node's output ends: the agent's proof that we are there."""
        if not self._talking:
            self._talking = True
            PINGER.add(self)

    def talking(self) -> bool:
        return not self._output_done.is_set()

    def ping(self) -> None:
        self._word(Word.PING, f"{time.time():.6f}")

    def go(self, node: NodePlan, order: str) -> None:
        """The standby becomes node: its agent passes the order to the waiting torchrun."""
        self.node, self.warm = node, True
        self._word(Word.GO, order)

    def end(self) -> None:
        """A standby never taken: KILL, and wait for its agent (its output is nobody's)."""
        self.kill()
        self._wait_agent()

    def terminate(self) -> None:
        self._word(Word.TERM)

    def request_stacks(self, tag: str) -> None:
        self._word(Word.STACKS, tag)

    def kill(self) -> None:
        self._word(Word.KILL)


class Pinger:
    """One thread that pings every talking agent, not one per agent: at 2,048 nodes those were 2,048 threads taking
    turns at the GIL. A word is one short write to a pipe or channel that the agent keeps reading (its buffer holds
    hours of pings), so one agent cannot hold up the others' pings."""

    def __init__(self) -> None:
        self._agents: list[AgentNode] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, agent: AgentNode) -> None:
        with self._lock:
            self._agents.append(agent)
            if self._thread is None:
                self._thread = threading.Thread(target=self._ping, name="harness-pinger", daemon=True)
                self._thread.start()

    def _ping(self) -> None:
        tick = threading.Event()
        while not tick.wait(PING_SECONDS):
            with self._lock:
                self._agents = [agent for agent in self._agents if agent.talking()]
                agents = list(self._agents)
            for agent in agents:
                agent.ping()


PINGER = Pinger()


def _text(passed: bytes) -> str:
    """Lines of the node's own output, as its agent passed them (protocol.escape_output), as the node said them."""
    return unescape_output(passed).decode("utf-8", errors="replace")


class ChildAgentNode(AgentNode):
    """The agent behind a child process's pipes: the agent itself (local), or srun carrying a remote one.
    The child runs in a session of its own, so a Ctrl-C in the terminal reaches only the controller."""

    def __init__(self, node: NodePlan, argv: list[str], env: Mapping[str, str]) -> None:
        super().__init__(node)
        self._proc = subprocess.Popen(argv, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    def _chunks(self) -> Iterator[bytes]:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while chunk := os.read(fd, READ_BYTES):
            yield chunk

    def readable(self) -> int | None:
        assert self._proc.stdout is not None
        return self._proc.stdout.fileno()

    def read_ready(self) -> bytes:
        assert self._proc.stdout is not None
        return os.read(self._proc.stdout.fileno(), READ_BYTES)

    def _send(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def running(self) -> bool:
        return self._proc.poll() is None

    def _child_ended(self) -> str:
        """Wait for the child; how it ended, in words."""
        return Outcome.from_returncode(self._proc.wait()).describe()
