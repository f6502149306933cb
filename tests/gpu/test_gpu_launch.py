"""`harness launch` on a GPU machine: jobs/cifar.yaml's settings on one GPU, and what one GPU refuses."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from harness.spec.yamlsource import load_document

from conftest import REPO, assert_nothing_left, harness

pytestmark = pytest.mark.usefixtures("cuda")

ONE_GPU = os.environ | {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


def cifar_on_synthetic_data(path: Path) -> Path:
    """jobs/cifar.yaml on one node: its model, precision, compile, batch, checkpoints and restarts, on
    synthetic CIFAR-shaped data (nothing to download), 2 epochs, the peak lr scaled to one GPU's batch."""
    job = load_document(REPO / "jobs" / "cifar.yaml").data
    args = [str(a) for a in job["entrypoint"]["args"]]

    lr = float(args[args.index("--lr") + 1]) / 16  # the job's peak is for 2 nodes x 8 GPUs
    for flag, new in (("--data", "synthetic"), ("--epochs", "2"), ("--lr", f"{lr:g}")):
        args[args.index(flag) + 1] = new
    job |= {"nnodes": 1, "entrypoint": {"module": job["entrypoint"]["module"], "args": args}}
    for key in ("setup", "data_paths"):
        job.pop(key)
    path.write_text(json.dumps(job, indent=2))  # JSON is YAML; PyYAML's own dump would write `on:` as true
    return path


def test_cifar_settings_on_one_node_with_one_gpu_finish(tmp_path: Path, launch) -> None:
    run = launch(cifar_on_synthetic_data(tmp_path / "cifar1.yaml"), env=ONE_GPU, cwd=tmp_path)
    assert run.finish(timeout=900) == 0, run.output[-5000:]
    assert re.search(r"train: .*model=resnet18 world_size=1 device=cuda backend=nccl .*precision=bf16 "
                     r"compile=reduce-overhead", run.output), run.output[-5000:]
    done = re.search(r"done: test_acc=([\d.]+) global_step=(\d+) world_size=1 ", run.output)
    assert done and float(done.group(1)) >= 0.5, run.output[-5000:]
    assert int(done.group(2)) == 2 * (50_000 // 128)
    assert (tmp_path / "out" / "cifar" / "metrics.jsonl").is_file()
    assert list((tmp_path / "checkpoints" / "cifar").iterdir())
    assert run.summary()["status"] == "succeeded"
    assert_nothing_left(run.run_id)


def test_two_simulated_nodes_on_one_gpu_are_refused_before_anything_starts(tmp_path: Path) -> None:
    result = harness("launch", str(REPO / "jobs" / "cifar.yaml"), "--runs-dir", str(tmp_path / "runs"), env=ONE_GPU)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        "harness: error: 2 simulated nodes x 1 GPU rank(s) need 2 GPUs and this machine has 1; one GPU cannot "
        "host two NCCL ranks: lower nnodes or nproc_per_node, or set `backend: gloo` to run on CPU\n")
    assert result.stdout == "" and not (tmp_path / "runs").exists()


def test_the_smoke_job_runs_on_a_gpu_machine(tmp_path: Path, launch) -> None:
    """`make launch` as a new user first types it: gloo, 2 simulated nodes, whatever GPUs there are."""
    run = launch(REPO / "jobs" / "smoke.yaml", env=ONE_GPU)
    assert run.finish(timeout=300) == 0, run.output[-5000:]
    assert re.search(r"done: test_acc=[\d.]+ global_step=8 world_size=2 ", run.output), run.output[-5000:]
    assert_nothing_left(run.run_id)
