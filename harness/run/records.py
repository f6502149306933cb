"""runs/<run-id>/: what a run leaves behind and how other terminals find it.

RunDir owns every path of a run; RunState (written at the start, updated at the end) and
RunSummary (written at the end) are typed records, validated when read back, so one damaged file
is reported as that run's problem instead of breaking every command that lists runs. Every run
registers in the user's index of runs (index_dir), so `status`, `stop` and `stacks` find it from
any directory (RunsLookup).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from harness.errors import UsageError, short_repr

DEFAULT_RUNS_DIR = "runs"
_UMASK = os.umask(0o022)  # read once (os.umask can only be read by setting it), then put back
os.umask(_UMASK)
T = TypeVar("T")


class RunStatus(StrEnum):
    """A run's status. The controller writes the first six; `lost` and `unreadable` are only shown."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by `harness stop`
    INTERRUPTED = "interrupted"  # by Ctrl-C or a SIGTERM to the controller
    ERROR = "error"  # the controller itself failed
    LOST = "lost"  # recorded as running, but its controller is gone
    UNREADABLE = "unreadable"  # the record cannot be read


class FailureKind(StrEnum):
    """infra: the machines failed the program (a lost host or connection, a signal, a rendezvous that
    timed out); hang: the job made no progress for health.stall seconds and was stopped; program: the
    program itself failed. restarts.on lists the kinds that are retried (spec.job.FAILURE_KINDS)."""

    INFRA = "infra"
    HANG = "hang"
    PROGRAM = "program"


@dataclass(frozen=True)
class ControllerId:
    """The controller's pid with its kernel start time: still identifies it after pid reuse."""

    pid: int
    start_ticks: int | None


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


@dataclass(frozen=True)
class NodeResult:
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


@dataclass(frozen=True)
class Attempt:
    """One start of every node. failures: cause first (a node's own failure before the consequences
    on its peers). Timings in seconds: teardown from the first failure to the last node's end,
    backoff the wait before the next attempt, preflight the planning and checks before this one
    started, recover_s from the previous attempt's first failure to this one's nodes running."""

    attempt: int
    hosts: list[str]
    status: RunStatus
    started_at: float
    ended_at: float
    nodes: list[NodeResult]
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

    def where(self, resized: bool) -> str:
        """Its hosts, and with them its size when the run's attempts did not all have the same (resized)."""
        return ", ".join(self.hosts) + (f" ({self.nnodes} node(s), world size {self.world_size})" if resized else "")


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    name: str
    status: RunStatus
    exit_code: int
    started_at: float
    ended_at: float
    duration_s: float
    nodes: list[NodeResult]  # of the last attempt
    first_failure: Failure | None  # the cause that ended the run (the last attempt's)
    attempts: list[Attempt]
    reason: str | None = None  # why the run ended without another attempt, when it failed
    error: str | None = None  # what went wrong, in one line, for a failed run (never None then)
    warnings: list[str] = field(default_factory=list)  # e.g. a success that never ran distributed

    @property
    def world_sizes(self) -> list[int]:
        """Each world size the attempts ran on, in order: more than one when the run went on with fewer
        nodes (restarts.min_nnodes)."""
        return list(dict.fromkeys(a.world_size for a in self.attempts if a.world_size is not None))


class RecordError(UsageError):
    """A run record that cannot be read or does not have the expected shape."""


# What new_run_id makes (a job name, a time, a random suffix) and nothing that could leave the runs
# directory: no `/`, no `..`, no leading `-` or `.`.
RUN_ID = re.compile(r"[a-z0-9]([-a-z0-9]{0,126}[a-z0-9])?")


def check_run_id(run_id: str) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise UsageError(f"run id {short_repr(run_id)} is not a run id: expected lower-case letters, digits and "
                         f"'-' (as `harness status` lists them)")
    return run_id


def runs_root(explicit: str | None = None) -> Path:
    root = Path(explicit or os.environ.get("HARNESS_RUNS_DIR") or DEFAULT_RUNS_DIR)
    if root.exists() and not root.is_dir():
        raise UsageError(f"runs directory {root} is not a directory; give --runs-dir a directory")
    return root


