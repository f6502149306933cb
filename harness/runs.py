"""runs/<run-id>/: what a run leaves behind (spec, plan, logs, summary) and how other terminals find it."""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import UsageError

DEFAULT_RUNS_DIR = "runs"
CONTROLLER_LOG = "controller.log"  # a detached controller's own output stream


def runs_root(explicit: str | None = None) -> Path:
    return Path(explicit or os.environ.get("HARNESS_RUNS_DIR") or DEFAULT_RUNS_DIR)


def new_run_id(name: str) -> str:
    """Sortable by start time, unique across concurrent launches, still readable."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def write_text_atomic(path: Path, text: str) -> None:
    """Readers (another terminal, kubectl) never see a half-written file, and a failure loses nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


@dataclass(frozen=True)
class RunDir:
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

    def log_file(self, node_rank: int) -> Path:
        return self.path / f"node{node_rank}.log"

    def read_state(self) -> dict[str, Any]:
        return _read_json(self.state_file)

    def read_summary(self) -> dict[str, Any] | None:
        return _read_json(self.summary_file) if self.summary_file.exists() else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: cannot read run record: {exc}") from None


def create_run_dir(root: Path, run_id: str) -> RunDir:
    """The run's directory; a detached launch made it already (for the controller's log), never a run."""
    run = RunDir(root / run_id)
    run.path.mkdir(parents=True, exist_ok=True)
    if run.state_file.exists():
        raise UsageError(f"run id {run_id!r} is already taken in {root}/")
    return run


def find_run(root: Path, run_id: str) -> RunDir:
    run = RunDir(root / run_id)
    if not run.state_file.exists():
        known = ", ".join(r.run_id for r in list_runs(root)[-5:]) or "none"
        raise UsageError(f"no run {run_id!r} in {root}/ (recent runs: {known}); see `harness status`")
    return run


def list_runs(root: Path) -> list[RunDir]:
    """Every run with a record, oldest start first."""
    if not root.is_dir():
        return []
    runs = [RunDir(p) for p in root.iterdir() if (p / "state.json").exists()]
    return sorted(runs, key=lambda r: float(r.read_state()["started_at"]))
