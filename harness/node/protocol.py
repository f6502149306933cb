"""The node agent's protocol, both ends of it, and the one place it is described: what the controller says
on the agent's stdin (Word) and what the agent says among the node's output on its stdout (Message).
Standard library only: shipped to nodes with the agent (harness.targets.boot) and imported by the controller
(harness.targets.agent_link, harness.control), so that the two ends cannot drift apart.

Controller -> agent: the first line of stdin is the agent's program and arguments (agent_link.agent_program);
then one Word per line. End of file, or SILENCE seconds without a word, means the controller or its
connection is gone (the kernel closes a dead process's pipes, sshd the channel of a dropped connection; a
network that drops silently stays silent): the agent holds the node for a new controller (ATTACH, through
harness.node.link's control socket) for HOLD seconds, then sends TERM, waits GRACE seconds, then KILL.

Agent -> controller: any line is the node's combined output, except those that begin with MARKER: each is
a Message, written by one write(2) of at most PIPE_BUF bytes so that no worker's output can split one (a
worker's unfinished line may precede it: `split_line` takes it apart, and the reader joins that part to the
worker's next line). The node's output never holds MARKER: the agent passes it through `escape_output`, which
follows each of its RS bytes (MARKER's first) with a US byte, and the controller reads it back through
`unescape_output`; so no byte a rank prints can be taken for a message (a forged NODE_EXIT, a replay's offsets).

The node's output itself: in a job of more than COLLAPSE_ABOVE ranks, an agent with several ranks holds their
lines (`[rank9]: TEXT`, torchrun's prefix) for COLLAPSE_SECONDS and says identical ones from several of its ranks as
one line, `[ranks 8-15]: TEXT` (RankLines): at scale the same warning or step line comes from every rank, and the
controller, its terminal and its record take one line where they took eight. Each rank's lines keep their order;
`expanded` gives every rank's line again (the controller's slow path, `harness logs`, a terminal that shows every
line).
"""

from __future__ import annotations

import base64
import bisect
import collections
import json
import re
from collections.abc import Container, Iterable
from enum import Enum
from typing import Any, NamedTuple

COLLAPSE_ABOVE = 4  # ranks in a job beyond which identical lines of its ranks collapse (harness launch --no-collapse:
# the terminal shows every one)
COLLAPSE_SECONDS = 0.25  # how long an agent holds its ranks' lines for identical copies from its other ranks
COLLAPSE_BYTES = 1 << 16  # held beyond which an agent says them at once
MOST_COLLAPSED = 1024  # ranks a collapsed line may name where its node's are not known (a node has fewer)

MARKER = b"\x1eharness-"
RS = MARKER[:1]  # ASCII's record separator: every message begins with it
ESCAPED_RS = RS + b"\x1f"  # an RS of the node's own output, as the agent passes it: followed by a unit separator
CHUNK = 3000  # characters of a stacks answer's JSON per message: every line stays within PIPE_BUF (4096)
SAMPLES_PER_LINE = 24  # 24 ranks' health samples stay within PIPE_BUF, however large each number
YOUNG_SECONDS = 30.0  # an attempt this young is sampled every YOUNG_EVERY seconds
YOUNG_EVERY = 1.0
# The health samples a controller takes a second at most, whatever the job's size (one per node per sample: paced)
HEALTH_MESSAGES_PER_SECOND = 500
CLOCK_PINGS = 30  # the controller's pings whose clock a node's offset is taken from (a minute's: clocks drift)


