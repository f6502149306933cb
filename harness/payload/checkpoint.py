"""Checkpoint files: atomic writes, the newest readable one on resume, and pruning.

A checkpoint is serialised in memory, written to a hidden temporary file in the same folder,
flushed and fsynced, renamed over its final name with os.replace and the folder fsynced; so a kill
at any moment leaves either the complete new file or none, never a truncated `ckpt-*.pt`.

Test hook: with HARNESS_PAYLOAD_STALL_SAVE=<file name> in the env, writing that checkpoint stops
halfway through its temporary file and waits to be killed (tests/unit/payload kill a run mid-write).
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

PREFIX = "ckpt-"
SUFFIX = ".pt"
STALL_ENV = "HARNESS_PAYLOAD_STALL_SAVE"
REQUIRED = ("model", "optimizer", "scheduler", "epoch", "step", "global_step", "config")


def path_for(ckpt_dir: Path, global_step: int) -> Path:
    return Path(ckpt_dir) / f"{PREFIX}{global_step:08d}{SUFFIX}"


def save(state: dict[str, Any], ckpt_dir: Path, global_step: int, keep: int) -> Path:
    """Write the checkpoint for global_step atomically, then drop all but the newest `keep`."""
    path = path_for(ckpt_dir, global_step)
    atomic_write(path, serialize(state))
    for old in newest_first(ckpt_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def serialize(obj: object) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer()


def atomic_write(path: Path, data: bytes | memoryview) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        if os.environ.get(STALL_ENV) == path.name:
            _stall(f, data)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _stall(f: io.BufferedWriter, data: bytes | memoryview) -> None:
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    print(f"stalling in the middle of writing {f.name}", file=sys.stderr, flush=True)
    time.sleep(3600)


def newest_first(ckpt_dir: Path) -> list[Path]:
    """Finished checkpoints (never the temporary files of interrupted writes), newest first."""
    found = []
    for path in Path(ckpt_dir).glob(f"{PREFIX}*{SUFFIX}"):
        digits = path.name[len(PREFIX) : -len(SUFFIX)]
        if digits.isdigit():
            found.append((int(digits), path))
    return [path for _, path in sorted(found, reverse=True)]


def remove_partial_writes(ckpt_dir: Path) -> None:
    """Temporary files left by a writer that was killed; only call while no writer runs."""
    for tmp in Path(ckpt_dir).glob(f".{PREFIX}*{SUFFIX}.tmp-*"):
        tmp.unlink(missing_ok=True)


def load(path: Path, device: torch.device) -> dict[str, Any]:
    """Tensors land on this rank's device; weights_only refuses arbitrary pickled code."""
    state = torch.load(path, map_location=device, weights_only=True)
    missing = [key for key in REQUIRED if not isinstance(state, dict) or key not in state]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    return state


def load_newest(
    ckpt_dir: Path, device: torch.device, warn: Callable[[str], None]
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads; each one that does not is reported through warn and skipped."""
    for path in newest_first(ckpt_dir):
        try:
            return path, load(path, device)
        except Exception as e:  # noqa: BLE001 - whatever makes a checkpoint unloadable, resume skips it
            reason = (str(e).splitlines() or [""])[0]
            warn(f"resume: skipping unreadable checkpoint {path} ({type(e).__name__}: {reason})")
    return None
