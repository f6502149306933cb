"""The payload as users run it: real torchrun processes, gloo on CPU, real SIGKILLs."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from harness.node.proctable import is_alive
from harness.payload import checkpoint
from harness.payload.model import build

from conftest import free_port
from payload_procs import PY, clean_env, job, records, run, single, torchrun, weights

pytestmark = pytest.mark.xdist_group("test_payload_train")  # one worker runs the reference once

# 1024 CIFAR-shaped images, 2 ranks x 16: 32 steps per epoch, 64 in all, a few seconds on 2 cores.
SMALL = ["--data", "synthetic", "--model", "small", "--subset", "1024", "--batch-size", "16", "--epochs", "2",
         "--log-every", "1", "--ckpt-every", "4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """An uninterrupted 2-rank run; --resume with an empty --ckpt-dir must be a no-op."""
    root = tmp_path_factory.mktemp("reference")
    started = run(torchrun() + SMALL + ["--ckpt-dir", str(root / "ckpt"), "--resume", "--out-dir", str(root / "out"),
                                        "--save-final", str(root / "final.pt")])
    assert "resume: no checkpoint in" in started.output
    return weights(root / "final.pt"), records(root / "out")


def assert_same_weights(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not different, f"not bitwise equal: {different}"


def test_two_ranks_equal_one_process_on_the_same_samples(tmp_path: Path) -> None:
    """DDP's guarantee: 2 ranks x batch B step exactly like 1 process x batch 2B on the same samples.

    Rank r takes perm[r::2] of the epoch's permutation, so step s of the two ranks covers perm[32s:32(s+1)],
    the one process's step-s batch. BatchNorm would break the equivalence: it normalises with each rank's
    own batch statistics, so --norm group (GroupNorm, per-sample statistics) is used. Augmentation stays
    on: crop and flip depend only on (seed, epoch, sample index), not on which rank sees the sample.
    """
    common = ["--data", "synthetic", "--model", "small", "--norm", "group", "--subset", "512", "--epochs", "1",
              "--max-steps", "8", "--lr", "0.1", "--log-every", "4"]
    run(torchrun() + common + ["--batch-size", "16", "--save-final", str(tmp_path / "ddp.pt")])
    run(single() + common + ["--batch-size", "32", "--save-final", str(tmp_path / "one.pt")])
    ddp, one = weights(tmp_path / "ddp.pt"), weights(tmp_path / "one.pt")
    torch.manual_seed(0)
    init = build("small", 3, 10, "group").state_dict()
    assert ddp.keys() == one.keys() == init.keys()
    gap = max((ddp[k] - one[k]).abs().max().item() for k in ddp)
    moved = max((ddp[k] - init[k]).abs().max().item() for k in ddp)
    for k in ddp:
        torch.testing.assert_close(ddp[k], one[k], rtol=1e-3, atol=1e-4)  # float32 summation order differs
    assert moved > 1000 * gap, f"training moved the weights by {moved}, the runs differ by {gap}"


def test_sigkill_while_writing_a_checkpoint_then_resume_is_bitwise(reference, tmp_path: Path) -> None:
    """Mid-epoch, rank 0 halfway through writing checkpoint 12 (test hook in checkpoint.py): torchrun's process
    group SIGKILLed, as a crash or `kill -9` would. The workers die with their agent; checkpoint 8 must still be
    the newest, the half-written temporary file must never be taken for a checkpoint, and a corrupt newer file (as
    a non-atomic writer would leave) is skipped with one line. The resumed run ends bitwise equal to the unbroken
    one, with its metrics history."""
    ckpt = tmp_path / "ckpt"
    args = [*SMALL, "--ckpt-dir", str(ckpt), "--resume", "--out-dir", str(tmp_path / "out"),
            "--save-final", str(tmp_path / "final.pt")]
    stalled = checkpoint.path_for(ckpt, 12)
    with job(torchrun() + args, clean_env(**{checkpoint.STALL_ENV: stalled.name})) as killed:
        killed.wait_for(r"stalling in the middle of writing", 120)
        workers = killed.track()
        killed.kill_group()
        deadline = time.monotonic() + 15
        while any(is_alive(pid, ticks) for pid, ticks in workers.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(is_alive(pid, ticks) for pid, ticks in workers.items()), "workers outlived their torchrun agent"
    assert len(workers) >= 2 and "done:" not in killed.output
    assert re.search(r"^epoch 1/2 step 12/32 ", killed.output, re.M), killed.output
    assert not stalled.exists() and not (tmp_path / "final.pt").exists()
    partial = list(ckpt.glob(f".{stalled.name}.tmp-*"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    assert checkpoint.newest_first(ckpt)[0] == checkpoint.path_for(ckpt, 8)
    corrupt = checkpoint.path_for(ckpt, 99)
    corrupt.write_bytes(checkpoint.path_for(ckpt, 8).read_bytes()[:5000])

    resumed = run(torchrun() + args)
    skipped = [line for line in resumed.lines if "skipping unreadable checkpoint" in line]
    assert len(skipped) == 1 and str(corrupt) in skipped[0]
    assert re.search(r"^resume: epoch 1/2 step 8/32 \(global step 8\) ", resumed.output, re.M), resumed.output
    assert not partial[0].exists()
    assert_same_weights(reference[0], weights(tmp_path / "final.pt"))

    def curve(history: list[dict]) -> list[tuple[float, float]]:
        return [(r["loss"], r["accuracy"]) for r in history]

    assert curve(records(tmp_path / "out")) == curve(reference[1])


def test_digits_reach_90_percent_as_two_nodes_with_metrics_and_plot(tmp_path: Path) -> None:
    """The jobs/smoke.yaml shape: 2 torchrun agents (nodes) x 1 worker, static rendezvous on loopback, on the digits
    set: 90% test accuracy in 4 epochs; rank 0 alone prints progress and writes metrics.jsonl and metrics.png.

    torchrun sets OMP_NUM_THREADS=1 only for several workers per node; two 1-worker "nodes" on one
    2-core machine would each start 2 threads and run ~10x slower, so the env sets it here.
    """
    port, out, env = free_port(), tmp_path / "out", clean_env(OMP_NUM_THREADS="1")
    digits = ["--data", "digits", "--model", "small", "--epochs", "4", "--batch-size", "32", "--lr", "0.1",
              "--log-every", "10"]
    with job(torchrun(1, 2, 0, port) + digits + ["--out-dir", str(out)], env) as node0, \
            job(torchrun(1, 2, 1, port) + digits + ["--out-dir", str(tmp_path / "out1")], env) as node1:
        # guard: a hung rendezvous or rank; the run took 19 s on a 2-core machine at load 5, 42 s at load 10
        assert node0.finish(120) == 0, node0.output
        assert node1.finish(120) == 0, node1.output
    done = re.search(r"^done: test_acc=([\d.]+) global_step=88 world_size=2 ", node0.output, re.M)
    assert done and float(done.group(1)) >= 0.9, node0.output
    assert not re.search(r"^(epoch|done|train)", node1.output, re.M), "only rank 0 prints progress"
    history = records(out)
    assert [r["epoch"] for r in history] == [1, 2, 3, 4] and {r["world_size"] for r in history} == {2}
    assert history[-1]["loss"] < history[0]["loss"] / 4 and min(r["images_per_s"] for r in history) > 0
    assert history[-1]["accuracy"] == pytest.approx(float(done.group(1)), abs=1e-4)
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "out1").exists()


def test_missing_cifar_is_one_clear_error(tmp_path: Path) -> None:
    with job([*single(), "--data", "cifar10", "--data-dir", str(tmp_path / "empty"), "--model", "small"]) as started:
        code = started.finish(60)
    assert code == 2
    assert started.lines == [
        f"error: CIFAR-10 not found in {tmp_path / 'empty'}: expected {tmp_path / 'empty' / 'cifar-10-batches-py'}/"
        f"{{data_batch_1..5,test_batch}}; run `harness prepare --data-dir {tmp_path / 'empty'}` "
        f"(or `python -m harness.payload.prepare --data-dir {tmp_path / 'empty'}`)"
    ]


def test_prepare_cli_reports_a_failed_download(tmp_path: Path) -> None:
    with job([PY, "-m", "harness.payload.prepare", "--data-dir", str(tmp_path), "--url",
              (tmp_path / "nothing.tar.gz").as_uri()]) as started:
        code = started.finish(60)
    assert code == 1 and len(started.lines) == 2, started.output  # not bad usage: a download that failed
    assert started.lines[1].startswith(f"harness.payload.prepare: error: could not download "
                                       f"{(tmp_path / 'nothing.tar.gz').as_uri()}")