class Word(str, Enum):  # noqa: UP042 - not StrEnum: a host's Python may predate 3.11
    """Controller -> agent, one per line of the agent's stdin (after the first line: its program)."""

    TERM = "TERM"  # SIGTERM to the node's process group
    # SIGKILL to the group; then, until none is left (2 s at most), SIGKILL to every process whose environment has
    # this HARNESS_RUN_ID, NODE_RANK and HARNESS_ATTEMPT (torchrun starts its workers in sessions of their own; a
    # late agent of an earlier attempt never touches the next one) and to every descendant of the agent (a child
    # subreaper: double-forked daemons come back to it); then the node's CLEANUP once (`docker rm --force`)
    KILL = "KILL"
    # `PING [T]`: the controller is still there (every agent_link.PING_SECONDS); T, its clock as it sent it: the
    # agent says how far its own clock is ahead of the controller's (the least `now - T` of the recent pings,
    # ControllerClock) with its arrivals, which are compared across hosts on the controller's clock
    PING = "PING"
    # `STACKS TAG`: every rank's stack and its DataLoader workers' (py-spy) and its last collectives (Flight
    # Recorder), answered as STACKS messages, then STACKS_DONE: first each rank's collectives alone (milliseconds),
    # then each rank's whole answer, which replaces it (py-spy takes a while per rank); a node with no ranks yet
    # answers with its launcher's stack instead (LAUNCHER_RANK)
    STACKS = "STACKS"
    # `GO ORDER`: a standby node (agent started with STANDBY) becomes its attempt's node: ORDER, one JSON line
    # ({"env": the node's env, "args": torchrun's arguments}), goes to the waiting torchrun's stdin
    GO = "GO"
    # `ATTACH RUN_ID [FROM]`: the first word on a node agent's control socket (harness.node.link): a new controller
    # takes back the node of the run that lost its own, whose logs end at FROM in the agent's stream; the agent
    # answers UNWATCHED, the stream from there (what it kept), WATCHED, then live
    ATTACH = "ATTACH"


class Kind(str, Enum):  # noqa: UP042 - as Word
    """Agent -> controller: the kind of a message line."""

    HEALTH = "health"  # every sample_interval(WATCH, age, NODES): each rank's RankSample, SAMPLES_PER_LINE ranks a line
    STACKS = "stacks"  # `TAG RANK PART LAST CHUNK`: a chunk of one rank's stacks answer (StackChunks)
    STACKS_DONE = "stacks-done"  # `TAG`: every rank's stacks for TAG were sent
    # with each health sample: the node's ranks' arrivals at the collectives all of them arrived at since its last,
    # a CollectiveArrivals each (an agent of an older harness: each rank's Arrivals since its last, by rank)
    ARRIVALS = "arrivals"
    OOM = "oom"  # before the exit: {rank: the kernel's line} of ranks the OOM killer ended (harness.node.oom)
    NODE_EXIT = "node-exit"  # `CODE`: the node ended (negative: killed by that signal); the agent's last word
    # `RANKS`: the node's ranks exist (comma-separated), said once: its torchrun's rendezvous completed and it started
    # its workers (the controller's rendezvous deadline, control/health_loop.py)
    STARTED = "started"
    # `JSON` {"lost_at", "bytes", "dropped", "from"}: the agent lost its controller at lost_at (its clock) and kept
    # what follows meanwhile (bytes; dropped: beyond its limit), until WATCHED; what follows is its stream from
    # `from` (harness.node.link)
    UNWATCHED = "unwatched"
    AT = "at"  # `T`: what follows, up to the next AT, was said at T by the node's clock (while unwatched)
    WATCHED = "watched"  # `JSON` {"at"}: what was kept is all here: the rest is live, from `at` in the stream
    # `` (empty): the node's rendezvous store is kept from its host's other users (harness.node.store_port); else why
    # not, in words. Said once, before the node's command starts, by the agent of a node that hosts the store.
    STORE = "store"
    # `RANK PART LAST CHUNK`: a chunk (base64) of what a rank of a function launch left in the agent's directory
    # (harness.api.rank: its return value or its exception, pickled), sent once the node's command ended, before
    # NODE_EXIT
    RESULT = "result"


# Where, in the agent's directory (HARNESS_AGENT_DIR), each rank of a function launch leaves its result as a file
# named by its rank (harness.api.rank), for the agent to send as RESULT messages.
RESULTS_FOLDER = "results"
# A STACKS answer under this rank is the node's launcher's, sent where the node has no ranks yet: its torchrun (or
# the shell still running the job's setup), {"pid", "state", "command", "threads"}, as a rank's answer has them.
LAUNCHER_RANK = -1


