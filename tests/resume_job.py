"""The resumable payload job that restart tests on every backend share, and its uninterrupted result:
a run that was killed, restarted or requeued must end with exactly these weights."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, free_port, harness

# The payload on 1024 synthetic images, 2 nodes x 16: 32 steps per epoch, 64 in all; a checkpoint
# every 4 steps (by default) on a directory every node sees. One thread per process: the same arithmetic on every
# backend, so that runs compare bitwise.
PAYLOAD_JOB = """
name: resume
nnodes: 2
backend: gloo
master_port: {port}
entrypoint:
  module: harness.payload.train
  args: [--data, synthetic, --model, small, --subset, "{subset}", --batch-size, "16", --epochs, "2", --log-every, "1",
         --ckpt-every, "{every}", --ckpt-dir, {root}/ckpt, --resume, --save-final, {root}/final.pt]
env: {{OMP_NUM_THREADS: "1"}}
restarts: {{max: 2, on: infra, backoff: 1{standby}}}
slurm: {{python: {python}, workdir: {repo}}}
"""
KILL_AT = r"\[rank0\]: epoch 1/2 step 11/32 "


def payload_job(root: Path, subset: int = 1024, ckpt_every: int = 4, standby: float | None = None) -> Path:
    """The job writing into root; a larger subset makes it longer (subset / 32 steps per epoch); ckpt_every 0:
    regular checkpoints at epoch ends only (a failure mid-epoch then resumes from the just-in-time one). The
    weights at the end do not depend on it. standby: restarts.standby (default: the spec's, which a run this
    short never reaches)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / "job.yaml"
    path.write_text(PAYLOAD_JOB.format(port=free_port(), root=root, python=sys.executable, repo=REPO, subset=subset,
                                       every=ckpt_every, standby="" if standby is None else f", standby: {standby:g}"))
    return path


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "final.pt", map_location="cpu", weights_only=True)


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not different, f"not bitwise equal: {different}"


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The final weights of the payload job run once without a failure, once per session: under pytest-xdist
    the workers that need it share one run (the first to take the lock makes it, in the session's directory
    above the workers' own; tests/conftest.py's groups put its users on two workers)."""
    session = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session = session.parent
    root = session / "uninterrupted"
    with (session / "uninterrupted.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, by any end of this worker
        if not (root / "final.pt").exists():
            result = harness("launch", str(payload_job(root)), "--runs-dir", str(root / "runs"), timeout=300)
            assert result.returncode == 0, result.stdout + result.stderr
            assert "resume: no checkpoint in" in result.stdout
    return final_weights(root)
