"""Checkpoints: atomic writes, the newest readable one on resume, and pruning. Two layouts:

- `ckpt-<step>.pt` (DDP): one file rank 0 writes, holding everything. It is serialised in memory,
  written to a hidden temporary file in the same folder, flushed and fsynced, renamed over its final
  name with os.replace and the folder fsynced.
- `ckpt-<step>/` (FSDP): a folder of torch.distributed.checkpoint shards, written by every rank (each
  its own part of the weights and optimizer state; loadable on any world size), plus `state.pt`, the
  run's small state, from rank 0. All of it goes into a hidden `.ckpt-<step>.tmp/` first, and rank 0
  renames that folder into place once every shard and the state are fsynced.

Either way a kill at any moment leaves the complete new checkpoint or none, never a truncated one. A save that
fails because its folder's file system is full or read-only says so (DiskError: the folder, the space left, what
the checkpoint takes), whatever words torch's writer used (`unexpected pos 1664 vs 1568`), and leaves nothing.

- `ckpt-<step>.jit.pt` (DDP): a just-in-time checkpoint, the same file as the first layout, written when a peer
  was lost mid-step by the first surviving rank to claim it (a hidden `.ckpt-<step>.jit-claim` made with
  O_EXCL): every DDP rank holds the whole state of the last step it finished, so the next attempt redoes none.
What a checkpoint holds is a `Checkpoint`; the files keep it as a plain dict (they are read with
weights_only, which unpickles no classes), under the same keys as before that class existed, so older
checkpoints still resume.

Test hook: with HARNESS_PAYLOAD_STALL_SAVE=<name> (`ckpt-00000012.pt` or `ckpt-00000012`) in the env,
writing that checkpoint stops halfway (half the file written; every shard written but not the state)
and waits to be killed (the payload tests kill a run mid-write).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from harness.payload import PayloadError
from harness.payload.metrics import EpochRecord
from harness.payload.progress import Config, Progress

PREFIX = "ckpt-"
SUFFIX = ".pt"
JUST_IN_TIME = ".jit"  # before SUFFIX: the checkpoint a surviving rank wrote when a peer was lost
STALL_ENV = "HARNESS_PAYLOAD_STALL_SAVE"
SHARDED_STATE = "state.pt"  # a sharded checkpoint's own small state, beside the shards
SHARDS_METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards, written last
LOW_SPACE = 1 << 20  # free bytes below which a sharded save's failure is the disk's (its size is not known here)


class DiskError(OSError):
    """A checkpoint that could not be saved because its folder's file system is full or read-only."""


@dataclass(frozen=True)
class Rng:
    """The global generators' states: a resumed run draws what the unbroken one would have."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> Rng:
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state() if device.type == "cuda" else None)

    def restore(self, device: torch.device) -> None:
        """The states may have been loaded onto the device; the setters take CPU tensors."""
        torch.set_rng_state(self.cpu.cpu())
        if device.type == "cuda" and self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda.cpu())


@dataclass(frozen=True)
class Checkpoint:
    """Everything a run resumes from. A file checkpoint holds the whole model and optimizer state; a
    sharded one leaves them None here, as its shards hold them (payload/strategy.py reads those)."""

    progress: Progress
    scheduler: dict[str, Any]
    rng: Rng
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None

    def encode(self) -> dict[str, Any]:
        """The plain dict the files hold: the progress's fields at the top, beside the other states."""
        weights = {} if self.model is None else {"model": self.model, "optimizer": self.optimizer}
        return {**weights, "scheduler": self.scheduler, "rng": {"cpu": self.rng.cpu, "cuda": self.rng.cuda},
                **asdict(self.progress)}

    @classmethod
    def decode(cls, state: object, sharded: bool) -> Checkpoint:
        """Back from encode's dict; a PayloadError names every field it lacks (not a checkpoint of this
        payload's)."""
        weights = [] if sharded else ["model", "optimizer"]
        top = _entries(state, [*weights, "scheduler", "rng", *_names(Progress)])
        progress = {name: top[name] for name in _names(Progress)}
        progress["config"] = Config(**_entries(top["config"], _names(Config), "config."))
        progress["history"] = [EpochRecord(**_entries(record, _names(EpochRecord), "history."))
                               for record in top["history"]]
        rng = Rng(**_entries(top["rng"], _names(Rng), "rng."))
        return cls(Progress(**progress), top["scheduler"], rng, top.get("model"), top.get("optimizer"))


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _entries(state: object, names: list[str], where: str = "") -> dict[str, Any]:
    """The named entries of a dict read from a checkpoint; a PayloadError names each one it lacks."""
    found = state if isinstance(state, dict) else {}
    missing = [where + name for name in names if name not in found]
    if missing:
        raise PayloadError(f"missing {', '.join(missing)}")
    return {name: found[name] for name in names}


