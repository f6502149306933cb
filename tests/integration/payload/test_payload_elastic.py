"""The same math on any world size and with either strategy: real torchrun, gloo on CPU, real SIGKILLs.

The global batch (64 here) defines every optimizer step, so FSDP steps like DDP, and a checkpoint
written by 2 ranks continues on 1 rank accumulating 2 micro-batches (and the reverse) with the losses
of the run that never stopped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness.payload import checkpoint

from payload_procs import clean_env, job, losses, run, single, torchrun, weights

pytestmark = pytest.mark.xdist_group("test_payload_elastic")  # one worker runs the references once

# One thread per process whatever the world size (torchrun sets it only for several workers per node):
# the runs then differ only by what the world size changes.
ONE_THREAD = clean_env(OMP_NUM_THREADS="1")
# 1024 CIFAR-shaped images, a global batch of 64: 16 steps per epoch, 32 in all (a resume at step 10 crosses
# into the next epoch).
ELASTIC = ["--data", "synthetic", "--model", "small", "--norm", "group", "--subset", "1024", "--epochs", "2",
           "--global-batch", "64", "--batch-size", "32", "--log-every", "1", "--ckpt-every", "4"]


@dataclass(frozen=True)
class Unbroken:
    """A 2-rank run never stopped: its losses, its final weights, its --ckpt-dir (the FSDP run's only)."""

    losses: dict[int, float]
    weights: dict[str, torch.Tensor]
    ckpt: Path


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Unbroken]:
    """Per strategy, the 2-rank run that the stopped, killed and resized runs must match. The FSDP run also keeps its
    sharded checkpoints (writing them changes no step), which test_a_checkpoint_of_the_other_strategy_is_named_not_skipped
    resumes with the other strategy."""
    found = {}
    for strategy in ("ddp", "fsdp"):
        root = tmp_path_factory.mktemp(f"unbroken-{strategy}")
        kept = ["--ckpt-dir", str(root / "ckpt")] if strategy == "fsdp" else []
        run(torchrun() + ELASTIC + ["--strategy", strategy, "--losses", str(root / "losses.jsonl"),
                                    "--save-final", str(root / "final.pt"), *kept], env=ONE_THREAD)
        found[strategy] = Unbroken(losses(root / "losses.jsonl"), weights(root / "final.pt"), root / "ckpt")
    return found


def test_fsdp_steps_with_the_loss_of_ddp(tmp_path: Path) -> None:
    """20 steps on the same seed and data, BatchNorm included (its statistics are per micro-batch either way)."""
    common = ["--data", "synthetic", "--model", "small", "--subset", "2048", "--epochs", "1", "--max-steps", "20",
              "--global-batch", "64", "--batch-size", "32", "--log-every", "10"]
    curves = {}
    for strategy in ("ddp", "fsdp"):
        started = run(torchrun() + common + ["--strategy", strategy, "--losses", str(tmp_path / f"{strategy}.jsonl")])
        assert f"strategy={strategy} global batch 64 = 2 rank(s) x 32 image(s) per rank" in started.output
        curves[strategy] = losses(tmp_path / f"{strategy}.jsonl")
    assert list(curves["ddp"]) == list(curves["fsdp"]) == list(range(1, 21))
    gaps = [abs(curves["ddp"][s] - curves["fsdp"][s]) for s in range(1, 21)]
    assert max(gaps) <= 1e-5, gaps
    assert curves["ddp"][20] < curves["ddp"][1] - 0.1, "the loss must move for the comparison to mean anything"


