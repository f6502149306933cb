"""A run as Python sees it: the record the controller writes (harness.record), read by the same functions as the verbs
that take a run id (harness.view), so that `Run.status()` and `harness status` give one answer."""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import HarnessError, UsageError
from harness.record.goodput import goodput_of
from harness.record.index import find_run, runs_lookup
from harness.record.liveness import has_ended, live_status
from harness.record.rundir import RunDir
from harness.record.schema import Attempt, Failure, Goodput, Progress, RankRow, RunStatus
from harness.record.trust import check_run_folder


class RunFailed(HarnessError):
    """The run ended without success (failed, stopped, or its controller failed); run: the run, to look into."""

    def __init__(self, run: Run, message: str) -> None:
        super().__init__(message)
        self.run = run


class RankError(RunFailed):
    """A rank of a function launch raised: its rank, the exception's type name, and the rank's own traceback (text:
    the exception came from another process, maybe another machine). exception: the exception itself where it could
    be pickled there and unpickled here, else None."""

    def __init__(self, run: Run, rank: int, type_name: str, traceback: str, exception: BaseException | None) -> None:
        super().__init__(run, f"rank {rank} raised {type_name}; its traceback:\n{traceback.rstrip()}")
        self.rank = rank
        self.type_name = type_name
        self.traceback = traceback
        self.exception = exception


@dataclass(frozen=True)
class Status:
    """A run now, as `harness status RUN` shows it: state (running, succeeded, failed, stopped, interrupted, error,
    lost, unwatched); the current attempt (0 the first) and the attempts that ended; progress (steps, total, rate:
    Progress.left_s() is the ETA); goodput, where its time went so far; while it runs, each rank's row (state, CPU,
    step, last line) by global rank (past 256 ranks, as of health-ranks.json, every 30 s, but for the odd ranks':
    RunDir.read_rank_rows); once ended, its exit code, first failure and error in one line."""

    run_id: str
    name: str
    state: RunStatus
    mode: str
    nnodes: int
    world_size: int
    started_at: float
    ended_at: float | None
    attempt: int
    attempts: list[Attempt]
    progress: Progress | None
    goodput: Goodput
    ranks: dict[int, RankRow] = field(default_factory=dict)
    exit_code: int | None = None
    first_failure: Failure | None = None
    error: str | None = None
    metrics_url: str | None = None

    @property
    def eta_s(self) -> float | None:
        """Seconds left, where the job's lines say its total steps and the run is moving."""
        return self.progress.left_s() if self.progress is not None and self.state is RunStatus.RUNNING else None

    @property
    def ended(self) -> bool:
        return self.state not in (RunStatus.RUNNING, RunStatus.UNWATCHED)


