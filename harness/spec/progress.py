"""Which of a rank's lines say a step, and which say a resume: the shapes of the lines training scripts print,
each anchored to the line's start (after a rank prefix, a timestamp or a log level), so that a step named inside
another line -- `checkpoint: step 35 saved`, `RuntimeError: ... at step 10`, `resumed from ... at step 25` -- is
no step taken. health.progress (spec/job.py) may give other patterns; control/live.py reads the lines with them."""

from __future__ import annotations

import re
from collections.abc import Sequence

# Before the words of a line: torchrun's rank prefix, then what log formats put first (a timestamp, brackets,
# `INFO:root:`, `2026-11-28 10:00:01,123 INFO `), none of it a letter but the log level and logger.
_START = r"(?im)^(?:\[rank\d+\]: )?[^A-Za-z\n]*(?:(?:INFO|DEBUG)\b[^A-Za-z\n]*(?:[\w.]+:)?[^A-Za-z\n]*)?"
_NUMBER = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan|inf)"
_LOSS = rf"(?:.*?\bloss[:= ]\s*(?P<loss>{_NUMBER}))?"
# `epoch 2/12 step 12/97` (an epoch without its count is left out: from 0 or from 1?), `step 12/97 (150 in all)`,
# `Step 12`, `step: 12`, `global step 12`, Megatron's `iteration       10/  500000`, then a loss and img/s where the
# line says them (the payload's lines).
_STEP = (r"(?:epoch (?:(?P<epoch>\d+)/(?P<epochs>\d+)|\d+)[,:]? )?(?:global[ _])?(?:step|iter|iteration)[:= ]\s*"
         r"(?P<step>\d+)(?:\s*/\s*(?P<per_epoch>\d+))?(?: \((?P<total>\d+) in all\))?")
STEP_LINE = _START + _STEP + _LOSS + r"(?:.*?\bimg/s (?P<throughput>\d+(?:\.\d*)?))?"
# PyTorch's examples: imagenet's `Epoch: [0][  10/5005]\tTime ... Loss 6.9e+00 (...)` (epochs from 0) and mnist's
# `Train Epoch: 1 [640/60000 (1%)]\tLoss: 0.298` (its count is of samples).
IMAGENET_LINE = _START + r"epoch: \[(?P<epoch0>\d+)\]\[\s*(?P<step>\d+)/(?P<per_epoch>\d+)\]" + _LOSS
MNIST_LINE = _START + r"train epoch: (?P<epoch>\d+) \[(?P<step>\d+)/(?P<per_epoch>\d+) \(\d+%\)\]" + _LOSS
# tqdm's bar: Lightning's `Epoch 0:  45%|████▌     | 45/100 [00:02<00:02, 20.10it/s, v_num=0, train_loss=0.123]`
# (the steps of one epoch, from 0), Hugging Face Trainer's ` 50%|█████     | 30/60 [00:10<00:10,  2.90it/s]` (the
# run's steps).
_BAR = r"\s*\d+%\|[^|\n]*\|\s*(?P<step>\d+)/(?P<{0}>\d+) \[(?:[^]\n]*?loss=(?P<loss>" + _NUMBER + r"))?"
LIGHTNING_LINE = _START + r"epoch (?P<epoch0>\d+):" + _BAR.format("per_epoch")
TQDM_LINE = _START + _BAR.format("total")
DEFAULT_PROGRESS = (STEP_LINE, IMAGENET_LINE, MNIST_LINE, LIGHTNING_LINE, TQDM_LINE)

# A resume: where the attempt's count starts (the payload's `resume: epoch 2/12 step 5/97 ... restored in 0.012 s`,
# `resumed from ckpt at step 25`), no step taken, and how long the restore took where it says.
RESUME_LINE = _START + r"(?:resum|restor)\w*\b.*?\b" + _STEP + r"(?:.*?\bin (?P<seconds>\d+(?:\.\d+)?) ?s\b)?"
RESUME_WORDS = ("resum", "restor")  # one of which each line RESUME_LINE finds has


class LinePatterns:
    """Several patterns read as one: a line's match is the first pattern's that finds one. resume: the pattern of
    the lines that say where an attempt resumed (None: none known)."""

    def __init__(self, patterns: Sequence[str], resume: str | None = None) -> None:
        self.patterns = tuple(re.compile(pattern) for pattern in patterns)
        self.resume = re.compile(resume) if resume is not None else None

    def search(self, text: str) -> re.Match[str] | None:
        for pattern in self.patterns:
            if found := pattern.search(text):
                return found
        return None

    def find_resume(self, text: str) -> re.Match[str] | None:
        """The first resume line's match in text (None: none, or no resume pattern). Text without a word every
        resume line has is not searched: the pattern's search tries every position of all a chatty job prints."""
        if self.resume is None:
            return None
        lowered = text.lower()
        return self.resume.search(text) if any(word in lowered for word in RESUME_WORDS) else None


def global_step(found: re.Match[str]) -> int:
    """The step a progress line names, counted from the run's start: `epoch 2/12 step 248/312` is step 560
    (the pattern's groups epoch, from 1, or epoch0, from 0, and per_epoch), `step 560` is 560."""
    groups = found.groupdict()
    step = int(groups["step"])
    epoch = int(groups["epoch"]) if groups.get("epoch") else int(groups["epoch0"]) + 1 if groups.get("epoch0") else None
    if epoch is not None and groups.get("per_epoch"):
        return (epoch - 1) * int(groups["per_epoch"]) + step
    return step


def step_total(found: re.Match[str]) -> int | None:
    """The run's steps, where a progress line says: a group named total, or the steps of one epoch times the
    epochs (`epoch 2/12 step 248/312`: 3744), or without an epoch the steps after the slash (`step 248/312`)."""
    groups = found.groupdict()
    if groups.get("total"):
        return int(groups["total"])
    if not groups.get("per_epoch") or ((groups.get("epoch") or groups.get("epoch0")) and not groups.get("epochs")):
        return None
    return int(groups["per_epoch"]) * int(groups.get("epochs") or 1)
