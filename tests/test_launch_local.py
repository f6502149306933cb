"""Local multi-node launch, for real: torchrun agents over gloo on 127.0.0.1, supervised."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, harness, leftover

JOB = """
name: ddp-sum
nnodes: 2
nproc_per_node: {nproc}
backend: gloo
master_port: {port}
entrypoint:
  script: {script}
  args: [--tag, "two words", "$$", "${{local_rank}}", "$(x)"]
env:
{env}
"""
SCRIPT = REPO / "tests" / "scripts" / "ddp_sum.py"


def job(write_yaml, nproc: int = 1, **env: str) -> Path:
    lines = "\n".join(f"  {k}: '{v}'" for k, v in env.items()) or "  {}"
    text = JOB.format(nproc=nproc, port=free_port(), script=SCRIPT, env=lines)
    return write_yaml(text.replace("env:\n  {}", "env: {}"))


class Launch:
    """`harness launch` as a user starts it, with its output collected as it arrives."""

    def __init__(self, job_path: Path, runs_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "harness.cli", "launch", str(job_path), "--runs-dir", str(runs_dir)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.runs_dir = runs_dir
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if match := re.search(pattern, self.output):
                return match
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not seen; output:\n{self.output}")

    @property
    def run_id(self) -> str:
        return self.wait_for(r"harness: run (\S+): ").group(1)

    def finish(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def summary(self) -> dict:
        return json.loads((self.runs_dir / self.run_id / "summary.json").read_text())

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in leftover(self.run_id) if self.lines else []:
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path):
    started: list[Launch] = []

    def start(job_path: Path) -> Launch:
        started.append(Launch(job_path, tmp_path / "runs"))
        return started[-1]

    yield start
    for run in started:
        run.cleanup()


def assert_nothing_left(run_id: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while leftover(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftover(run_id) == [], f"processes of {run_id} still running"


def test_two_nodes_train_over_gloo(write_yaml, launch):
    run = launch(job(write_yaml, nproc=2, STEPS="12"))
    assert run.finish() == 0, run.output
    weights = set(re.findall(r"\[node(\d)\] \[rank(\d)\]: rank \2 final loss \S+ weights (\[.*\])", run.output))
    assert {(n, r) for n, r, _ in weights} == {("0", "0"), ("0", "1"), ("1", "2"), ("1", "3")}, run.output
    assert len({w for _, _, w in weights}) == 1, "DDP replicas diverged"
    assert "args=['--tag', 'two words', '$$', '${local_rank}', '$(x)']" in run.output
    run_dir = run.runs_dir / run.run_id
    assert {p.name for p in run_dir.iterdir()} >= {"spec.yaml", "plan.json", "node0.log", "node1.log", "summary.json"}
    assert "[rank3]: rank 3 final loss" in (run_dir / "node1.log").read_text()
    summary = run.summary()
    assert (summary["status"], summary["exit_code"], summary["first_failure"]) == ("succeeded", 0, None)
    assert [n["exit_code"] for n in summary["nodes"]] == [0, 0]
    assert_nothing_left(run.run_id)


def test_failure_stops_every_node_within_5_seconds(write_yaml, launch):
    """Rank 1 exits 1 while rank 0 is blocked for an hour: the harness must end rank 0, fast."""
    run = launch(job(write_yaml, FAIL_RANK="1", FAIL_AT_STEP="3", HANG_AT_STEP="3", STEPS="1000"))
    assert run.finish() == 1, run.output
    summary = run.summary()
    failure = summary["first_failure"]
    assert (summary["status"], failure["node_rank"], failure["rank"], failure["exit_code"]) == ("failed", 1, 1, 1)
    assert any("failing on purpose" in line for line in failure["last_lines"])
    first_end = summary["started_at"] + failure["after_s"]
    last_end = max(summary["started_at"] + n["duration_s"] for n in summary["nodes"])
    assert last_end - first_end < 5.0, summary
    assert "FAILED: first failure on node 1 (localhost, global rank 1): exit code 1" in run.output
    assert_nothing_left(run.run_id, within=1.0)


def test_ctrl_c_stops_every_node_and_exits_130(write_yaml, launch):
    run = launch(job(write_yaml, STEPS="100000", STEP_SECONDS="0.05"))
    run.wait_for(r"\[rank0\]: step 5 ")
    run_id = run.run_id
    assert len(leftover(run_id)) >= 4  # two agents, two workers
    run.proc.send_signal(signal.SIGINT)
    assert run.finish(timeout=15) == 130, run.output
    assert run.summary()["status"] == "interrupted"
    assert_nothing_left(run_id, within=1.0)


def test_stop_and_status_from_another_terminal(write_yaml, launch):
    run = launch(job(write_yaml, STEPS="100000", STEP_SECONDS="0.05"))
    run.wait_for(r"\[rank1\]: ")
    runs = ["--runs-dir", str(run.runs_dir)]
    listing = harness("status", *runs)
    assert re.search(rf"{run.run_id}\s+running\s+2", listing.stdout), listing.stdout
    stopped = harness("stop", run.run_id, *runs)
    assert stopped.returncode == 0, stopped.stderr
    assert run.finish(timeout=15) == 130
    assert_nothing_left(run.run_id, within=1.0)
    detail = harness("status", run.run_id, *runs)
    assert f"run {run.run_id}: stopped" in detail.stdout
    assert harness("stop", run.run_id, *runs).stdout.strip() == f"run {run.run_id} already ended: stopped"
    assert harness("stop", "no-such-run", *runs).returncode == 2


def test_killed_controller_takes_its_nodes_along(write_yaml, launch):
    run = launch(job(write_yaml, STEPS="100000", STEP_SECONDS="0.05"))
    run.wait_for(r"\[rank0\]: step 5 ")
    os.kill(run.proc.pid, signal.SIGKILL)
    run.finish()
    assert_nothing_left(run.run_id, within=10.0)
    assert harness("status", run.run_id, "--runs-dir", str(run.runs_dir)).stdout.startswith(f"run {run.run_id}: lost")


def test_missing_script_is_a_usage_error(write_yaml, tmp_path):
    path = write_yaml("name: x\nnnodes: 1\nentrypoint: {script: nope.py}\n")
    result = harness("launch", str(path), "--runs-dir", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert "entrypoint.script 'nope.py' not found" in result.stderr
    assert not (tmp_path / "runs").exists()
