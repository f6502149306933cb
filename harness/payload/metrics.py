"""Per-epoch records: metrics.jsonl (one JSON object per epoch) and metrics.png (loss and accuracy).

Both files are rewritten whole from the history that checkpoints carry, so a resumed run's files
read as if it had never stopped.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

JSONL = "metrics.jsonl"
PLOT = "metrics.png"


@dataclass(frozen=True)
class EpochRecord:
    """One ended epoch (finished, or stopped by --max-steps), as a line of metrics.jsonl has it."""

    epoch: int  # from 1
    steps: int
    loss: float  # the mean over its steps of each step's loss (the mean over the global batch)
    accuracy: float
    images_per_s: float
    seconds: float
    world_size: int
    global_step: int


def write(out_dir: Path, history: list[EpochRecord]) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{JSONL}.tmp"
    tmp.write_text("".join(json.dumps(asdict(record)) + "\n" for record in history))
    os.replace(tmp, out_dir / JSONL)
    plot(history, out_dir / PLOT)


def plot(history: list[EpochRecord], path: Path) -> None:
    import matplotlib  # imported here: only rank 0 plots, and matplotlib is slow to import

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [record.epoch for record in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, [record.loss for record in history], marker="o")
    left.set(xlabel="epoch", ylabel="train loss", title="loss")
    right.plot(epochs, [record.accuracy for record in history], marker="o", color="tab:green")
    right.set(xlabel="epoch", ylabel="test accuracy", title="accuracy", ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
