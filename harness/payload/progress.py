"""Where a run stands and the settings it was made with: what a checkpoint keeps of the run itself
(payload/checkpoint.py writes it beside the model's, optimizer's, scheduler's and RNG's states and
reads it back), and what --resume continues from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from harness.payload.metrics import EpochRecord


@dataclass(frozen=True)
class Config:
    """The settings that shape the run's math: a checkpoint continues exactly only with the same ones."""

    data: str
    subset: int | None
    model: str
    norm: str
    seed: int
    global_batch: int
    epochs: int
    lr: float
    weight_decay: float
    warmup: float
    augment: bool

    def changes(self, new: Config) -> list[str]:
        """Each setting that differs in `new`, as `name: old -> new`, in field order."""
        return [f"{f.name}: {getattr(self, f.name)!r} -> {getattr(new, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(new, f.name)]


@dataclass
class Progress:
    """The run's position and what it has carried so far. An epoch stopped by a checkpoint or by
    --max-steps carries its loss and seconds, so that the resumed epoch's record reads as if unbroken."""

    config: Config
    world_size: int  # of the ranks making this progress (a resumed run's may differ from its checkpoint's)
    epoch: int = 0  # the epoch under way, from 0
    step: int = 0  # optimizer steps done in that epoch
    global_step: int = 0  # optimizer steps done in all
    loss_carry: float = 0.0  # the epoch's per-step mean losses, summed, up to the last fold
    seconds_carry: float = 0.0  # the epoch's training seconds before its current stretch (a resumed one's)
    history: list[EpochRecord] = field(default_factory=list)  # one record per epoch ended, in order
