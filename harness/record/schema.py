"""The run record's schema: what a run's state.json and summary.json hold (RunState, RunSummary and
their parts, among them RecordedNode: a node of an attempt as the record keeps it, beside the live
control/live.py LiveNode it is made from), written atomically and validated when read back, so that one
damaged file is reported as that run's problem instead of breaking every command that lists runs."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from harness.errors import UsageError
from harness.record.atomic import write_text_atomic

T = TypeVar("T")


class RunStatus(StrEnum):
    """A run's status. The controller writes the first six; `lost`, `unwatched` and `unreadable` are only shown."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by `harness stop`
    INTERRUPTED = "interrupted"  # by Ctrl-C or a SIGTERM to the controller
    ERROR = "error"  # the controller itself failed
    LOST = "lost"  # recorded as running, but its controller is gone
    # recorded as running, its controller gone, its nodes held by their agents for `harness attach` (supervision.grace)
    UNWATCHED = "unwatched"
    UNREADABLE = "unreadable"  # the record cannot be read


class FailureKind(StrEnum):
    """infra: the machines failed the program (a lost host or connection, a signal, a rendezvous that
    timed out); hang: the job made no progress for health.stall seconds and was stopped; program: the
    program itself failed; slow: a rank slowed the job, and a restart without its host cost less (the harness stopped
    the job, health/slowdown.py). restarts.on lists the kinds that are retried (spec.job.RESTART_KINDS)."""

    INFRA = "infra"
    HANG = "hang"
    PROGRAM = "program"
    SLOW = "slow"


@dataclass(frozen=True)
class ControllerId:
    """The controller's pid with its kernel start time: still identifies it after pid reuse."""

    pid: int
    start_ticks: int | None
    host: str | None = None  # the machine it runs on: another than the user's in a Slurm batch step


@dataclass(frozen=True)
class Unwatched:
    """A time the run's nodes ran on without a controller: from their agents' loss of it to another's attach."""

    attempt: int
    attached_at: float
    by: str  # PID@HOST: the controller that took the run back
    lost_at: float | None = None  # when the first agent lost its controller (its clock); None: no agent said


@dataclass(frozen=True)
class Origin:
    """Where a run was launched from, for `harness attach` to build its target again."""

    cwd: str  # the launch's working directory: the job's relative paths are its
    spec_file: str | None = None  # the job's spec file (None: made from a script's flags); its copy is masked
    hosts: str | None = None  # the inventory of SSH hosts (None: simulated nodes)
    known_hosts: str | None = None
    accept_new_host_keys: bool = False


@dataclass(frozen=True)
class RunState:
    run_id: str
    name: str
    mode: str  # the backend: local, ssh, slurm
    status: RunStatus
    started_at: float
    nnodes: int
    world_size: int
    controller: ControllerId
    hosts: list[str]  # of the current attempt
    ended_at: float | None = None
    error: str | None = None
    attempt: int = 0
    scheduler_job: str | None = None  # the batch system's job id (Slurm), which owns the processes
    metrics: str | None = None  # where its controller serves its metrics while it runs (health.metrics_port)
    grace: float = 0.0  # supervision.grace: how long its nodes are held when its controller is gone
    attempt_started_at: float | None = None  # when the current attempt started
    attempt_preflight_s: float = 0.0  # and how long its plan and check took before
    unwatched: list[Unwatched] = field(default_factory=list)  # the times it ran without a controller, in order
    origin: Origin | None = None  # None: not launched by this machine's user (a batch step, a pod), or an old record


@dataclass(frozen=True)
class RecordedNode:
    """A node of an attempt as the run record keeps it (control/live.py's LiveNode is the node while it runs)."""

    node_rank: int
    host: str
    ranks: list[int]
    exit_code: int | None
    signal: str | None  # SIGKILL, ...
    error: str | None  # a lost connection or agent
    duration_s: float
    log: str

    def describe(self) -> str:
        return self.error or (f"signal {self.signal}" if self.signal else f"exit {self.exit_code}")