def new_run_id(name: str) -> str:
    """Sortable by start time, unique across concurrent launches, still readable."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def write_text_atomic(path: Path, text: str) -> None:
    """Readers (another terminal, kubectl) never see a half-written file, and a failure loses nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's 0600 would keep others from reading manifests and records
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_record(path: Path, record: Any) -> None:
    write_text_atomic(path, json.dumps(dataclasses.asdict(record), indent=2, default=_enum_value) + "\n")


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


@dataclass(frozen=True)
class RunDir:
    """Every path of one run."""

    path: Path

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def stop_marker(self) -> Path:
        """Written by `harness stop` before it signals the controller: a stop, not an interrupt."""
        return self.path / "stop-requested"

    @property
    def controller_log(self) -> Path:
        """A detached controller's own output stream."""
        return self.path / "controller.log"

    @property
    def spec_copy(self) -> Path:
        return self.path / "spec.yaml"

    def plan_json(self, attempt: int = 0) -> Path:
        return self.path / f"plan{_attempt_suffix(attempt)}.json"

    def plan_text(self, attempt: int = 0) -> Path:
        return self.path / f"plan{_attempt_suffix(attempt)}.txt"

    @property
    def backend_logs(self) -> Path:
        """Logs a backend keeps of its own (torchrun's per-worker files on local nodes)."""
        return self.path / "torchrun"

    @property
    def stacks(self) -> Path:
        """Stacks read from the ranks: attempt-N/ for a hang, and what `harness stacks` asked for."""
        return self.path / "stacks"

    @property
    def health_file(self) -> Path:
        """The running attempt's health as the controller judges it (slow ranks, a hang's verdict)."""
        return self.path / "health.json"

    def log_file(self, node_rank: int, attempt: int = 0) -> Path:
        """Each attempt's own file (never overwritten): node1.log, then node1.attempt1.log, ..."""
        return self.path / f"node{node_rank}{_attempt_suffix(attempt)}.log"

    def read_state(self) -> RunState:
        return read_record(self.state_file, RunState)

    def read_summary(self) -> RunSummary | None:
        return read_record(self.summary_file, RunSummary) if self.summary_file.exists() else None

    def write_state(self, state: RunState) -> None:
        write_record(self.state_file, state)

    def write_summary(self, summary: RunSummary) -> None:
        write_record(self.summary_file, summary)


def _attempt_suffix(attempt: int) -> str:
    return f".attempt{attempt}" if attempt else ""


@dataclass(frozen=True)
class RunEntry:
    """One run as `harness status` lists it: its state, or why that cannot be read."""

    run: RunDir
    state: RunState | None
    problem: str | None = None


def run_dir(root: Path, run_id: str) -> RunDir:
    """The directory of run_id under root; the one way a run id from outside becomes a path."""
    return RunDir(root / check_run_id(run_id))


def create_run_dir(root: Path, run_id: str) -> RunDir:
    """The run's directory, registered in the user's index of runs; a detached launch made it already
    (for the controller's log), never a run."""
    run = run_dir(root, run_id)
    run.path.mkdir(parents=True, exist_ok=True)
    if run.state_file.exists():
        raise UsageError(f"run id {run_id} is already taken in {root}/")
    register_run(run, index_dir())
    return run