class RankSample(NamedTuple):
    """How far one rank has run (harness.node.ranks): what the controller judges hangs and slow ranks by."""

    pid: int
    state: str  # the main thread's scheduler state: R, S, D, T, t, Z
    cpu: float  # CPU seconds of the rank and every process below it
    busy: float  # seconds its main thread was on a CPU or waiting for one
    io: int  # bytes it and its children read and wrote
    completed: int = -1  # collectives it completed, by Flight Recorder (harness.node.collectives); -1: unread
    pending: float = -1.0  # seconds its oldest unfinished collective has waited; -1: none (or unread)
    gpu_util: float = -1.0  # % of the SMs' time its processes ran kernels since the last sample (harness.node.gpu)
    gpu_memory: int = -1  # bytes of GPU memory its processes hold; -1 (both): no GPU known to the driver
    # Its agent's judgement of its progress (harness.node.ranks.ProgressWatch): seconds since its newest sample
    # that showed progress (since its first sample: none yet); -1: not said (an agent of an older harness)
    idle: float = -1.0
    still: float = -1.0  # seconds since its count of completed collectives last changed; -1: it never did


class Arrival(NamedTuple):
    """A collective a rank enqueued (harness.node.collectives.arrivals): its process group, sequence number, and
    when (ns, by its node's clock)."""

    group: str
    seq: int
    created_ns: int


class Message(NamedTuple):
    """received: when the controller read it off its node's stream (None: not read from one). Arrivals are put on
    the controller's clock by it (health/arrivals.py), and the thread that reads the stream stamps it at once: at
    2,048 nodes a listener thread woke tenths of a second later, and those lags named ranks slow that were not."""

    kind: Kind
    body: str
    received: float | None = None


class HealthSamples(NamedTuple):
    """A health message: every rank's sample, taken at t by the node's clock."""

    t: float
    samples: dict[int, RankSample]


class CollectiveArrivals(NamedTuple):
    """A node's ranks' arrivals at one collective (collectives.ArrivalsDigest), by the node's clock (ns): `at`, when
    those it does not name arrived, within DIGEST_SLACK of it (None: only the named are known, as an older agent
    says them); named: the others, rank -> when. A node says one number for most of its ranks, so that what the
    controller takes and weighs grows with the nodes, not the ranks, and still names a straggling rank exactly."""

    group: str
    seq: int
    at: int | None
    named: dict[int, int]


class NodeArrivals(NamedTuple):
    """An arrivals message: collectives the node's ranks arrived at, said at t by the node's clock; ahead: how far
    the node's clock is ahead of the controller's, as its pings showed (None: not known)."""

    t: float
    collectives: list[CollectiveArrivals]
    ahead: float | None = None


class StackAnswer(NamedTuple):
    """One rank's whole stacks answer (JSON) for the request TAG."""

    tag: str
    rank: int
    answer: object


def word_line(word: Word, argument: str = "") -> bytes:
    """ValueError for an argument with a control character: a newline in it would make a second word (`STACKS
    x\nKILL`), which the agent would obey."""
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in argument):
        raise ValueError(f"a word's argument may hold no control character: {argument!r}")
    return f"{word.value} {argument}\n".encode() if argument else f"{word.value}\n".encode()


def parse_word(line: bytes) -> tuple[Word, str] | None:
    """A line of the agent's stdin as (word, argument); None for a line that is no word."""
    name, _, argument = line.strip().decode(errors="replace").partition(" ")
    try:
        return Word(name), argument
    except ValueError:
        return None


def message_line(kind: Kind, body: str) -> bytes:
    return MARKER + f"{kind.value} {body}\n".encode()


def escape_output(output: bytes) -> bytes:
    """The node's own output as the agent passes it on: no RS in it begins a message (it never holds MARKER)."""
    return output.replace(RS, ESCAPED_RS)


def unescape_output(passed: bytes) -> bytes:
    """The node's own output again, from what escape_output made of it."""
    return passed.replace(ESCAPED_RS, RS)