@dataclass(frozen=True)
class Failure:
    """A node that failed on its own, and within it the rank that failed first (from torchrun's report).

    kind and evidence say why it counts as infra or program; host_down: the host itself is lost (its
    connection or node agent), so a spare takes its place in the next attempt."""

    node_rank: int
    host: str
    ranks: list[int]
    rank: int | None
    rank_exit_code: int | None
    exit_code: int | None
    description: str
    after_s: float
    last_lines: list[str]
    kind: FailureKind
    evidence: str
    host_down: bool = False
    error: str | None = None  # the failing rank's exception line
    error_at: str | None = None  # its innermost frame in the user's code: file:line, in function
    error_source: str | None = None  # that frame's source line
    hint: str | None = None  # advice for a known signature (worker_output.hint)

    def describe(self, verdict_said: bool = False) -> str:
        """Where and how: `node 1 (h2, global rank 1): exit code 1 after 3.2 s`, then the class and the
        evidence when they add to that. verdict_said: a hang's verdict was said already (the stream's `hang:`
        line), so it is pointed at instead of said again."""
        first, last = self.ranks[0], self.ranks[-1]
        who = f"global rank {self.rank}" if self.rank is not None else \
            f"global rank {first}" if first == last else f"global ranks {first}-{last}"
        text = f"node {self.node_rank} ({self.host}, {who}): {self.description} after {self.after_s} s"
        extra = "" if self.evidence in (self.description, f"rank {self.rank} {self.description}") \
            else ": the verdict above" if verdict_said and self.kind is FailureKind.HANG else f": {self.evidence}"
        return f"{text} ({self.kind.value}{extra})"


class HealthEventKind(StrEnum):
    """What the health watch said during an attempt (control/health_loop.py)."""

    SLOW = "slow"  # a rank its peers wait for (waited: the percentage of the time they do)
    RECOVERED = "recovered"  # a rank named slow is no longer
    HANG = "hang"  # no progress for health.stall seconds: text is the verdict
    WEIGHED = "weighed"  # a slowness that lasted health.slow_for weighed against a restart: text is the sum


@dataclass(frozen=True)
class HealthEvent:
    """One verdict of the health watch, kept so that status and the report show it after the run."""

    at: float
    kind: HealthEventKind
    text: str  # as the stream said it
    rank: int | None = None
    waited: float | None = None
    since: float | None = None  # slow, weighed: when the slowness began
    pace_before: float | None = None  # slow, weighed: the job's steps per second before it, and since
    pace_now: float | None = None
    acted: bool | None = None  # weighed: the job was stopped to restart without the slow host


@dataclass(frozen=True)
class Progress:
    """An attempt's course in steps, from the job's progress lines (the furthest any rank reported): its first
    and last step and when their lines came; new_at: when it first went past the furthest step of the attempts
    before it (the steps until then were done again; None: not yet); total: the run's steps where the lines say
    (`step 12/97`, `epoch 1/3 step 12/97`); rate: steps per second lately (None: not known yet); saving_s: the
    seconds its checkpoint saves took, where its lines say (health.checkpoint); resumed_step, resumed_at: the step
    a rank's line said it resumed at, and when (spec/progress.py; None: none said), restore_s the seconds that
    line said the restore took."""

    first_step: int
    first_at: float
    last_step: int
    last_at: float
    new_at: float | None = None
    total: int | None = None
    rate: float | None = None
    saving_s: float = 0.0
    resumed_step: int | None = None
    resumed_at: float | None = None
    restore_s: float | None = None

    def left_s(self) -> float | None:
        """Seconds to the last step at the recent rate (None: no total or no rate known)."""
        if self.total is None or not self.rate:
            return None
        return max(0.0, self.total - self.last_step) / self.rate


RESTART_PHASES = ("stop", "backoff", "preflight", "start-up", "rendezvous", "loading", "restore", "first step")


@dataclass(frozen=True)
class Restart:
    """How an attempt after a failed one came to its first step (record/goodput.restart_of), in seconds: its
    phases in the order of RESTART_PHASES, adding up to total_s, the run's one recovery figure: from the fault (the
    failure noticed, or the hang's verdict) to this attempt's first step line (stepped), or to the last phase seen
    when it had none. A phase the record cannot see (ranks not watched joining, no resume line) is left out and
    its time falls in the next one seen. steps_redone: the steps done again, which the earlier attempts had done
    (None: no progress lines), and redone_s the seconds they took (None: not yet past them)."""

    phases: dict[str, float]
    total_s: float
    steps_redone: int | None = None
    redone_s: float | None = None
    stepped: bool = True

    def describe(self) -> str:
        """`recovered in 5.80 s (stop 0.80 s, ...); 4 step(s) redone in 0.90 s`."""
        phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        text = f"recovered in {self.total_s:.2f} s ({phases})" if self.stepped else \
            f"no first step: {self.total_s:.2f} s from the fault ({phases})"
        if self.steps_redone is not None:
            text += f"; {self.steps_redone} step(s) redone" + (f" in {self.redone_s:.2f} s" if self.redone_s else "")
        return text


