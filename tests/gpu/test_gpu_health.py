"""The health watch under NCCL on one GPU: a 1-rank job stuck in its data path after real NCCL
collectives on the GPU is found, its stack captured and its place named (2 ranks cannot share 1 GPU)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from conftest import assert_nothing_left, free_port

pytestmark = pytest.mark.usefixtures("cuda")

STALL = 10
SCRIPT = '''
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(0)


def load_batch(step):
    if step == 20:
        time.sleep(3600)
    return torch.randn(1024, 1024, device="cuda")


for step in range(1000):
    batch = load_batch(step)
    dist.all_reduce(batch)
    print(f"step {step} {batch.sum().item():.1f}", flush=True)
'''


def test_a_rank_stuck_in_its_data_path_under_nccl_is_found_with_its_stack(tmp_path: Path, launch) -> None:
    (tmp_path / "stuck_gpu.py").write_text(SCRIPT)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: stuck-gpu\nnnodes: 1\nnproc_per_node: 1\nbackend: nccl\nmaster_port: {free_port()}\n"
                   f"entrypoint: {{script: stuck_gpu.py}}\nhealth: {{stall: {STALL}}}\n")
    run = launch(job, cwd=tmp_path)
    run.wait_for(r"\[rank0\]: step 19 ", timeout=300)
    began = time.monotonic()
    verdict = run.wait_for(r"harness: hang: (.*)", timeout=STALL + 60).group(1)
    assert time.monotonic() - began < STALL + 15
    assert re.match(r"no progress for 10 s: rank 0 \(node0 on sim0\) at stuck_gpu.py:\d+ in load_batch: "
                    r"time.sleep\(3600\)", verdict), verdict
    assert run.finish(timeout=120) == 1
    kept = next((tmp_path / "runs").glob("*/stacks/attempt-0/rank0.txt")).read_text()
    assert "load_batch (stuck_gpu.py:" in kept and "time.sleep(3600)" in kept
    assert run.summary()["first_failure"]["kind"] == "hang"
    assert_nothing_left(run.run_id)