class Run:
    """One run of the harness, launched from here or found by its id (harness.run): every verb that takes a run id."""

    def __init__(self, directory: RunDir, runs_dir: str | None = None) -> None:
        self._dir = directory
        self._runs_dir = runs_dir

    def __repr__(self) -> str:
        return f"Run({self.id!r})"

    @property
    def id(self) -> str:
        return self._dir.run_id

    @property
    def path(self) -> Path:
        """The run's directory: its record."""
        return self._dir.path

    @property
    def metrics_url(self) -> str | None:
        """Where its controller serves its metrics while it runs (health.metrics_port), else None."""
        return self._dir.read_state().metrics

    def status(self) -> Status:
        state = self._dir.read_state()
        summary = self._dir.read_summary()
        status = live_status(state, self._dir)
        health = self._dir.read_health(state.attempt) if summary is None else None
        if summary is not None:
            attempts = summary.attempts
            progress = next((a.progress for a in reversed(attempts) if a.progress is not None), None)
        else:
            attempts = self._dir.read_attempts()
            progress = health.progress if health is not None else None
        return Status(run_id=state.run_id, name=state.name, state=status, mode=state.mode, nnodes=state.nnodes,
                      world_size=state.world_size, started_at=state.started_at, ended_at=state.ended_at,
                      attempt=state.attempt, attempts=attempts, progress=progress,
                      goodput=goodput_of(self._dir, state, summary, time.time(), health),
                      ranks=self._dir.read_rank_rows(health) if health and status is RunStatus.RUNNING else {},
                      exit_code=summary.exit_code if summary is not None else None,
                      first_failure=summary.first_failure if summary is not None else None,
                      error=summary.error if summary is not None else state.error, metrics_url=state.metrics)

    def wait(self, timeout: float | None = None) -> Status:
        """The status once the run has ended (whatever its end: see Status.state); TimeoutError after timeout s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not has_ended(self._dir):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.id} still runs after {timeout:g} s")
            time.sleep(0.2)
        return self.status()

    def logs(self, rank: int | list[int] | None = None, since: float | None = None, follow: bool = False, *,
             node: int | None = None, attempt: int | None = None, grep: str | None = None,
             timestamps: bool = False) -> Iterator[str]:
        """Its lines in time order as `harness logs` prints them (without the newline): rank (one or several) or
        node alone, since: the last seconds only, grep: a regular expression; follow: on as they come, to its end."""
        from harness.view.logs import Selection, log_lines, since_stamp

        ranks = None if rank is None else frozenset([rank] if isinstance(rank, int) else rank)
        selection = Selection(ranks, node, attempt, None if grep is None else re.compile(grep),
                              None if since is None else since_stamp(since), timestamps)
        return (line.removesuffix("\n") for line in log_lines(self._dir, selection, follow))

    def stop(self, timeout: float = 15.0) -> Status:
        """Stop it (as `harness stop`, from any process) and return its status once it has ended."""
        from harness.commands import scheduler_for
        from harness.view.stop import stop_run

        if stop_run(self._dir, timeout, scheduler_for) != 0:
            raise HarnessError(f"run {self.id} did not stop within {timeout:g} s")
        return self.status()

    def attach(self) -> Status:
        """Be its controller again, here (as `harness attach`): for a run whose controller is gone while its nodes
        run on (state unwatched); returns once it has ended."""
        from harness.commands import attach

        here = os.getcwd()
        try:  # the verb goes where the run was launched from, for the job's relative paths
            attach(argparse.Namespace(runs_dir=str(self._dir.path.parent), run_id=self.id))
        finally:
            os.chdir(here)
        return self.status()

    def report(self, path: str | Path | None = None) -> Path:
        """Its HTML page (`harness report`), written to path (default: report.html in its directory)."""
        from harness.commands import write_file
        from harness.view.report import html_report

        out = self._dir.html_report if path is None else Path(path)
        write_file(out, html_report(self._dir))
        return out

    def result(self, rank: int | None = 0) -> Any:
        """What the function of a function launch returned: rank's (default rank 0), or with rank=None every rank's, a
        list by rank. Waits for the run's end. RankError where a rank raised (the first to fail, as the run names
        it), RunFailed where the run failed otherwise."""
        import pickle

        status = self.wait()
        folder = self._dir.results(status.attempt)
        if not self._is_a_call():
            raise UsageError(f"run {self.id} ran a script or a module, not a function (harness.launch(fn, ...)): it "
                             "has no result")
        check_run_folder(self._dir.path, self.id)  # unpickling runs code: only from a folder no one else could write
        results = {int(p.name): pickle.loads(p.read_bytes()) for p in folder.glob("*") if p.name.isdigit()} \
            if folder.is_dir() else {}
        raised = {r: kept for r, kept in results.items() if kept[0] == "raised"}
        if raised:
            first = status.first_failure.rank if status.first_failure is not None else None
            failed = first if first in raised else min(raised)
            _, type_name, _, traceback, exception = raised[failed]
            raise RankError(self, failed, type_name, traceback, _unpickled(exception))
        for which, kept in sorted(results.items()):
            if kept[0] == "unpicklable":
                raise HarnessError(f"rank {which}'s return value did not come back: {kept[1]}")
        if status.state is not RunStatus.SUCCEEDED:
            raise RunFailed(self, f"run {self.id} {status.state.value}" + (f": {status.error}" if status.error else ""))
        wanted = range(status.world_size) if rank is None else [rank]
        if missing := [r for r in wanted if r not in results]:
            raise HarnessError(f"run {self.id}: no result came back from rank(s) {missing}")
        values = [results[r][1] for r in wanted]
        return values if rank is None else values[0]


    def _is_a_call(self) -> bool:
        """Whether the run's ranks ran a function (harness.api.rank), by its spec."""
        import yaml

        from harness.api.function import CALL_MODULE

        try:
            spec = yaml.safe_load(self._dir.spec_copy.read_text())
            return bool(spec["entrypoint"].get("module") == CALL_MODULE)
        except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
            return False


def _unpickled(data: bytes | None) -> BaseException | None:
    import pickle

    if data is None:
        return None
    try:
        exception = pickle.loads(data)
    except Exception:  # noqa: BLE001 - a class that is not importable here: the text is still said
        return None
    return exception if isinstance(exception, BaseException) else None


def runs(runs_dir: str | None = None) -> list[Run]:
    """Your runs, oldest first, as `harness status` lists them (runs_dir: as --runs-dir)."""
    return [Run(entry.run, runs_dir) for entry in runs_lookup(runs_dir).runs()]


def run(run_id: str, runs_dir: str | None = None) -> Run:
    """One run by its id, a unique prefix of one, or `latest`, from any directory (as the verbs find it)."""
    return Run(find_run(runs_dir, run_id), runs_dir)