@dataclass(frozen=True)
class Attempt:
    """One start of every node. failures: cause first (a node's own failure before the consequences
    on its peers). Timings in seconds: teardown from the first failure to the last node's end,
    backoff the wait before the next attempt, preflight the planning and checks before this one
    started, recover_s the run's recovery figure: from the previous attempt's fault to this one's first step
    (restart.total_s; None: no first step seen)."""

    attempt: int
    hosts: list[str]
    status: RunStatus
    started_at: float
    ended_at: float
    nodes: list[RecordedNode]
    failures: list[Failure]
    kind: FailureKind | None  # infra if any node failed at the infra level (see recovery.attempt_kind)
    down: list[str]  # hosts found lost in this attempt
    preflight_s: float
    teardown_s: float | None = None
    backoff_s: float | None = None
    recover_s: float | None = None
    joined_ranks: list[int] | None = None  # ranks seen joining a process group; None: not watched
    nnodes: int | None = None  # fewer than the job's when it went on without lost hosts (restarts.min_nnodes)
    world_size: int | None = None  # None in records written before attempts recorded their size
    health: list[HealthEvent] = field(default_factory=list)  # the health watch's verdicts, in order
    ended_by: str | None = None  # what ended it from outside the job: Slurm's time limit, a requeue
    progress: Progress | None = None  # None: no progress line seen (or not watched)
    restart: Restart | None = None  # an attempt after a failed one: how it came to its first step
    kept_out: dict[str, str] = field(default_factory=dict)  # host -> why an earlier failure keeps it out (hosts_out)
    warm: list[str] = field(default_factory=list)  # hosts whose node was a standby (restarts.standby)
    unwatched: list[Unwatched] = field(default_factory=list)  # its times without a controller (`harness attach`)

    def where(self, resized: bool) -> str:
        """Its hosts, and with them its size when the run's attempts did not all have the same (resized)."""
        return ", ".join(self.hosts) + (f" ({self.nnodes} node(s), world size {self.world_size})" if resized else "")


@dataclass(frozen=True)
class RankRow:
    """One rank of the running attempt as health.json shows it: its node and host, its state as the health
    loop judges it (computing, waiting, no progress for N s, stopped, ended (how)), the CPUs it used and its
    main thread's busy share over the last sample interval, its last line and when it came, its step and
    steps per second where the job prints them, and its GPU use where the driver reports one: the percentage
    of the SMs' time it ran kernels and the bytes of GPU memory it holds (None: not known)."""

    node: str
    host: str
    state: str
    cpu: float | None = None
    busy: float | None = None
    last_line: str | None = None
    last_line_at: float | None = None
    step: int | None = None
    step_rate: float | None = None
    gpu_util: float | None = None
    gpu_memory: int | None = None
    idle: float | None = None  # seconds without progress (CPU time used), as the judge counts them
    step_at: float | None = None  # when its step's line came
    loss: float | None = None  # its last loss and items per second, where its lines say them (health.progress)
    throughput: float | None = None


@dataclass(frozen=True)
class Slowed:
    """The job's pace before the slowness of a rank named slow began (since) and since then, steps per second."""

    rank: int
    since: float
    pace_before: float | None
    pace_now: float | None


# Ranks past which health.json sums up each node and lists only the odd ranks (record/health_summary.py): every
# job the tests run (64 ranks at most) has every rank's row there, as before.
SUMMED_PAST = 256


@dataclass(frozen=True)
class NodeHealth:
    """One node in the health.json of a job past SUMMED_PAST ranks (record/health_summary.py), in a constant room
    however the job runs: its ranks (first_rank to last_rank: a node's ranks are consecutive), how many of them are
    in each state (by health_summary.state_kind: `no progress` without its seconds), its least and most step (None:
    none of its ranks printed one), and the CPUs its ranks used together (None: not known yet)."""

    node_rank: int
    host: str
    first_rank: int
    last_rank: int
    states: dict[str, int]
    least_step: int | None = None
    most_step: int | None = None
    cpu: float | None = None