def test_fsdp_killed_while_writing_its_shards_resumes_bitwise(unbroken, tmp_path: Path) -> None:
    """Both ranks wrote their shards of checkpoint 12 and rank 0 is killed before the checkpoint is in
    place: checkpoint 8 is intact, the half-made folder is never read, and the resumed run ends bitwise
    equal to the unbroken one."""
    ckpt = tmp_path / "ckpt"
    args = [*ELASTIC, "--strategy", "fsdp", "--ckpt-dir", str(ckpt), "--resume",
            "--losses", str(tmp_path / "losses.jsonl"), "--save-final", str(tmp_path / "final.pt")]
    stalled = checkpoint.path_for(ckpt, 12, sharded=True)
    with job(torchrun() + args, ONE_THREAD | {checkpoint.STALL_ENV: stalled.name}) as killed:
        killed.wait_for(r"stalling in the middle of writing", 120)
        killed.track()
        killed.kill_group()
    assert not stalled.exists() and list((ckpt / f".{stalled.name}.tmp").glob("*.distcp"))
    newest = checkpoint.newest_first(ckpt)[0]
    assert newest == checkpoint.path_for(ckpt, 8, sharded=True)
    assert sorted(p.name for p in newest.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]

    resumed = run(torchrun() + args, env=ONE_THREAD)
    assert "resume: epoch 1/2 step 8/16 (global step 8)" in resumed.output, resumed.output
    assert not (ckpt / f".{stalled.name}.tmp").exists()
    expected = unbroken["fsdp"]
    assert losses(tmp_path / "losses.jsonl") == expected.losses
    final = weights(tmp_path / "final.pt")
    assert final.keys() == expected.weights.keys()
    assert [k for k in final if not torch.equal(final[k], expected.weights[k])] == []


@pytest.mark.parametrize("strategy,before,after", [("ddp", 1, 2), ("fsdp", 2, 1)])
def test_a_checkpoint_resumes_on_another_world_size_with_the_same_losses(unbroken, tmp_path: Path, strategy: str,
                                                                         before: int, after: int) -> None:
    """Both directions and both strategies in two runs: DDP grows from the checkpoint of one rank that accumulated
    two micro-batches a step; FSDP shrinks, one rank reading both ranks' shards and accumulating. The other two
    pairs run no other code of the payload's: a DDP checkpoint is one file whatever the world size, and DCP
    reshards either way."""
    ckpt, curve = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    args = [*ELASTIC, "--strategy", strategy, "--ckpt-dir", str(ckpt), "--losses", str(curve)]
    run(torchrun(before) + args + ["--max-steps", "10"], env=ONE_THREAD)
    resumed = run(torchrun(after) + args + ["--resume", "--save-final", str(tmp_path / "final.pt")], env=ONE_THREAD)
    share = 64 // after
    split = f"{share} image(s) per rank" + (" as 2 micro-batches of 32" if share == 64 else "")
    assert f"resume: world size {before} -> {after}; the same steps continue: global batch 64 = {after} rank(s) x " \
           f"{split}" in resumed.output, resumed.output
    assert re.search(r"^resume: epoch 1/2 step 10/16 \(global step 10\)", resumed.output, re.M), resumed.output
    expected = unbroken[strategy]
    got = losses(curve)
    assert list(got) == list(expected.losses) == list(range(1, 33))
    gaps = [abs(got[s] - expected.losses[s]) for s in got]
    assert max(gaps) <= 1e-4, gaps
    final = weights(tmp_path / "final.pt")
    assert max((final[k] - expected.weights[k]).abs().max().item() for k in final) <= 1e-4


def test_a_world_size_that_does_not_divide_the_global_batch_is_refused(tmp_path: Path) -> None:
    with job([*torchrun(2), "--data", "synthetic", "--model", "small", "--subset", "256", "--global-batch", "63"]) \
            as started:
        code = started.finish(120)
    assert code != 0
    assert "error: the global batch of 63 images cannot be shared equally by 2 ranks; run on a world size that " \
           "divides it (1, 3, 7, 9, 21, 63), or start afresh with another --global-batch" in started.output


def test_a_checkpoint_of_the_other_strategy_is_named_not_skipped(unbroken) -> None:
    """The unbroken FSDP run's sharded checkpoints, resumed with --strategy ddp: refused by name. One process, no
    torchrun: the newest checkpoint is chosen and judged before any process group or model exists."""
    ckpt = unbroken["fsdp"].ckpt
    with job([*single(), *ELASTIC, "--ckpt-dir", str(ckpt), "--resume"]) as started:
        code = started.finish(120)
    assert code == 2, started.output
    assert f"error: the newest checkpoint in {ckpt}, ckpt-00000032, was written with --strategy fsdp; " \
           f"resume it with --strategy fsdp, or start afresh in another --ckpt-dir" in started.output