def path_for(ckpt_dir: Path, global_step: int, sharded: bool = False, just_in_time: bool = False) -> Path:
    name = f"{PREFIX}{global_step:08d}"
    return Path(ckpt_dir) / (name if sharded else name + (JUST_IN_TIME if just_in_time else "") + SUFFIX)


def is_sharded(path: Path) -> bool:
    return not path.name.endswith(SUFFIX)


def save(saved: Checkpoint, ckpt_dir: Path, global_step: int, keep: int) -> Path:
    """Write the checkpoint for global_step atomically, then drop all but the newest `keep`."""
    path = path_for(ckpt_dir, global_step)
    data = serialize(saved.encode())
    with disk_named(ckpt_dir, global_step, len(data)):
        atomic_write(path, data)
    prune(ckpt_dir, keep)
    return path


@contextlib.contextmanager
def disk_named(ckpt_dir: Path, global_step: int, needed: int | None = None) -> Iterator[None]:
    """A save's failure as DiskError where ckpt_dir's file system is the cause (_disk_trouble)."""
    try:
        yield
    except Exception as exc:
        trouble = _disk_trouble(ckpt_dir, exc, needed)
        if trouble is None:
            raise
        code, why = trouble
        raise DiskError(code, f"checkpoint: cannot save step {global_step} in {ckpt_dir}: {why}") from exc


def _disk_trouble(ckpt_dir: Path, exc: BaseException, needed: int | None) -> tuple[int, str] | None:
    """(errno, words) where ckpt_dir's file system is read-only, or full: an errno that says so anywhere in the
    failure's chain, or less free than the checkpoint takes (needed bytes; LOW_SPACE where not known)."""
    try:
        disk = os.statvfs(ckpt_dir)
    except OSError:
        return None
    said = _errnos(exc)
    free = disk.f_bavail * disk.f_frsize
    space = f"{_size(free)} free of {_size(disk.f_blocks * disk.f_frsize)}"
    if disk.f_flag & os.ST_RDONLY or errno.EROFS in said:
        return errno.EROFS, f"its file system is read-only ({space})"
    if said & {errno.ENOSPC, errno.EDQUOT} or free < (needed or LOW_SPACE):
        return errno.ENOSPC, f"its file system is full ({space}" + (f"; the checkpoint takes {_size(needed)})"
                                                                    if needed else ")")
    return None


def _errnos(exc: BaseException) -> set[int | None]:
    """The errno of exc and of every exception it came from (torch wraps the OSError of a sharded write)."""
    said: set[int | None] = set()
    seen: BaseException | None = exc
    for _ in range(16):  # a chain that loops back on itself ends too
        if seen is None:
            break
        said.add(getattr(seen, "errno", None))
        seen = seen.__cause__ or seen.__context__
    return said


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


def save_just_in_time(saved: Checkpoint, ckpt_dir: Path, global_step: int) -> Path | None:
    """The checkpoint of a rank that outlived a peer, for global_step: written by the first rank to claim it, and
    only where no checkpoint of that step exists; None when another rank claimed it or one exists. Not pruned
    here (the next attempt's saves prune)."""
    path = path_for(ckpt_dir, global_step, just_in_time=True)
    if path.exists() or path_for(ckpt_dir, global_step).exists():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path.parent / f".{PREFIX}{global_step:08d}{JUST_IN_TIME}-claim",
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return None
    data = serialize(saved.encode())
    with disk_named(ckpt_dir, global_step, len(data)):
        atomic_write(path, data)
    return path