@dataclass(frozen=True)
class LiveHealth:
    """health.json: the running attempt's health as the controller's health loop last judged it (t, by the
    controller's clock), for `harness status`, `harness top` and `harness report`: the ranks named slow (rank ->
    the percentage of the time its peers wait for it), a hang's verdict being acted on, and every rank; past
    SUMMED_PAST ranks, every node summed up (nodes) and only the odd ranks, every rank's row then in
    health-ranks.json, written less often (RunDir.read_rank_rows reads both)."""

    attempt: int
    t: float | None = None  # None in the files of a test or a tool that leaves it out
    slow: dict[int, float] = field(default_factory=dict)
    hang: str | None = None
    ranks: dict[int, RankRow] = field(default_factory=dict)
    started_at: float | None = None  # the attempt's start (None in files written before it was kept)
    progress: Progress | None = None
    slowed: Slowed | None = None  # what a rank named slow costs the job's pace now (None: none is)
    nodes: list[NodeHealth] = field(default_factory=list)  # every node summed up; empty: ranks holds every rank
    odd_left: int = 0  # odd ranks left out of ranks past health_summary.ODD_LISTED
    table_at: float | None = None  # when every rank's row was last written to health-ranks.json (None: not yet)

    @property
    def world_size(self) -> int:
        """The attempt's ranks, listed or summed up."""
        return sum(node.last_rank - node.first_rank + 1 for node in self.nodes) if self.nodes else len(self.ranks)


@dataclass(frozen=True)
class Goodput:
    """Where a run's wall time went (record/goodput.py says how each second is put in one bucket): seconds by
    bucket, in the order of GOODPUT_BUCKETS, adding up to wall_s; goodput: the share of wall_s that trained
    (training and unwatched)."""

    wall_s: float
    seconds: dict[str, float]
    goodput: float


GOODPUT_BUCKETS = ("start-up", "training", "unwatched", "checkpoint", "slowed", "redone", "hung", "restarting",
                   "ending")


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    name: str
    status: RunStatus
    exit_code: int
    started_at: float
    ended_at: float
    duration_s: float
    nodes: list[RecordedNode]  # of the last attempt
    first_failure: Failure | None  # the cause that ended the run (the last attempt's)
    attempts: list[Attempt]
    reason: str | None = None  # why the run ended without another attempt, when it failed
    error: str | None = None  # what went wrong, in one line, for a failed run (never None then)
    warnings: list[str] = field(default_factory=list)  # e.g. a success that never ran distributed
    goodput: Goodput | None = None  # None in records written before it was measured

    @property
    def world_sizes(self) -> list[int]:
        """Each world size the attempts ran on, in order: more than one when the run went on with fewer
        nodes (restarts.min_nnodes)."""
        return list(dict.fromkeys(a.world_size for a in self.attempts if a.world_size is not None))


class RecordError(UsageError):
    """A run record that cannot be read or does not have the expected shape."""


def write_record(path: Path, record: Any) -> None:
    """A record (or a list of them) as JSON, whole or not at all."""
    write_text_atomic(path, record_text(record))


def record_text(record: Any) -> str:
    """A record (or a list of them) as its file holds it."""
    data = [dataclasses.asdict(item) for item in record] if isinstance(record, list) else dataclasses.asdict(record)
    return json.dumps(data, indent=2, default=_enum_value) + "\n"


# The fields health.json has only past SUMMED_PAST ranks: a smaller job's file is as it was before them.
SUMMARY_FIELDS = ("nodes", "odd_left", "table_at")


def health_text(health: LiveHealth) -> str:
    """health.json's text (or health-ranks.json's): up to SUMMED_PAST ranks as every record is written; past them
    compact, and made by pydantic's serializer, several times faster than dataclasses.asdict: 2,048 nodes' summaries
    are written twice a second, 16,384 ranks' rows twice a minute."""
    if health.nodes or len(health.ranks) > SUMMED_PAST:
        return _live_health().dump_json(health).decode() + "\n"
    data = dataclasses.asdict(health)
    for name in SUMMARY_FIELDS:
        del data[name]
    return json.dumps(data, indent=2) + "\n"


@functools.cache
def _live_health() -> TypeAdapter[LiveHealth]:
    """Made once, when first needed: making it costs every command's start 70 ms."""
    return TypeAdapter(LiveHealth)


def _enum_value(value: object) -> object:
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"not JSON-serializable: {value!r}")


def read_record(path: Path, kind: type[T]) -> T:
    try:
        return TypeAdapter(kind).validate_json(path.read_bytes())
    except OSError as exc:
        raise RecordError(f"{path}: cannot read run record: {exc.strerror}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the file"
        raise RecordError(f"{path}: not a valid run record ({where}: {first['msg']}); "
                          f"it was damaged or written by another version") from None
