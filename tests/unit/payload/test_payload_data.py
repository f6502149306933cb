"""Data: the CIFAR-10 reader and preparer on files in the official format, sharding and augmentation."""

from __future__ import annotations

import hashlib
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from harness.payload import PayloadError
from harness.payload.batches import Split, augment, epoch_plan, split
from harness.payload.data import CIFAR_DIR, digits, load_cifar10, prepare_cifar10, synthetic

PER_BATCH = 12


def write_batch(path: Path, seed: int, n: int = PER_BATCH) -> tuple[np.ndarray, list[int]]:
    """One batch exactly as the official archive stores it: a protocol-2 pickle of a bytes-keyed dict."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, n).tolist()
    entry = {b"batch_label": b"testing", b"labels": labels, b"data": images, b"filenames": [b"x.png"] * n}
    path.write_bytes(pickle.dumps(entry, protocol=2))
    return images, labels


def write_cifar(root: Path) -> dict[str, tuple[np.ndarray, list[int]]]:
    folder = root / CIFAR_DIR
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return {name: write_batch(folder / name, seed) for seed, name in enumerate(names)}


def make_archive(tmp_path: Path) -> tuple[Path, str]:
    source = tmp_path / "source"
    write_cifar(source)
    archive = tmp_path / "fake-cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / CIFAR_DIR, arcname=CIFAR_DIR)
    return archive, hashlib.md5(archive.read_bytes()).hexdigest()


def test_reader_returns_the_official_layout(tmp_path: Path) -> None:
    written = write_cifar(tmp_path)
    ds = load_cifar10(tmp_path)
    assert ds.train_x.shape == (5 * PER_BATCH, 3, 32, 32) and ds.train_x.dtype == torch.uint8
    assert ds.test_x.shape == (PER_BATCH, 3, 32, 32)
    images, labels = written["data_batch_2"]
    # Row-major: 1024 red values, then green, then blue, each a 32x32 image.
    second = ds.train_x[PER_BATCH : 2 * PER_BATCH]
    assert torch.equal(second[:, 1], torch.from_numpy(images[:, 1024:2048].reshape(-1, 32, 32)))
    assert ds.train_y[PER_BATCH : 2 * PER_BATCH].tolist() == labels
    assert ds.test_y.tolist() == written["test_batch"][1]
    assert torch.equal(load_cifar10(tmp_path / CIFAR_DIR).train_x, ds.train_x)


def test_missing_dataset_names_the_directory_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(PayloadError) as err:
        load_cifar10(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(err.value)
    assert f"harness prepare --data-dir {tmp_path / 'nowhere'}" in str(err.value)


def official(data: np.ndarray, labels: list[int]) -> bytes:
    return pickle.dumps({b"data": data, b"labels": labels}, protocol=2)


@pytest.mark.parametrize(
    "content,reason",
    [
        (official(np.zeros((3, 3072), np.uint8), [0, 1, 2])[:100], "UnpicklingError|EOFError"),
        (b"not a pickle at all", "UnpicklingError"),
        (official(np.zeros((3, 100), np.uint8), [0, 1, 2]), r"data is \(3, 100\) torch.uint8, expected N x 3072 uint8"),
        (official(np.zeros((3, 3072), np.uint8), [0, 1, 12]), "labels do not match the images or fall outside 0..9"),
    ],
    ids=["truncated", "garbage", "wrong-shape", "bad-label"],
)
def test_corrupt_batch_is_a_clear_error(tmp_path: Path, content: bytes, reason: str) -> None:
    write_cifar(tmp_path)
    victim = tmp_path / CIFAR_DIR / "data_batch_3"
    victim.write_bytes(content)
    with pytest.raises(PayloadError, match=reason) as err:
        load_cifar10(tmp_path)
    assert str(victim) in str(err.value) and "harness prepare" in str(err.value)


class _Payload:
    """A pickle that would run code when loaded."""

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_reader_refuses_pickled_code(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    evil = _Payload()
    evil.marker = str(tmp_path / "ran")
    (tmp_path / CIFAR_DIR / "test_batch").write_bytes(pickle.dumps({b"data": evil, b"labels": []}, protocol=2))
    with pytest.raises(PayloadError, match="unexpected object"):
        load_cifar10(tmp_path)
    assert not (tmp_path / "ran").exists()


def test_prepare_downloads_verifies_and_extracts_once(tmp_path: Path) -> None:
    archive, md5 = make_archive(tmp_path)
    data_dir = tmp_path / "data"
    folder = prepare_cifar10(data_dir, url=archive.as_uri(), md5=md5)
    assert folder == data_dir / CIFAR_DIR
    assert load_cifar10(data_dir).train_x.shape[0] == 5 * PER_BATCH
    archive.unlink()  # a second call must not need the source again
    assert prepare_cifar10(data_dir, url=archive.as_uri(), md5=md5) == folder
    assert not list(data_dir.glob(".extract-*")) and not list(data_dir.glob("*.part"))


def test_prepare_reuses_a_verified_archive_without_downloading(tmp_path: Path) -> None:
    archive, md5 = make_archive(tmp_path)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    archive.rename(data_dir / "cifar-10-python.tar.gz")
    assert prepare_cifar10(data_dir, url="file:///nonexistent/archive.tar.gz", md5=md5).is_dir()


def test_prepare_rejects_a_checksum_mismatch(tmp_path: Path) -> None:
    archive, _ = make_archive(tmp_path)
    data_dir = tmp_path / "data"
    with pytest.raises(PayloadError, match="does not match the expected 0123"):
        prepare_cifar10(data_dir, url=archive.as_uri(), md5="0123" + "0" * 28)
    assert not (data_dir / "cifar-10-python.tar.gz").exists()
    assert not (data_dir / CIFAR_DIR).exists()


def test_prepare_reports_an_unreachable_url(tmp_path: Path) -> None:
    with pytest.raises(PayloadError, match="could not download"):
        prepare_cifar10(tmp_path, url=(tmp_path / "missing.tar.gz").as_uri())


def test_synthetic_is_deterministic_from_the_seed() -> None:
    a, b, c = synthetic(1, 64, 16), synthetic(1, 64, 16), synthetic(2, 64, 16)
    assert a.train_x.shape == (64, 3, 32, 32) and a.test_x.shape == (16, 3, 32, 32)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    assert not torch.equal(a.train_x, c.train_x)


def test_digits_are_one_channel_8x8() -> None:
    ds = digits()
    assert ds.train_x.shape[1:] == (1, 8, 8) and len(ds.train_y) + len(ds.test_y) == 1797
    assert ds.train_x.max() == 255 and not ds.flip


@pytest.mark.parametrize("n,world,epoch", [(100, 2, 0), (101, 2, 3), (37, 4, 1), (10, 1, 5)])
def test_shards_match_distributed_sampler(n: int, world: int, epoch: int) -> None:
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=True)
        sampler.set_epoch(epoch)
        plan = epoch_plan(n, 7, epoch, rank, world, pad=4, flip=True, device=torch.device("cpu"))
        assert plan.streams[0].tolist() == list(sampler)


def test_ranks_together_see_the_single_process_batch() -> None:
    """Step s of 2 ranks x B covers exactly step s of 1 process x 2B: the premise of the DDP equivalence test."""
    n, b, cpu = 103, 5, torch.device("cpu")
    single = epoch_plan(n, 3, 2, 0, 1, 4, True, cpu)
    ranks = [epoch_plan(n, 3, 2, r, 2, 4, True, cpu) for r in range(2)]
    for step in range(n // (2 * b)):
        union = torch.cat([plan.batch(step, b) for plan in ranks])
        assert sorted(union.tolist()) == sorted(single.batch(step, 2 * b).tolist())
    assert torch.equal(single.offsets, ranks[1].offsets) and torch.equal(single.flips, ranks[1].flips)


@pytest.mark.parametrize("global_batch,world,max_micro,expected", [
    (64, 2, 32, (32, 1)), (64, 1, 32, (32, 2)), (96, 2, 32, (24, 2)), (96, 3, 32, (32, 1)), (96, 1, 40, (32, 3)),
    (7, 1, 2, (1, 7)), (1024, 8, 1024, (128, 1)),
])
def test_each_rank_takes_its_share_in_the_fewest_equal_micro_batches(global_batch, world, max_micro, expected):
    cut = split(global_batch, world, max_micro)
    assert (cut.micro, cut.accumulation) == expected and cut.micro * cut.accumulation * world == global_batch


def test_a_world_size_that_does_not_divide_the_global_batch_is_named() -> None:
    with pytest.raises(PayloadError, match=r"the global batch of 96 images cannot be shared equally by 5 ranks; run on "
                                           r"a world size that divides it \(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48\, ...\)"):
        split(96, 5, 32)


@pytest.mark.parametrize("a,b", [((2, 1), (1, 2)), ((4, 1), (2, 2)), ((3, 2), (6, 1))])
def test_each_micro_batch_is_the_same_whatever_the_world_size(a: tuple[int, int], b: tuple[int, int]) -> None:
    """(world, accumulation) pairs with one product: every step's micro-batches are the same sets of
    samples, so per-micro-batch statistics (BatchNorm) match too, and their union is the step's slice."""
    n, cpu, global_batch = 200, torch.device("cpu"), 24

    def micro_batches(world: int, accumulation: int, step: int) -> list[list[int]]:
        micro = global_batch // (world * accumulation)
        plans = [epoch_plan(n, 5, 1, r, world, 4, True, cpu, accumulation) for r in range(world)]
        return sorted(sorted(p.batch(step, micro, m).tolist()) for p in plans for m in range(accumulation))

    for step in range(n // global_batch):
        assert micro_batches(*a, step) == micro_batches(*b, step)
        union = sorted(i for batch in micro_batches(*a, step) for i in batch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(5 + 1))
        assert union == sorted(perm[step * global_batch : (step + 1) * global_batch].tolist())
    assert Split(24, 3, 2).describe() == "global batch 24 = 3 rank(s) x 8 image(s) per rank as 2 micro-batches of 4"


def test_augment_matches_per_image_crop_and_flip() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (6, 3, 32, 32), generator=g, dtype=torch.uint8)
    offsets = torch.randint(0, 9, (6, 2), generator=g)
    flips = torch.tensor([True, False, True, False, False, True])
    out = augment(x, offsets, flips, pad=4)
    for i in range(6):
        dy, dx = offsets[i].tolist()
        crop = F.pad(x[i], (4, 4, 4, 4))[:, dy : dy + 32, dx : dx + 32]
        assert torch.equal(out[i], crop.flip(-1) if flips[i] else crop)
    assert torch.equal(augment(x, torch.full((6, 2), 4), torch.zeros(6, dtype=torch.bool), pad=4), x)
