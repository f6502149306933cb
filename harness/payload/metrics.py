"""Per-epoch records: metrics.jsonl (one JSON object per epoch) and metrics.png (loss and accuracy).

Both files are rewritten whole from the history that checkpoints carry, so a resumed run's files
read as if it had never stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

JSONL = "metrics.jsonl"
PLOT = "metrics.png"


def write(out_dir: Path, history: list[dict[str, Any]]) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{JSONL}.tmp"
    tmp.write_text("".join(json.dumps(record) + "\n" for record in history))
    os.replace(tmp, out_dir / JSONL)
    plot(history, out_dir / PLOT)


def plot(history: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # imported here: only rank 0 plots, and matplotlib is slow to import

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    epochs = [record["epoch"] for record in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, [record["loss"] for record in history], marker="o")
    left.set(xlabel="epoch", ylabel="train loss", title="loss")
    right.plot(epochs, [record["accuracy"] for record in history], marker="o", color="tab:green")
    right.set(xlabel="epoch", ylabel="test accuracy", title="accuracy", ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
