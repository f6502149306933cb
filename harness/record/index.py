"""The user's index of runs: every run registers in it ($XDG_STATE_HOME/harness/runs), so that `status`,
`stop` and `stacks` find it from any directory (RunsLookup), whatever runs directory it was launched with;
and the one place a run named on the command line is found (by its id, a unique prefix of one, or `latest`),
only among the caller's own runs and only where its record is to be believed (record/trust.py)."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.record.atomic import make_folders
from harness.record.rundir import RUN_ID, RUN_ID_PREFIX, RunDir, check_run_id, make_run_folder, run_dir, runs_root
from harness.record.schema import RecordError, RunState
from harness.record.trust import check_run_folder, owned_by_caller, user_words

LATEST = "latest"  # names the newest run: `harness status latest`
LISTED = 10  # matching ids an ambiguous prefix's error names


@dataclass(frozen=True)
class RunEntry:
    """One run as `harness status` lists it: its state, or why that cannot be read."""

    run: RunDir
    state: RunState | None
    problem: str | None = None


def create_run_dir(root: Path, run_id: str) -> RunDir:
    """The run's directory, registered in the user's index of runs; a detached launch made it already
    (for the controller's log), never a run."""
    run = run_dir(root, run_id)
    with contextlib.suppress(FileExistsError):  # a detached launch made it (make_run_folder)
        make_run_folder(run.path)
    check_run_folder(run.path, run_id)  # one made before (a detached launch's): still the caller's alone
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
        make_folders(index, 0o700)
        if index.stat().st_mode & 0o077:  # which runs a user has, and where, are theirs (an older index was not)
            index.chmod(0o700)
        prune_index(index)
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


def prune_index(index: Path) -> None:
    """Remove the entries whose run directory is gone (deleted, or a detached launch's that never started)."""
    for entry in index.iterdir():
        if RUN_ID.fullmatch(entry.name) and not entry.exists():
            entry.unlink(missing_ok=True)


def _indexed(entry: Path) -> RunDir | None:
    """The run an index entry points at; None when the entry is gone (pruned meanwhile) or not a link."""
    try:
        return RunDir(entry.parent / entry.readlink())
    except OSError:
        return None


def _runs_under(root: Path) -> list[RunDir]:
    return [RunDir(path) for path in root.iterdir()] if root.is_dir() else []


def _callers(runs: Iterable[RunDir]) -> list[RunDir]:
    """The runs whose folder is the caller's: another user's is never listed, picked nor read."""
    return [run for run in runs if owned_by_caller(run.path)]


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
    """Every run of the caller's under root with a record, oldest start first."""
    return _read_entries(_callers(_runs_under(root)))


def find_run(runs_dir: str | None, run_id: str) -> RunDir:
    """The directory of the run a verb was given (RunsLookup.find): under --runs-dir or $HARNESS_RUNS_DIR
    when given, else under ./runs or through the index of the user's runs."""
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
        """The caller's runs of root and of the index, each once, oldest start first."""
        return _read_entries(_callers(self._found()))

    def others(self) -> list[RunDir]:
        """The runs found that are not the caller's (another user's folder in root): never read, only named."""
        return [run for run in self._found() if not owned_by_caller(run.path) and run.path.exists()]

    def _found(self) -> list[RunDir]:
        """root's runs and the index's, each once (by real path, as root shows it). Read only: an index entry whose
        run directory is gone is skipped, the next launch prunes it."""
        entries = sorted(self.index.iterdir()) if self.index is not None and self.index.is_dir() else []
        elsewhere = [run for entry in entries if (run := _indexed(entry))]
        return list({os.path.realpath(run.path): run for run in [*elsewhere, *_runs_under(self.root)]}.values())

    def elsewhere(self, run: RunDir) -> Path | None:
        """The directory run lives in when that is not root (a run found through the index)."""
        parent = run.path.parent
        return None if os.path.realpath(parent) == os.path.realpath(self.root) else parent

    def find(self, name: str) -> RunDir:
        """The run a verb was given, where its record is the caller's to believe (trust.check_run_folder, else
        UsageError saying why): its id (under root, else where the index points), else `latest` (the newest start
        among runs(), the caller's), else the one run of the caller's whose id starts with name; an exact id wins
        over the longer ids it starts. UsageError when none matches (saying where it looked, and naming the other
        users' runs that would have) or several do (naming them)."""
        if RUN_ID.fullmatch(name) and (run := self._exact(name)):
            return _believed(run)
        if not RUN_ID_PREFIX.fullmatch(name):
            check_run_id(name)  # not even the start of a run id: its error
        entries = self.runs()
        if name == LATEST and entries:
            return _believed(entries[-1].run)
        matches = {entry.run.run_id: entry.run for entry in entries if entry.run.run_id.startswith(name)}
        if len(matches) == 1:
            return _believed(next(iter(matches.values())))
        if matches:
            newest = list(reversed(matches))[:LISTED]
            more = f" and {len(matches) - LISTED} more" if len(matches) > LISTED else ""
            raise UsageError(f"{name} is the start of {len(matches)} run ids: {', '.join(newest)}{more}; type more "
                             f"of the one you mean")
        theirs = [run for run in self.others() if name == LATEST or run.run_id.startswith(name)]
        if theirs:
            named = ", ".join(f"{run.path} of {_owner(run)}" for run in theirs[:LISTED])
            raise UsageError(f"no run of yours {'is' if name == LATEST else 'matches ' + name} in {self.searched}; "
                             f"{'the one there is' if len(theirs) == 1 else 'those there are'} another user's "
                             f"({named}), and harness acts only on runs of your own")
        recent = ", ".join(entry.run.run_id for entry in entries[-5:]) or "none"
        raise UsageError(f"no run {name} in {self.searched}; recent runs: {recent}; {self.hint}")

    def _exact(self, run_id: str) -> RunDir | None:
        """run_id's directory with a record: under root, else where the index points."""
        run = run_dir(self.root, run_id)
        if not run.state_file.exists() and self.index is not None:
            run = _indexed(self.index / run_id) or run
        return run if run.state_file.exists() else None

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


def _believed(run: RunDir) -> RunDir:
    """run, once its record is the caller's to believe (else trust's UsageError, before anything reads it)."""
    check_run_folder(run.path, run.run_id)
    return run


def _owner(run: RunDir) -> str:
    """Who owns another user's run, for the line that says why it is not picked."""
    try:
        return user_words(run.path.stat().st_uid)
    except OSError:
        return "unknown"
