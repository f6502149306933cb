"""The health watch under NCCL on one GPU: a 1-rank job stuck in its data path after real NCCL
collectives on the GPU is found, its stack captured and its place named; one whose collective never
completes on the GPU while its CPU spins in a CUDA synchronization is found by its collectives (2 ranks
cannot share 1 GPU)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

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


def hang_of_one_gpu_rank(tmp_path: Path, launch, name: str, script: str) -> tuple[Any, str]:
    """The 1-rank NCCL job of script (saved as NAME.py), launched, at step 19, and its hang's verdict,
    which must come within stall + 15 s of that step."""
    (tmp_path / f"{name}.py").write_text(script)
    job = tmp_path / "job.yaml"
    job.write_text(f"name: {name.replace('_', '-')}\nnnodes: 1\nnproc_per_node: 1\nbackend: nccl\n"
                   f"master_port: {free_port()}\nentrypoint: {{script: {name}.py}}\nhealth: {{stall: {STALL}}}\n")
    run = launch(job, cwd=tmp_path)
    run.wait_for(r"\[rank0\]: step 19 ", timeout=300)
    began = time.monotonic()
    verdict = run.wait_for(r"harness: hang: (.*)", timeout=STALL + 60).group(1)
    assert time.monotonic() - began < STALL + 15, f"found after {time.monotonic() - began:.0f} s"
    return run, verdict


def test_a_rank_stuck_in_its_data_path_under_nccl_is_found_with_its_stack(tmp_path: Path, launch) -> None:
    run, verdict = hang_of_one_gpu_rank(tmp_path, launch, "stuck_gpu", SCRIPT)
    assert re.match(r"no progress for 10 s: rank 0 \(node0 on sim0\) at stuck_gpu.py:\d+ in load_batch: "
                    r"time.sleep\(3600\)", verdict), verdict
    assert run.finish(timeout=120) == 1
    kept = next((tmp_path / "runs").glob("*/stacks/attempt-0/rank0.txt")).read_text()
    assert "load_batch (stuck_gpu.py:" in kept and "time.sleep(3600)" in kept
    assert run.summary()["first_failure"]["kind"] == "hang"
    assert_nothing_left(run.run_id)


SPIN = '''
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
torch.cuda.set_device(0)
batch = torch.ones(1024, device="cuda")
for step in range(1000):
    if step == 20:
        torch.cuda._sleep(10**13)  # a kernel that runs for hours, ahead of the all_reduce on the stream
    dist.all_reduce(batch)
    print(f"step {step} {batch.sum().item():.1f}", flush=True)  # waits in a CUDA synchronization
'''


def test_a_rank_whose_collective_never_completes_on_the_gpu_is_found_while_its_cpu_spins(tmp_path: Path,
                                                                                         launch) -> None:
    """The rank waits in `.item()` for an all_reduce queued behind a kernel that never ends: its CPU may spin
    in the CUDA synchronization, but its collective does not complete, and that is the hang."""
    run, verdict = hang_of_one_gpu_rank(tmp_path, launch, "spin_gpu", SPIN)
    assert re.match(r"no progress for 10 s: rank 0 waits in all_reduce #\d+ at spin_gpu.py:\d+ in <module>: .*; no "
                    r"rank is behind: the collective itself does not complete", verdict), verdict
    assert run.finish(timeout=120) == 1
    kept = next((tmp_path / "runs").glob("*/stacks/attempt-0/rank0.txt")).read_text()
    assert "spin_gpu.py:" in kept
    assert_nothing_left(run.run_id)