def split_line(raw: bytes) -> tuple[bytes, Message | None]:
    """A line of the agent's stdout as (the node's own text before any message, the message). A message
    of a kind this end does not know is dropped: a newer agent must not break an older controller."""
    at = raw.find(MARKER)
    if at < 0:
        return raw, None
    name, _, body = raw[at + len(MARKER):].decode("utf-8", errors="replace").rstrip("\r\n").partition(" ")
    try:
        return raw[:at], Message(Kind(name), body)
    except ValueError:
        return raw[:at], None


def paced(seconds: float, nodes: int) -> float:
    """The seconds between one node's samples, at least `seconds`, and long enough that the controller takes at
    most HEALTH_MESSAGES_PER_SECOND health messages a second from nodes nodes: it reads them all on one thread
    (2,048 nodes sampled every second would be most of a core of JSON), so a job of many nodes is sampled less
    often: every 4.1 s at 2,048 nodes. The hang rules (harness.health.judge.stalled) judge by time, not by a
    count of samples: a hang is still found, within health.stall + one interval of the first sample that saw its
    rank idle (of its collective's start, for one stuck in a collective) and a tick of the health loop; that is
    stall + two intervals of its last progress at most (the interval it stopped in still shows some)."""
    return max(seconds, nodes / HEALTH_MESSAGES_PER_SECOND)


def sample_interval(every: float, age: float, nodes: int = 1) -> float:
    """The seconds to the next sample of an attempt age seconds old, of a job of nodes nodes: while it is young at
    most YOUNG_EVERY (paced), so that its first sample comes within a second of its ranks and a short run's course
    is known from its start (the agent's health samples, the controller's timeline.jsonl); every `every` (paced)
    after, so that a long run costs and keeps little."""
    steady = paced(every, nodes)
    return min(steady, paced(YOUNG_EVERY, nodes)) if age < YOUNG_SECONDS else steady


def health_bodies(t: float, samples: dict[int, RankSample]) -> list[str]:
    """One health sample of every rank, as message bodies of SAMPLES_PER_LINE ranks each."""
    ranks = [(str(rank), list(sample)) for rank, sample in sorted(samples.items())]
    return [json.dumps({"t": t, "ranks": dict(ranks[first:first + SAMPLES_PER_LINE])})
            for first in range(0, len(ranks), SAMPLES_PER_LINE)]


# The fields RankSample gained after its first five, in order, and how each is read: an older agent sends
# fewer, a newer one more.
LATER_FIELDS: dict[str, type] = {"completed": int, "pending": float, "gpu_util": float, "gpu_memory": int,
                                  "idle": float, "still": float}


def parse_health(body: str) -> HealthSamples:
    """ValueError, KeyError or TypeError for a damaged body."""
    payload = json.loads(body)
    samples = {int(rank): RankSample(int(pid), str(state), float(cpu), float(busy), int(io))._replace(
        **{name: LATER_FIELDS[name](value) for name, value in zip(LATER_FIELDS, fields)})  # noqa: B905 - fewer or more
        for rank, (pid, state, cpu, busy, io, *fields) in payload["ranks"].items()}
    return HealthSamples(float(payload["t"]), samples)


def arrivals_bodies(t: float, collectives: list[CollectiveArrivals], ahead: float | None = None) -> list[str]:
    """A node's collectives at its time t, as message bodies of at most CHUNK characters of collectives each (one
    message a sample, for all the node's ranks, in a healthy job). ahead: ControllerClock.ahead."""
    head = {"t": t} if ahead is None else {"t": t, "ahead": round(ahead, 6)}
    bodies: list[str] = []
    part: list[str] = []
    size = 0
    for one in collectives:
        text = json.dumps([one.group, one.seq, one.at, {str(rank): ns for rank, ns in sorted(one.named.items())}])
        if part and size + len(text) + 2 > CHUNK:
            bodies.append(_arrivals_body(head, part))
            part, size = [], 0
        part.append(text)
        size += len(text) + 2
    return bodies + ([_arrivals_body(head, part)] if part else [])


def _arrivals_body(head: dict[str, float], collectives: list[str]) -> str:
    return json.dumps(head)[:-1] + f', "collectives": [{", ".join(collectives)}]}}'


