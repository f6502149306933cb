"""The payload on CUDA: nccl, bf16 autocast, channels_last and torch.compile, for real."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from conftest import Streamed, free_port
from train_probe import check_steps_make_no_host_sync, compile_counts

pytestmark = pytest.mark.usefixtures("cuda")

# ResNet-18 at the fast settings, on 256-image batches of synthetic CIFAR-shaped data.
FAST = ["--data", "synthetic", "--model", "resnet18", "--batch-size", "256", "--precision", "bf16",
        "--device", "cuda"]


def test_cuda_steps_between_log_lines_make_no_host_sync() -> None:
    check_steps_make_no_host_sync([*FAST, "--subset", str(256 * 13)], cuda=True)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_cuda_training_compiles_once(mode: str) -> None:
    """Two epochs with an evaluation between them; reduce-overhead also records CUDA graphs."""
    found = compile_counts([*FAST, "--subset", str(256 * 6), "--epochs", "2", "--log-every", "2", "--compile", mode])
    assert "device=cuda backend=none" in found["output"] and f"compile={mode}" in found["output"]
    assert (found["frames"], found["graphs"], found["graph_breaks"]) == (1, 1, {}), found
    assert re.search(r"^done: test_acc=[\d.]+ global_step=12 ", found["output"], re.M), found["output"]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", "-m", "harness.payload.train", *args]


def _run(argv: list[str], timeout: float = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    started = Streamed(argv, env=env | {"HARNESS_BACKEND": "nccl", "PYTHONUNBUFFERED": "1"})
    try:
        code = started.finish(timeout)
    finally:
        started.kill_group()
    assert code == 0, f"exit {code}:\n{started.output[-4000:]}"
    return started.output


def test_nccl_rank_learns_checkpoints_and_resumes_on_cuda(tmp_path: Path) -> None:
    """One torchrun rank over NCCL and DDP, bf16 with CUDA graphs: a stop at step 30, then --resume to the end.

    ResNet-18 diverges on the synthetic data at --lr 0.2 with this batch (and learns at 0.05), on fp32 as well.
    """
    args = [*FAST, "--subset", "8192", "--epochs", "4", "--lr", "0.05", "--compile", "reduce-overhead",
            "--log-every", "10",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "10", "--resume", "--out-dir", str(tmp_path)]
    first = _run(_torchrun(*args, "--max-steps", "30"))
    assert "device=cuda backend=nccl" in first and "precision=bf16 compile=reduce-overhead" in first, first
    resumed = _run(_torchrun(*args))
    assert "resume: epoch 1/4 step 30/32 (global step 30)" in resumed, resumed
    done = re.search(r"^done: test_acc=([\d.]+) global_step=128 world_size=1 ", resumed, re.M)
    assert done and float(done.group(1)) >= 0.5, resumed
