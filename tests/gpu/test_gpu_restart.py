"""A restart on a GPU starts warm: the standby's warm worker (torch and torch._dynamo imported, waiting;
harness.node.standby) becomes the CUDA rank, joins NCCL and trains on, found by the agent as a rank."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from bench.recovery import standbys_idle

from conftest import assert_nothing_left, worker_pid

pytestmark = pytest.mark.usefixtures("cuda")

ONE_GPU = os.environ | {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
JOB = """\
name: warm-gpu
nnodes: 1
nproc_per_node: 1
backend: nccl
entrypoint:
  module: harness.payload.train
  args: [--data, synthetic, --subset, "65536", --model, small, --epochs, "4", --batch-size, "64", --log-every, "1",
         --ckpt-dir, {ckpt}, --ckpt-every, "10", --resume, --device, cuda]
restarts: {{max: 1, on: infra, backoff: 0, standby: 0}}
"""


def test_a_killed_cuda_rank_restarts_warm_on_the_gpu(tmp_path: Path, launch) -> None:
    job = tmp_path / "warm.yaml"
    job.write_text(JOB.format(ckpt=tmp_path / "ckpt"))
    run = launch(job, env=ONE_GPU, cwd=tmp_path)
    run.wait_for(r"\[rank0\]: epoch 1/4 step 30/", timeout=600)
    standbys_idle(run.run_id)
    os.kill(worker_pid(run.run_id, 0), signal.SIGKILL)
    assert run.finish(timeout=600) == 0, run.output[-5000:]
    assert "harness: sim0 started warm" in run.output and "not warm" not in run.output, run.output[-5000:]
    assert run.output.count("device=cuda backend=nccl") == 2, run.output[-5000:]
    first, second = run.summary()["attempts"]
    assert (first["status"], second["status"], second["warm"]) == ("failed", "succeeded", ["sim0"])
    timeline = [json.loads(line) for line in (run.runs_dir / run.run_id / "timeline.jsonl").read_text().splitlines()]
    assert any(t["attempt"] == 1 and "0" in t["ranks"] for t in timeline), "the warm rank is watched"
    assert_nothing_left(run.run_id)