def parse_arrivals(body: str) -> NodeArrivals:
    """An arrivals message, or an older agent's (each rank's arrivals: a collective of its own, named); ValueError,
    KeyError or TypeError for a damaged body."""
    payload = json.loads(body)
    t, ahead = float(payload["t"]), None if payload.get("ahead") is None else float(payload["ahead"])
    if "collectives" in payload:
        return NodeArrivals(t, [_collective(*item) for item in payload["collectives"]], ahead)
    collectives = []
    for rank, arrived in _mapping(payload["ranks"]).items():
        number = int(rank)
        collectives += [CollectiveArrivals(str(group), int(seq), None, {number: int(ns)}) for group, seq, ns in arrived]
    return NodeArrivals(t, collectives, ahead)


def _collective(group: object, seq: object, at: object, named: object) -> CollectiveArrivals:
    said = CollectiveArrivals(str(group), int(str(seq)), None if at is None else int(str(at)),
                              {int(rank): int(str(ns)) for rank, ns in _mapping(named).items()})
    if said.at is None and not said.named:
        raise ValueError("a collective's arrivals say no time")
    return said


def _mapping(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"an arrivals message holds a {type(value).__name__} where a dict belongs")
    return value


class ControllerClock:
    """How far this node's clock is ahead of the controller's, from the controller's pings (`PING T`): the least
    `now - T` of the last CLOCK_PINGS. The controller stamps T as it writes and the agent reads its words at
    once, so the least is the offset within a few milliseconds; the controller's own delays in reading the
    agent's messages, which at 2,048 nodes are tenths of a second and differ by node, play no part (measured
    the other way, by when the controller read each message, they named ranks slow that were not)."""

    def __init__(self) -> None:
        self._heard: collections.deque[float] = collections.deque(maxlen=CLOCK_PINGS)

    def heard(self, sent: float, now: float) -> None:
        self._heard.append(now - sent)

    def ahead(self) -> float | None:
        return min(self._heard) if self._heard else None


def _chunked(head: str, text: str) -> list[str]:
    """text cut into message bodies of at most CHUNK characters of it: `HEAD PART LAST CHUNK`."""
    parts = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    return [f"{head} {number} {int(number == len(parts) - 1)} {part}" for number, part in enumerate(parts)]


def stacks_bodies(tag: str, rank: int, answer: object) -> list[str]:
    """One rank's stacks answer (JSON) cut into chunks: `TAG RANK PART LAST CHUNK`."""
    return _chunked(f"{tag} {rank}", json.dumps(answer))


# What tells ranks with alike stacks apart: their processes, threads and collectives (with each one's enqueue time).
OWN_KEYS = ("pid", "collectives")