def index_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The user's index of runs: $XDG_STATE_HOME/harness/runs, else ~/.local/state/harness/runs (the XDG
    spec ignores an XDG_STATE_HOME that is not absolute). One entry per run id, a link to its directory,
    so that a run is found from any directory, whatever runs directory it was launched with."""
    state = environ.get("XDG_STATE_HOME", "")
    return (Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state") / "harness" / "runs"


def register_run(run: RunDir, index: Path) -> None:
    """index/<run id> -> the run's absolute path, made under a temporary name and renamed over, so a reader
    never sees half an entry; entries whose run directory is gone are pruned first. Never fails a launch: on
    a read-only home it warns and the run is found only through its runs directory."""
    temp = index / f".{run.run_id}.{secrets.token_hex(4)}"
    try:
        index.mkdir(parents=True, exist_ok=True)
        for entry in index.iterdir():
            if RUN_ID.fullmatch(entry.name) and not entry.exists():
                entry.unlink(missing_ok=True)
        temp.symlink_to(os.path.abspath(run.path))
        try:
            os.replace(temp, index / run.run_id)
        except OSError:
            temp.unlink()
            raise
    except OSError as exc:
        print(f"harness: warning: cannot register run {run.run_id} in the index of your runs {index} "
              f"({exc.strerror or exc}); from other directories, `harness status` finds it only with "
              f"--runs-dir {os.path.abspath(run.path.parent)}", file=sys.stderr)


def _indexed(entry: Path) -> RunDir | None:
    """The run an index entry points at; None when the entry is gone (pruned meanwhile) or not a link."""
    try:
        return RunDir(entry.parent / entry.readlink())
    except OSError:
        return None


def _runs_under(root: Path) -> list[RunDir]:
    return [RunDir(path) for path in root.iterdir()] if root.is_dir() else []


def _read_entries(runs: Iterable[RunDir]) -> list[RunEntry]:
    """Every run with a record, oldest start first; unreadable records sort by their file's time. A run
    without state.json (being created, or its directory gone) is left out."""
    entries = []
    for run in runs:
        if not run.state_file.exists():
            continue
        try:
            entries.append(RunEntry(run, run.read_state()))
        except RecordError as exc:
            entries.append(RunEntry(run, None, str(exc)))

    def started(entry: RunEntry) -> float:
        return entry.state.started_at if entry.state else entry.run.state_file.stat().st_mtime

    return sorted(entries, key=started)


def list_runs(root: Path) -> list[RunEntry]:
    """Every run under root with a record, oldest start first."""
    return _read_entries(_runs_under(root))


def find_run(runs_dir: str | None, run_id: str) -> RunDir:
    """The directory of run_id as `harness status` lists it: under --runs-dir or $HARNESS_RUNS_DIR when
    given, else under ./runs or through the index of the user's runs."""
    return runs_lookup(runs_dir).find(run_id)


def runs_lookup(explicit: str | None) -> RunsLookup:
    """Where `status`, `stop` and `stacks` look: --runs-dir or $HARNESS_RUNS_DIR alone when given (they
    win), else ./runs and the user's index of runs."""
    given = "--runs-dir" if explicit else "HARNESS_RUNS_DIR" if os.environ.get("HARNESS_RUNS_DIR") else None
    return RunsLookup(runs_root(explicit), None if given else index_dir(), given)


@dataclass(frozen=True)
class RunsLookup:
    """The runs directory and, unless one was given (given: by which option), the index of the user's runs."""

    root: Path
    index: Path | None
    given: str | None

    def runs(self) -> list[RunEntry]:
        """root's runs and the index's, each once (by real path, as root shows it), oldest start first. Read
        only: an index entry whose run directory is gone is skipped, the next launch prunes it."""
        entries = sorted(self.index.iterdir()) if self.index is not None and self.index.is_dir() else []
        elsewhere = [run for entry in entries if (run := _indexed(entry))]
        unique = {os.path.realpath(run.path): run for run in [*elsewhere, *_runs_under(self.root)]}
        return _read_entries(unique.values())

    def elsewhere(self, run: RunDir) -> Path | None:
        """The directory run lives in when that is not root (a run found through the index)."""
        parent = run.path.parent
        return None if os.path.realpath(parent) == os.path.realpath(self.root) else parent

    def find(self, run_id: str) -> RunDir:
        """run_id's directory: under root, else where the index points; UsageError saying where it looked."""
        run = run_dir(self.root, run_id)
        if not run.state_file.exists() and self.index is not None:
            run = _indexed(self.index / run_id) or run
        if not run.state_file.exists():
            recent = ", ".join(entry.run.run_id for entry in self.runs()[-5:]) or "none"
            raise UsageError(f"no run {run_id} in {self.searched}; recent runs: {recent}; {self.hint}")
        return run

    @property
    def searched(self) -> str:
        """Where runs were looked for, for messages."""
        if self.index is None:
            return f"{self.root}/ (named by {self.given})"
        return f"{self.root}/ nor in the index of your runs ({self.index})"

    @property
    def hint(self) -> str:
        """How to look elsewhere."""
        if self.given == "--runs-dir":
            return "leave out --runs-dir to look in ./runs and the index of your runs, or pass another directory"
        if self.given == "HARNESS_RUNS_DIR":
            return "unset HARNESS_RUNS_DIR to look in ./runs and the index of your runs, or set it to another directory"
        return "pass --runs-dir DIR or set HARNESS_RUNS_DIR to look in another directory"
