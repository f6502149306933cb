"""What the ranks report step by step while they train: rank 0's progress (a line per --log-every
steps, or a tqdm bar on a terminal) and, with --losses, every step's loss in a file. The per-epoch
records are metrics.py's.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from harness.payload import runtime
from harness.payload.runtime import Runtime


class StepReport:
    """Rank 0's progress through an epoch. The loss is summed on the device and read once per line, so
    that the steps between lines never wait for the device (the payload tests count the host syncs)."""

    def __init__(self, rt: Runtime, log: Callable[[str], None], log_every: int, global_batch: int,
                 scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.rt, self.log, self.log_every, self.global_batch = rt, log, log_every, global_batch
        self.scheduler = scheduler
        self.loss = torch.zeros((), device=rt.device)
        self.bar: Any = None
        self.label, self.total, self.ends = "", 0, ""
        self.since, self.logged_at = 0.0, 0  # when, and after which global step, the interval began

    def begin(self, label: str, total: int, step: int, global_step: int, run_total: int | None = None) -> None:
        """An epoch of `total` steps, taken up after `step` of them; run_total: the run's steps, where --max-steps
        ends it before its epochs do (each line says so, for the harness's time left)."""
        self.bar = _progress_bar(self.rt, total, step, label)
        self.label, self.total = label, total
        self.ends = f" ({run_total} in all)" if run_total is not None else ""
        self.since, self.logged_at = time.perf_counter(), global_step
        self.loss.zero_()

    def step(self, loss: torch.Tensor, step: int, global_step: int) -> None:
        """After each optimizer step, with this rank's loss; a line (or the bar's text) per interval."""
        if not self.rt.is_main:
            return
        self.loss += loss
        if self.bar is not None:
            self.bar.update()
        if global_step % self.log_every:
            return
        now, steps = time.perf_counter(), global_step - self.logged_at
        shown = (
            f"loss {self.loss.item() / steps:.4f} lr {self.scheduler.get_last_lr()[0]:.4f} "
            f"img/s {steps * self.global_batch / (now - self.since):.0f}"
        )
        self.loss.zero_()
        self.since, self.logged_at = now, global_step
        if self.bar is not None:
            self.bar.set_postfix_str(shown)
        else:
            self.log(f"{self.label} step {step}/{self.total}{self.ends} {shown}")

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _progress_bar(rt: Runtime, total: int, initial: int, desc: str) -> Any:
    """tqdm on a terminal; otherwise None, and progress goes out as one line per log interval."""
    if not (rt.is_main and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


class LossFile:
    """--losses: every step's loss (the mean over the global batch) appended as a JSON line, so that a
    resumed run's lines follow the killed run's. All ranks take part (an all-reduce and a host sync per
    step); rank 0 writes."""

    def __init__(self, rt: Runtime, path: Path) -> None:
        self.rt = rt
        self.file = None
        if rt.is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run; closed when the process ends

    def add(self, global_step: int, loss: torch.Tensor) -> None:
        mean_loss = runtime.all_reduce_sum(self.rt, loss.clone()).item() / self.rt.world_size
        if self.file is not None:
            self.file.write(json.dumps({"global_step": global_step, "loss": mean_loss}) + "\n")