def alike_answers(answers: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Stacks answers as an agent sends them: ranks whose answers are alike but for who each is (its pid, its threads'
    ids, its DataLoader workers' alike, its collectives) as one answer, the first rank's, with each other rank's own
    parts under "alike" (answers_of makes them whole again). A node's ranks wait at the same line in a hang: its 8
    stacks of 5-20 KB each were sent 8 times, 16,384 times at 2,048 nodes."""
    first: dict[str, dict[str, Any]] = {}
    sent: dict[int, dict[str, Any]] = {}
    for rank, answer in sorted(answers.items()):
        own, rest = _own(answer)
        key = json.dumps(rest, sort_keys=True)
        if key in first:
            first[key].setdefault("alike", {})[str(rank)] = own
        else:
            first[key] = sent[rank] = dict(answer)
    return sent


def answers_of(rank: int, answer: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each rank's whole answer from one answer as alike_answers sends it; ValueError, KeyError or TypeError for a
    damaged one."""
    whole = {key: value for key, value in answer.items() if key != "alike"}
    alike = answer.get("alike", {})
    if not isinstance(alike, dict):
        raise TypeError(f"a stacks answer's alike ranks are a {type(alike).__name__}, not a dict")
    return {rank: whole, **{int(other): _with_own(whole, own) for other, own in alike.items()}}


def _own(answer: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what is the answer's rank's own, the rest) of an answer or of a DataLoader worker's."""
    threads, workers = answer.get("threads"), answer.get("workers", [])
    own = {key: answer[key] for key in OWN_KEYS if key in answer}
    rest = {key: value for key, value in answer.items() if key not in OWN_KEYS} | {"own": sorted(own)}
    if isinstance(threads, list):
        own["tids"] = [thread.get("tid") for thread in threads]
        rest["threads"] = [{key: value for key, value in thread.items() if key != "tid"} for thread in threads]
    if workers:
        parts = [_own(worker) for worker in workers]
        own["workers"], rest["workers"] = [part[0] for part in parts], [part[1] for part in parts]
    return own, rest


def _with_own(answer: dict[str, Any], own: object) -> dict[str, Any]:
    if not isinstance(own, dict):
        raise TypeError(f"a stacks answer's alike rank is a {type(own).__name__}, not a dict")
    made = {key: value for key, value in answer.items() if key not in OWN_KEYS} | \
        {key: own[key] for key in OWN_KEYS if key in own}
    if "tids" in own:
        made["threads"] = [{**thread, "tid": tid} for thread, tid in zip(answer["threads"], own["tids"], strict=True)]
    if "workers" in own:
        made["workers"] = [_with_own(worker, mine) for worker, mine in zip(answer["workers"], own["workers"],
                                                                            strict=True)]
    return made


def result_bodies(rank: int, result: bytes) -> list[str]:
    """What one rank of a function launch left (harness.api.rank), cut into chunks: `RANK PART LAST CHUNK`."""
    return _chunked(str(rank), base64.b64encode(result).decode("ascii"))


class StackChunks:
    """Reassembles the chunks of each rank's stacks answer, as they arrive from one agent."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], list[str]] = {}

    def take(self, body: str) -> StackAnswer | None:
        """The rank's answer once body was its last chunk; ValueError for a damaged body."""
        tag, rank, _, last, chunk = body.split(" ", 4)
        key = (tag, int(rank))
        self._parts.setdefault(key, []).append(chunk)
        if last != "1":
            return None
        return StackAnswer(tag, int(rank), json.loads("".join(self._parts.pop(key))))


class ResultChunks:
    """Reassembles the chunks of each rank's result (result_bodies), as they arrive from one agent."""

    def __init__(self) -> None:
        self._parts: dict[int, list[str]] = {}

    def take(self, body: str) -> tuple[int, bytes] | None:
        """(rank, its result) once body was its last chunk; ValueError for a damaged body."""
        rank, _, last, chunk = body.split(" ", 3)
        self._parts.setdefault(int(rank), []).append(chunk)
        if last != "1":
            return None
        return int(rank), base64.b64decode("".join(self._parts.pop(int(rank))), validate=True)


def oom_body(killed: dict[int, str]) -> str:
    return json.dumps({str(rank): line for rank, line in killed.items()})


def parse_oom(body: str) -> dict[int, str]:
    return {int(rank): str(line) for rank, line in json.loads(body).items()}


# -- The node's output: identical lines of several ranks as one.

RANK_LINE = re.compile(rb"\[rank(\d+)\]: ")
COLLAPSED = re.compile(r"\[ranks ([\d,-]+)\]: ")
RANKS_PREFIX = "[ranks "  # a collapsed line's beginning


def number_ranges(numbers: Iterable[int]) -> str:
    """Sorted numbers with runs of three or more as ranges: `0-3,8,10,11`."""
    runs: list[list[int]] = []
    for number in sorted(set(numbers)):
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ",".join(f"{a}-{b}" if b - a > 1 else ",".join(map(str, range(a, b + 1))) for a, b in runs)


def numbers_of(text: str, most: int | None = None) -> list[int] | None:
    """The numbers number_ranges wrote (`0-3,8`), in order; None: not such a text, or more than most of them."""
    numbers: list[int] = []
    for part in text.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            return None
        low, high = int(first), int(last) if dash else int(first)
        if high < low or (most is not None and len(numbers) + high - low >= most):
            return None
        numbers += range(low, high + 1)
    return numbers


def collapsed_ranks(line: str, ranks: Container[int] | None = None) -> tuple[list[int], str] | None:
    """A collapsed line's ranks and its text after the prefix; None: no collapsed line, or one that names a rank not
    in ranks (its node's; None: not known, and then at most MOST_COLLAPSED): a line any program could print is no
    way to make the controller write a million."""
    found = COLLAPSED.match(line)
    if found is None:
        return None
    numbers = numbers_of(found.group(1), MOST_COLLAPSED)
    if not numbers or (ranks is not None and not all(rank in ranks for rank in numbers)):
        return None
    return numbers, line[found.end():]


def expanded(text: str, ranks: Container[int] | None = None) -> str:
    """text (whole lines) with each collapsed line as its ranks' lines, in rank order. Lines end at \\n alone, as the
    agent ended them (str.splitlines would end one at a form feed or a separator a rank printed)."""
    if RANKS_PREFIX not in text:
        return text
    *whole, rest = text.split("\n")
    return "".join(own + "\n" for line in whole for own in each_ranks(line, ranks)) + rest


def each_ranks(line: str, ranks: Container[int] | None = None) -> list[str]:
    """line, or where its agent collapsed it from several ranks (of ranks, as collapsed_ranks), each rank's own."""
    found = collapsed_ranks(line, ranks) if line.startswith(RANKS_PREFIX) else None
    return [line] if found is None else [f"[rank{rank}]: {found[1]}" for rank in found[0]]


class RankLines:
    """An agent's ranks' lines, held for `seconds` after the first: identical ones of several ranks said as one. A
    line of no rank (torchrun's own, a rank's line with a carriage return) says what is held first, then itself, so
    that the node's lines keep their order; a rank's line joins the first held copy after its own last line."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.due: float | None = None  # when what is held is said (None: nothing is)
        self._groups: list[tuple[bytes, list[int]]] = []  # (text after the prefix, the ranks that said it)
        self._where: dict[bytes, list[int]] = {}  # text -> the indexes of its groups
        self._last: dict[int, int] = {}  # rank -> the group of its last held line
        self._held = 0  # bytes
        self._rest = b""  # a line's beginning whose end has not come, after what is held
        self._mid_line = False  # what was said last ended within a line: its end passes as it comes

    def take(self, chunk: bytes, now: float) -> bytes:
        """What to say now of chunk (and of what was held); the rest is held until due, or until said first."""
        said: list[bytes] = []
        data, self._rest = self._rest + chunk, b""
        if self._mid_line:
            end = data.find(b"\n") + 1
            if not end:
                return data
            said.append(data[:end])
            data, self._mid_line = data[end:], False
        *lines, rest = data.split(b"\n")
        for line in lines:
            found = RANK_LINE.match(line)
            if found is None or b"\r" in line:
                said += [self.flush(), line, b"\n"]
            else:
                self._hold(int(found.group(1)), line[found.end():])
        if self._held > COLLAPSE_BYTES:
            said.append(self.flush())
        if rest:
            if self._groups:
                self._rest = rest
            else:
                said.append(rest)
                self._mid_line = True
        if self._groups and self.due is None:
            self.due = now + self.seconds
        return b"".join(said)

    def flush(self) -> bytes:
        """Everything held, as it is said: each group once, in the order of its first line."""
        said = [b"[rank%d]: %s\n" % (ranks[0], text) if len(ranks) == 1 else
                b"[ranks %s]: %s\n" % (number_ranges(ranks).encode(), text) for text, ranks in self._groups]
        if self._rest:
            said.append(self._rest)
            self._mid_line = True
        self._groups, self._where, self._last, self._held, self._rest, self.due = [], {}, {}, 0, b"", None
        return b"".join(said)

    def _hold(self, rank: int, text: bytes) -> None:
        after = self._last.get(rank, -1)
        copies = self._where.setdefault(text, [])
        later = bisect.bisect_right(copies, after)
        if later < len(copies):
            at = copies[later]
        else:
            at = len(self._groups)
            self._groups.append((text, []))
            copies.append(at)
            self._held += len(text) + 16
        self._groups[at][1].append(rank)
        self._last[rank] = at
