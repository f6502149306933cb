"""runs/<run-id>/: where every file of a run lives (RunDir), and what a run id may be."""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import UsageError, short_repr
from harness.record.atomic import file_mode, folder_mode, make_folders, write_bytes_atomic, write_text_atomic
from harness.record.disk import RecordDisk
from harness.record.schema import (
    Attempt,
    LiveHealth,
    RankRow,
    RecordError,
    RunState,
    RunSummary,
    health_text,
    read_record,
    record_text,
)
from harness.record.stream import mark_file, node_file, resume_point
from harness.record.timeline import Sample, append_sample, sample_line
from harness.record.trust import check_runs_dir, shared_with

DEFAULT_RUNS_DIR = "runs"
# What new_run_id makes (a job name, a time, a random suffix) and nothing that could leave the runs
# directory: no `/`, no `..`, no leading `-` or `.`.
RUN_ID = re.compile(r"[a-z0-9]([-a-z0-9]{0,126}[a-z0-9])?")
# The start of one, as a user types it to name a run (`harness status smoke-2026`).
RUN_ID_PREFIX = re.compile(r"[a-z0-9][-a-z0-9]{0,127}")


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


# A `harness stacks` request's tag, as new_stacks_tag makes it: the controller answers no other request (a file
# name is the user's to choose, and a tag becomes an argument of the agents' STACKS word).
STACKS_TAG = re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}")


