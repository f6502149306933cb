"""Per-epoch sample order, sharding, micro-batches and batched augmentation, as tensor ops on the device.

All randomness of epoch e comes from one generator seeded with seed + e: first the permutation (the
exact draw DistributedSampler makes, so shards match it with drop_last=True), then a crop offset and
a flip bit for every sample. Augmentation is therefore a function of (seed, epoch, sample index):
independent of rank, world size and batch composition, and nothing needs saving to resume it.

The global batch G, not the world size, defines an optimizer step: step s takes perm[s*G:(s+1)*G].
Each rank's share G/world is cut into A micro-batches (gradient accumulation) of at most --batch-size,
so there are world*A streams, and stream v takes perm[v::world*A]: the union over streams of step
s's micro-batches is exactly perm[s*G:(s+1)*G], and each micro-batch depends only on world*A. So 2
ranks x B equal 1 process accumulating 2 x B, and a run may resume on any world size dividing G.
With A = 1 the streams are DistributedSampler's shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.payload import PayloadError


@dataclass(frozen=True)
class Split:
    """How one optimizer step's global batch is shared: world_size ranks, each accumulating
    `accumulation` micro-batches of `micro` images."""

    global_batch: int
    world_size: int
    accumulation: int

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    @property
    def micro(self) -> int:
        return self.per_rank // self.accumulation

    @property
    def streams(self) -> int:
        return self.world_size * self.accumulation

    def describe(self) -> str:
        each = f"{self.per_rank} image(s) per rank"
        if self.accumulation > 1:
            each += f" as {self.accumulation} micro-batches of {self.micro}"
        return f"global batch {self.global_batch} = {self.world_size} rank(s) x {each}"


def split(global_batch: int, world_size: int, max_micro: int) -> Split:
    """The fewest micro-batches per rank that keep each at most max_micro images, all of one size."""
    if global_batch % world_size:
        fits = [w for w in range(1, min(global_batch, 64) + 1) if global_batch % w == 0]
        raise PayloadError(
            f"the global batch of {global_batch} images cannot be shared equally by {world_size} ranks; "
            f"run on a world size that divides it ({', '.join(map(str, fits))}{', ...' if global_batch > 64 else ''})"
            f", or start afresh with another --global-batch"
        )
    per_rank = global_batch // world_size
    accumulation = next(a for a in range(1, per_rank + 1) if per_rank % a == 0 and per_rank // a <= max_micro)
    return Split(global_batch, world_size, accumulation)


@dataclass(frozen=True)
class Epoch:
    """One rank's micro-batch streams for an epoch (row a: its a-th micro-batch of every step) and the
    augmentation of every sample."""

    streams: torch.Tensor
    offsets: torch.Tensor
    flips: torch.Tensor

    def batch(self, step: int, batch_size: int, micro: int = 0) -> torch.Tensor:
        return self.streams[micro, step * batch_size : (step + 1) * batch_size]


def epoch_plan(
    n: int, seed: int, epoch: int, rank: int, world_size: int, pad: int, flip: bool, device: torch.device,
    accumulation: int = 1,
) -> Epoch:
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g)
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n,), generator=g, dtype=torch.bool) & flip
    streams = world_size * accumulation
    usable = perm[: n - n % streams]
    mine = torch.stack([usable[v::streams] for v in range(rank * accumulation, (rank + 1) * accumulation)])
    return Epoch(mine.to(device), offsets.to(device), flips.to(device))


def augment(x: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, pad: int) -> torch.Tensor:
    """Random crop after zero padding, then horizontal flip, for a whole batch in two gathers."""
    b, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    rows = offsets[:, 0:1] + torch.arange(h, device=x.device)
    cols = torch.arange(w, device=x.device).expand(b, w)
    cols = torch.where(flips[:, None], w - 1 - cols, cols) + offsets[:, 1:2]
    padded = padded.gather(2, rows[:, None, :, None].expand(b, c, h, w + 2 * pad))
    return padded.gather(3, cols[:, None, None, :].expand(b, c, h, w))


def normalize(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 images to normalised float in channels_last, the convolutions' fast layout on GPU and CPU.

    mean and std are (1, C, 1, 1) in 0..255 units.
    """
    return ((x.float() - mean) / std).contiguous(memory_format=torch.channels_last)
