"""Checkpoint files: a writer killed mid-write never damages the newest checkpoint; unreadable ones are
skipped; what they hold reads back as the dataclasses it was written from, older files included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.payload import PayloadError, checkpoint
from harness.payload.metrics import EpochRecord
from harness.payload.progress import Config, Progress

CONFIG = Config(data="digits", subset=None, model="small", norm="batch", seed=0, global_batch=64, epochs=2, lr=0.4,
                weight_decay=5e-4, warmup=0.2, augment=True)


def state(value: float, sharded: bool = False) -> checkpoint.Checkpoint:
    progress = Progress(CONFIG, world_size=2, step=int(value), global_step=int(value))
    saved = checkpoint.Checkpoint(progress, scheduler={}, rng=checkpoint.Rng(torch.get_rng_state(), None))
    return saved if sharded else replace(saved, model={"w": torch.full((256, 256), value)}, optimizer={})


def test_writer_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A real process writes checkpoint 1, then is SIGKILLed halfway through writing checkpoint 2."""
    child = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_payload_checkpoint import state
        from harness.payload import checkpoint
        checkpoint.save(state(1.0), {str(tmp_path)!r}, 1, keep=3)
        checkpoint.save(state(2.0), {str(tmp_path)!r}, 2, keep=3)
        """
    )
    env = os.environ | {checkpoint.STALL_ENV: checkpoint.path_for(tmp_path, 2).name}
    proc = subprocess.Popen(
        [sys.executable, "-c", child], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert "stalling in the middle of writing" in proc.stderr.readline()
        partial = list(tmp_path.glob(".ckpt-*.tmp-*"))
        assert len(partial) == 1 and partial[0].stat().st_size > 0
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert checkpoint.newest_first(tmp_path) == [checkpoint.path_for(tmp_path, 1)]
    _path, loaded = checkpoint.load_newest(tmp_path, torch.device("cpu"), warn=no_warning)
    assert loaded.progress.step == 1 and torch.equal(loaded.model["w"], torch.full((256, 256), 1.0))
    checkpoint.remove_partial_writes(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001.pt"]


def no_warning(message: str) -> None:
    raise AssertionError(f"unexpected warning: {message}")


def test_unreadable_newest_is_skipped_with_one_line(tmp_path: Path) -> None:
    checkpoint.save(state(3.0), tmp_path, 3, keep=5)
    good = checkpoint.path_for(tmp_path, 3).read_bytes()
    checkpoint.path_for(tmp_path, 4).write_bytes(good[: len(good) // 2])
    checkpoint.path_for(tmp_path, 5).write_bytes(b"")
    torch.save({"model": {}}, checkpoint.path_for(tmp_path, 6))
    warnings: list[str] = []
    path, loaded = checkpoint.load_newest(tmp_path, torch.device("cpu"), warn=warnings.append)
    assert path == checkpoint.path_for(tmp_path, 3) and loaded.progress.step == 3
    assert len(warnings) == 3 and all("\n" not in w and "skipping unreadable checkpoint" in w for w in warnings)
    assert "ckpt-00000006.pt" in warnings[0] and "(PayloadError: missing optimizer, scheduler, rng, config," in warnings[0]


def test_only_the_newest_are_kept(tmp_path: Path) -> None:
    for step in (10, 2, 30, 4):
        checkpoint.save(state(float(step)), tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.newest_first(tmp_path)] == ["ckpt-00000030.pt", "ckpt-00000010.pt"]
    assert checkpoint.load_newest(tmp_path / "absent", torch.device("cpu"), warn=no_warning) is None


def sharded(ckpt_dir: Path, step: int, *, metadata: bool = True) -> Path:
    """A sharded checkpoint's folder as save_sharded leaves it (shards stand in as empty files here;
    tests/integration/payload/test_payload_elastic.py writes and reads real ones)."""
    folder = checkpoint.path_for(ckpt_dir, step, sharded=True)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"")
    if metadata:
        (folder / checkpoint.SHARDS_METADATA).write_bytes(b"")
    torch.save(state(float(step), sharded=True).encode(), folder / checkpoint.SHARDED_STATE)
    return folder


def test_sharded_folders_are_found_checked_and_pruned_like_files(tmp_path: Path) -> None:
    sharded(tmp_path, 4)
    sharded(tmp_path, 8, metadata=False)  # not possible through save_sharded, which renames a finished folder
    (tmp_path / ".ckpt-00000012.tmp").mkdir()
    (tmp_path / ".ckpt-00000012.tmp" / "__1_0.distcp").write_bytes(b"x")
    (tmp_path / "ckpt-00000016").write_text("a file with a folder's name is no checkpoint")
    assert [p.name for p in checkpoint.newest_first(tmp_path)] == ["ckpt-00000008", "ckpt-00000004"]
    warnings: list[str] = []
    path, loaded = checkpoint.load_newest(tmp_path, torch.device("cpu"), warn=warnings.append)
    assert path == checkpoint.path_for(tmp_path, 4, sharded=True) and loaded.progress.step == 4
    assert loaded.model is None and loaded.optimizer is None
    assert len(warnings) == 1 and "ckpt-00000008 (ValueError: no .metadata: its shards are incomplete)" in warnings[0]
    checkpoint.remove_partial_writes(tmp_path)
    assert not (tmp_path / ".ckpt-00000012.tmp").exists()
    sharded(tmp_path, 20)
    checkpoint.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000016", "ckpt-00000020"]


def written_before_the_dataclasses() -> dict:
    """A checkpoint as train.py wrote it when its state was a dict read by string keys."""
    record = {"epoch": 1, "steps": 22, "loss": 1.3, "accuracy": 0.55, "images_per_s": 5423.0, "seconds": 0.3,
              "world_size": 2, "global_step": 22}
    config = {"data": "digits", "subset": None, "model": "small", "norm": "batch", "seed": 0, "global_batch": 64,
              "epochs": 2, "lr": 0.4, "weight_decay": 5e-4, "warmup": 0.2, "augment": True}
    return {
        "model": {"w": torch.ones(2)}, "optimizer": {"state": {}}, "scheduler": {"last_epoch": 22}, "epoch": 1,
        "step": 0, "global_step": 22, "loss_carry": 0.0, "seconds_carry": 0.0, "history": [record],
        "config": config, "world_size": 2, "rng": {"cpu": torch.get_rng_state(), "cuda": None},
    }


def test_a_checkpoint_reads_back_as_the_dataclasses_under_the_keys_older_files_have(tmp_path: Path) -> None:
    old = written_before_the_dataclasses()
    torch.save(old, checkpoint.path_for(tmp_path, 22))
    _path, loaded = checkpoint.load_newest(tmp_path, torch.device("cpu"), warn=no_warning)
    assert loaded.progress == Progress(CONFIG, world_size=2, epoch=1, global_step=22, history=[
        EpochRecord(epoch=1, steps=22, loss=1.3, accuracy=0.55, images_per_s=5423.0, seconds=0.3, world_size=2,
                    global_step=22)])
    assert loaded.scheduler == {"last_epoch": 22} and torch.equal(loaded.rng.cpu, old["rng"]["cpu"])
    assert loaded.rng.cuda is None and loaded.optimizer == {"state": {}} and torch.equal(loaded.model["w"], torch.ones(2))
    checkpoint.save(loaded, tmp_path, 23, keep=5)
    again = torch.load(checkpoint.path_for(tmp_path, 23), weights_only=True)
    assert again.keys() == old.keys() and again["config"] == old["config"] and again["history"] == old["history"]


@pytest.mark.parametrize("drop,named", [
    (["loss_carry"], "missing loss_carry"),
    (["model", "history"], "missing model, history"),
    (["config.lr"], "missing config.lr"),
    (["rng.cuda"], "missing rng.cuda"),
])
def test_a_checkpoint_lacking_a_field_is_refused_naming_it(tmp_path: Path, drop: list[str], named: str) -> None:
    state = written_before_the_dataclasses()
    for key in drop:
        *inside, last = key.split(".")
        del (state[inside[0]] if inside else state)[last]
    torch.save(state, checkpoint.path_for(tmp_path, 22))
    with pytest.raises(PayloadError) as refused:
        checkpoint.load(checkpoint.path_for(tmp_path, 22), torch.device("cpu"))
    assert str(refused.value) == named
    warnings: list[str] = []
    assert checkpoint.load_newest(tmp_path, torch.device("cpu"), warn=warnings.append) is None
    assert warnings == [f"resume: skipping unreadable checkpoint {checkpoint.path_for(tmp_path, 22)} (PayloadError: {named})"]


def test_a_just_in_time_checkpoint_is_written_once_marked_and_resumed_first(tmp_path: Path) -> None:
    """The first survivor to claim a step writes it; the others, and a step that has a regular checkpoint, write
    nothing; it is the newest one on resume, pruned like the others; a claim a killed writer left is removed with
    the partial writes."""
    checkpoint.save(state(8.0), tmp_path, 8, keep=3)
    first = checkpoint.save_just_in_time(state(11.0), tmp_path, 11)
    assert first == tmp_path / "ckpt-00000011.jit.pt"
    assert checkpoint.save_just_in_time(state(11.0), tmp_path, 11) is None, "another survivor claimed it"
    assert checkpoint.save_just_in_time(state(8.0), tmp_path, 8) is None, "a regular checkpoint of the step exists"
    found = checkpoint.load_newest(tmp_path, torch.device("cpu"), warn=print)
    assert found is not None and found[0] == first and found[1].progress.global_step == 11
    assert checkpoint.newest_first(tmp_path) == [first, tmp_path / "ckpt-00000008.pt"]
    checkpoint.remove_partial_writes(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000008.pt", "ckpt-00000011.jit.pt"]
    for step in (12, 16, 20):
        checkpoint.save(state(float(step)), tmp_path, step, keep=3)
    assert [p.name for p in checkpoint.newest_first(tmp_path)] == ["ckpt-00000020.pt", "ckpt-00000016.pt",
                                                                   "ckpt-00000012.pt"]