def save_sharded(
    shards: dict[str, Any], saved: Checkpoint, ckpt_dir: Path, global_step: int, keep: int, *, is_main: bool,
    barrier: Callable[[], None],
) -> Path:
    """Collective: every rank writes its shards of `shards` (DTensor state dicts), rank 0 the rest of
    `saved`, and rank 0 renames the finished folder into place; then all but the newest `keep` are dropped."""
    from torch.distributed.checkpoint.state_dict_saver import save as save_shards

    final = path_for(ckpt_dir, global_step, sharded=True)
    tmp = final.with_name(f".{final.name}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # Returns on every rank once the coordinator has written the metadata, after every rank's shards
    # (each written file fsynced).
    with disk_named(ckpt_dir, global_step):
        save_shards(shards, checkpoint_id=tmp)
    if is_main:
        if os.environ.get(STALL_ENV) == final.name:
            _stall(str(tmp))
        data = serialize(saved.encode())
        with disk_named(ckpt_dir, global_step, len(data)):
            atomic_write(tmp / SHARDED_STATE, data)
        if final.exists():  # the same step saved again: a run started over in the same folder
            aside = final.with_name(f".{final.name}.old")
            os.replace(final, aside)
            shutil.rmtree(aside)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        prune(ckpt_dir, keep)
    barrier()
    return final


def prune(ckpt_dir: Path, keep: int) -> None:
    for old in newest_first(ckpt_dir)[keep:]:
        if is_sharded(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def serialize(obj: object) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if os.environ.get(STALL_ENV) == path.name:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                _stall(f.name)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind to fill the disk further
        raise
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stall(what: str) -> None:
    print(f"stalling in the middle of writing {what}", file=sys.stderr, flush=True)
    time.sleep(3600)


def newest_first(ckpt_dir: Path) -> list[Path]:
    """Finished checkpoints of either layout (never what an interrupted write left), newest first."""
    found = []
    for path in Path(ckpt_dir).glob(f"{PREFIX}*"):
        digits = path.name[len(PREFIX) :].removesuffix(SUFFIX).removesuffix(JUST_IN_TIME)
        if digits.isdigit() and (path.is_dir() == is_sharded(path)):
            found.append((int(digits), path))
    return [path for _, path in sorted(found, reverse=True)]


def remove_partial_writes(ckpt_dir: Path) -> None:
    """What writers that were killed left (hidden temporary files and folders); only call while no
    writer runs."""
    for tmp in Path(ckpt_dir).glob(f".{PREFIX}*"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def load(path: Path, device: torch.device) -> Checkpoint:
    """Tensors land on this rank's device; weights_only refuses arbitrary pickled code. A sharded
    checkpoint's state only: its shards are loaded into the sharded model (payload/strategy.py)."""
    sharded = is_sharded(path)
    if sharded and not (path / SHARDS_METADATA).is_file():
        raise ValueError(f"no {SHARDS_METADATA}: its shards are incomplete")
    state = torch.load(path / SHARDED_STATE if sharded else path, map_location=device, weights_only=True)
    return Checkpoint.decode(state, sharded)


def load_newest(
    ckpt_dir: Path, device: torch.device, warn: Callable[[str], None]
) -> tuple[Path, Checkpoint] | None:
    """The newest checkpoint that loads; each one that does not is reported through warn and skipped."""
    for path in newest_first(ckpt_dir):
        try:
            return path, load(path, device)
        except Exception as e:  # noqa: BLE001 - whatever makes a checkpoint unloadable, resume skips it
            reason = (str(e).splitlines() or [""])[0]
            warn(f"resume: skipping unreadable checkpoint {path} ({type(e).__name__}: {reason})")
    return None