def new_stacks_tag() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def new_run_id(name: str) -> str:
    """Sortable by start time, unique across concurrent launches, still readable."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class RunDir:
    """Every path of one run. disk: where the controller writes the run, the disk that takes a write's failure
    (record/disk.py: said, the record marked incomplete, the run goes on); None: a failure is raised."""

    path: Path
    disk: RecordDisk | None = field(default=None, compare=False, repr=False)

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

    @property
    def job_file(self) -> Path:
        """The job as a Slurm batch step's controller runs it: the spec with every flag applied (JSON)."""
        return self.path / "job.json"

    @property
    def attempts_file(self) -> Path:
        """The attempts so far, written after each: a controller in a batch job that Slurm requeues
        continues from them; status and the metrics count a running run's time by them."""
        return self.path / "attempts.json"

    @property
    def time_limit_marker(self) -> Path:
        """Written by the batch script when Slurm warns of the time limit: the attempt ends for a requeue."""
        return self.path / "time-limit"

    def plan_json(self, attempt: int = 0) -> Path:
        return self.path / f"plan{_attempt_suffix(attempt)}.json"

    def plan_text(self, attempt: int = 0) -> Path:
        return self.path / f"plan{_attempt_suffix(attempt)}.txt"

    @property
    def stacks(self) -> Path:
        """Stacks read from the ranks: attempt-N/ for a hang, and what `harness stacks` asked for."""
        return self.path / "stacks"

    def hang_stacks(self, attempt: int) -> Path:
        """Where the stacks of the attempt's hang are kept (run/stack_capture.keep: rankN.txt, stacks.json)."""
        return self.stacks / f"attempt-{attempt}"

    def results(self, attempt: int) -> Path:
        """What each rank of the attempt of a function launch returned or raised (harness.api.rank), pickled, a file
        by rank: the owner's alone (0600 in 0700 folders, even where the runs directory is shared with a group),
        unpickled by harness.Run.result() alone. The function itself is never kept (docs/security.md)."""
        return self.path / "results" / f"attempt-{attempt}"

    def write_result(self, attempt: int, rank: int, result: bytes) -> None:
        make_folders(self.results(attempt), 0o700)
        write_bytes_atomic(self.results(attempt) / str(rank), result, 0o600)

    @property
    def health_file(self) -> Path:
        """The running attempt's health as the controller judges it (slow ranks, a hang's verdict)."""
        return self.path / "health.json"

    @property
    def health_table(self) -> Path:
        """Every rank's row of a job whose health.json sums up its nodes (schema.SUMMED_PAST), written less often."""
        return self.path / "health-ranks.json"

    @property
    def timeline(self) -> Path:
        """timeline.jsonl: every rank's CPU use, busy share and step over time (record/timeline.py), for the report."""
        return self.path / "timeline.jsonl"

    @property
    def html_report(self) -> Path:
        """report.html: `harness report`'s page of the run, where it writes it unless told otherwise."""
        return self.path / "report.html"

    @property
    def stream(self) -> Path:
        """The run's stream as it was shown, and every line the ranks printed, each with its time
        (record/stream.py): what `harness logs` reads."""
        return self.path / "logs"

    def log_file(self, node_rank: int, attempt: int = 0) -> Path:
        """Each attempt's own file (never overwritten): node1.log, then node1.attempt1.log, ..."""
        return self.path / f"node{node_rank}{_attempt_suffix(attempt)}.log"

    def resume_points(self, attempt: int, node_ranks: list[int]) -> dict[int, int]:
        """By node rank, where in its agent's stream the attempt's logs of the node end, those logs cut back to it
        (record/stream.py's LoggedMark); a node with no mark is left out."""
        points = {rank: resume_point(mark_file(self.stream, attempt, rank),
                                     [self.log_file(rank, attempt), node_file(self.stream, attempt, rank)])
                  for rank in node_ranks}
        return {rank: point for rank, point in points.items() if point is not None}

    def last_written(self) -> float | None:
        """When any file of the run was last written (its record, its stream, its nodes' logs): a run whose
        controller was lost ended then, as far as anyone can tell. None: no file."""
        times = []
        for path in self.path.rglob("*"):
            try:
                times.append(path.stat().st_mtime)
            except OSError:  # removed meanwhile
                continue
        return max(times, default=None)

    def read_state(self) -> RunState:
        return read_record(self.state_file, RunState)

    def read_summary(self) -> RunSummary | None:
        return read_record(self.summary_file, RunSummary) if self.summary_file.exists() else None

    def write_state(self, state: RunState) -> None:
        self.write_text(self.state_file, record_text(state), "the run's state")

    def write_summary(self, summary: RunSummary) -> None:
        self.write_text(self.summary_file, record_text(summary), "the run's summary")

    def read_health(self, attempt: int) -> LiveHealth | None:
        """health.json of the given attempt, as the controller's health loop last wrote it (None: none yet, or
        another attempt's, or one that cannot be read)."""
        try:
            health = read_record(self.health_file, LiveHealth)
        except RecordError:
            return None
        return health if health.attempt == attempt else None

    def write_health(self, health: LiveHealth) -> None:
        self.write_text(self.health_file, health_text(health), "health.json")

    def write_health_table(self, health: LiveHealth) -> None:
        self.write_text(self.health_table, health_text(health), "health-ranks.json")

    def read_rank_rows(self, health: LiveHealth) -> dict[int, RankRow]:
        """Every rank's row of health's attempt as last known: health.json's where it lists every rank; else
        health-ranks.json's (written less often) with health.json's odd ranks over them, newer."""
        if not health.nodes:
            return dict(health.ranks)
        try:
            table = read_record(self.health_table, LiveHealth)
        except RecordError:  # none yet
            return dict(health.ranks)
        return {**table.ranks, **health.ranks} if table.attempt == health.attempt else dict(health.ranks)

    def append_timeline(self, sample: Sample) -> None:
        if self.disk is None:
            append_sample(self.timeline, sample)
            return
        timeline = self.disk.appended(self.timeline, "timeline.jsonl")
        timeline.write(sample_line(sample))
        timeline.close()

    def read_attempts(self) -> list[Attempt]:
        return read_record(self.attempts_file, list[Attempt]) if self.attempts_file.exists() else []

    def write_attempts(self, attempts: list[Attempt]) -> None:
        self.write_text(self.attempts_file, record_text(attempts), "the run's attempts")

    def write_text(self, path: Path, text: str, what: str) -> None:
        """A file of the run, whole or not at all, as private as the run's folder (file_mode); through its disk
        where there is one."""
        if self.disk is None:
            make_folders(path.parent, folder_mode(self.path))
            write_text_atomic(path, text, file_mode(self.path))
        else:
            self.disk.write(path, text, what)


def make_run_folder(path: Path) -> None:
    """A run's folder, its owner's alone (0700: its spec, env, logs and stacks are nobody else's) whatever the umask,
    in a runs directory no one else can change (trust.check_runs_dir; one the harness makes is 0700 too). Where the
    runs directory is shared with a group on purpose (HARNESS_RUNS_GROUP names its group), the group may read it
    (0750), never write it. FileExistsError where it exists."""
    make_folders(path.parent, 0o700)
    check_runs_dir(path.parent)
    shared = shared_with(path.parent.stat())
    path.mkdir(mode=0o700)
    if shared is not None:
        os.chown(path, -1, shared)
    os.chmod(path, 0o700 if shared is None else 0o750)  # mkdir's mode is the umask's to cut


def _attempt_suffix(attempt: int) -> str:
    return f".attempt{attempt}" if attempt else ""


def run_dir(root: Path, run_id: str) -> RunDir:
    """The directory of run_id under root; the one way a run id from outside becomes a path."""
    return RunDir(root / check_run_id(run_id))
