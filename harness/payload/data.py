"""Datasets as whole uint8 tensors (N, C, H, W), read once and kept in memory or on the GPU.

CIFAR-10 comes from the official python-format batches (one pickled uint8 array per file, no
per-image decoding). Downloading is a separate, single-process step (`prepare_cifar10`), never done
by training ranks. `synthetic` is CIFAR-shaped and learnable, for smoke runs and benchmarks;
`digits` is scikit-learn's bundled 8x8 digits, so an offline CI run can show that training learns.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from harness.payload import PayloadError

DATASETS = ("cifar10", "synthetic", "digits")
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = ("test_batch",)
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


@dataclass(frozen=True)
class Dataset:
    """Train and test images (uint8, N x C x H x W) with labels, how to normalise and augment them."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    pad: int
    flip: bool

    @property
    def channels(self) -> int:
        return self.train_x.shape[1]

    def to(self, device: torch.device) -> Dataset:
        return replace(self, **{k: getattr(self, k).to(device) for k in ("train_x", "train_y", "test_x", "test_y")})

    def subset(self, n: int | None) -> Dataset:
        """The first n train and the first n test images (tests and quick runs)."""
        if n is None:
            return self
        return replace(
            self, train_x=self.train_x[:n], train_y=self.train_y[:n], test_x=self.test_x[:n], test_y=self.test_y[:n]
        )


def load(name: str, data_dir: Path, seed: int, subset: int | None = None) -> Dataset:
    if name == "cifar10":
        return load_cifar10(data_dir).subset(subset)
    if name == "synthetic":
        return synthetic(seed, subset or 50_000, subset or 10_000)
    if name == "digits":
        return digits().subset(subset)
    raise PayloadError(f"unknown dataset {name!r}: expected one of {', '.join(DATASETS)}")


def _prepare_hint(data_dir: Path) -> str:
    return f"run `harness prepare --data-dir {data_dir}` (or `python -m harness.payload.prepare --data-dir {data_dir}`)"


def cifar10_dir(data_dir: Path) -> Path:
    """The folder holding the batches: DIR/cifar-10-batches-py, or DIR itself."""
    data_dir = Path(data_dir)
    for candidate in (data_dir / CIFAR_DIR, data_dir):
        if all((candidate / name).is_file() for name in CIFAR_TRAIN + CIFAR_TEST):
            return candidate
    raise PayloadError(
        f"CIFAR-10 not found in {data_dir}: expected {data_dir / CIFAR_DIR}/"
        f"{{data_batch_1..5,test_batch}}; {_prepare_hint(data_dir)}"
    )


def load_cifar10(data_dir: Path) -> Dataset:
    folder = cifar10_dir(data_dir)
    train_x, train_y = _read_batches(folder, CIFAR_TRAIN, data_dir)
    test_x, test_y = _read_batches(folder, CIFAR_TEST, data_dir)
    return Dataset(train_x, train_y, test_x, test_y, CIFAR_MEAN, CIFAR_STD, 10, pad=4, flip=True)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickling runs code named by the file; allow only what a CIFAR batch needs (numpy arrays)."""

    ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset({
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    })

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
        return super().find_class(module, name)


def _read_batches(folder: Path, names: tuple[str, ...], data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = [], []
    for name in names:
        path = folder / name
        try:
            with open(path, "rb") as f:
                batch = _ArrayUnpickler(f, encoding="bytes").load()
            x = torch.as_tensor(batch[b"data"])
            y = torch.as_tensor(list(batch[b"labels"]), dtype=torch.int64)
            if x.dtype != torch.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
                raise ValueError(f"data is {tuple(x.shape)} {x.dtype}, expected N x 3072 uint8")
            if y.shape != (x.shape[0],) or (y.numel() and (y.min() < 0 or y.max() > 9)):
                raise ValueError("labels do not match the images or fall outside 0..9")
        except Exception as e:  # noqa: BLE001 - a malformed pickle can raise anything; said in one error
            raise PayloadError(
                f"{path} is not a valid CIFAR-10 batch ({type(e).__name__}: {e}); "
                f"delete {folder} and {_prepare_hint(data_dir)}"
            ) from None
        xs.append(x.reshape(-1, 3, 32, 32))
        ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def prepare_cifar10(data_dir: Path, url: str = CIFAR_URL, md5: str = CIFAR_MD5) -> Path:
    """Download, verify and extract CIFAR-10 into data_dir (idempotent); returns the batches folder.

    Run it once, in one process: training ranks only read.
    """
    data_dir = Path(data_dir)
    try:
        return cifar10_dir(data_dir)
    except PayloadError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    archive = data_dir / CIFAR_ARCHIVE
    if not archive.is_file() or file_md5(archive) != md5:
        _download(url, archive)
        actual = file_md5(archive)
        if actual != md5:
            archive.unlink()
            raise PayloadError(
                f"{url}: md5 {actual} does not match the expected {md5}; the download was removed, try again"
            )
    staging = Path(tempfile.mkdtemp(prefix=".extract-", dir=data_dir))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(staging, filter="data")
        if not (staging / CIFAR_DIR).is_dir():
            raise PayloadError(f"{archive} holds no {CIFAR_DIR}/ folder; delete it and run prepare again")
        shutil.rmtree(data_dir / CIFAR_DIR, ignore_errors=True)
        os.replace(staging / CIFAR_DIR, data_dir / CIFAR_DIR)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PayloadError(f"could not extract {archive} ({e}); delete it and run prepare again") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cifar10_dir(data_dir)


def file_md5(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download(url: str, dest: Path) -> None:
    """Into a temporary file first, so an interrupted download never looks like the archive."""
    print(f"downloading {url} -> {dest}", flush=True)
    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise PayloadError(
            f"could not download {url} ({e}); fetch it by hand into {dest}, or name a mirror with --url, "
            f"and run prepare again"
        ) from None
    os.replace(tmp, dest)


def synthetic(seed: int, n_train: int, n_test: int) -> Dataset:
    """CIFAR-shaped images: a fixed random pattern per class plus noise, so a model can learn it."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randint(0, 128, (10, 3, 32, 32), generator=g, dtype=torch.uint8)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        return patterns[y] + torch.randint(0, 128, (n, 3, 32, 32), generator=g, dtype=torch.uint8), y

    train_x, train_y = draw(n_train)
    test_x, test_y = draw(n_test)
    return Dataset(train_x, train_y, test_x, test_y, (0.5,) * 3, (0.2,) * 3, 10, pad=4, flip=True)


def digits(test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's 1797 8x8 digits (values 0..16) as 1-channel uint8 images; fixed split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise PayloadError("--data digits needs scikit-learn: pip install scikit-learn") from None
    bunch = load_digits()
    x = (torch.as_tensor(bunch.images, dtype=torch.float32) * (255 / 16)).round().to(torch.uint8).unsqueeze(1)
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    scaled = x[train].float() / 255
    mean, std = scaled.mean().item(), scaled.std().item()
    return Dataset(x[train], y[train], x[test], y[test], (mean,), (std,), 10, pad=1, flip=False)
