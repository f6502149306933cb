"""Per-epoch sample order, sharding and batched augmentation, all as tensor ops on the data's device.

All randomness of epoch e comes from one generator seeded with seed + e: first the permutation (the
exact draw DistributedSampler makes, so shards match it with drop_last=True), then a crop offset and
a flip bit for every sample. Augmentation is therefore a function of (seed, epoch, sample index):
independent of rank, world size and batch composition, and nothing needs saving to resume it.
Rank r takes perm[r::world], so the union over ranks of step s's batches is perm[s*G:(s+1)*G] for
global batch G, whatever the world size; that is what makes 2 ranks x B equal 1 process x 2B.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Epoch:
    """One rank's sample indices for an epoch and the augmentation of every sample."""

    indices: torch.Tensor
    offsets: torch.Tensor
    flips: torch.Tensor

    def batch(self, step: int, batch_size: int) -> torch.Tensor:
        return self.indices[step * batch_size : (step + 1) * batch_size]


def epoch_plan(
    n: int, seed: int, epoch: int, rank: int, world_size: int, pad: int, flip: bool, device: torch.device
) -> Epoch:
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g)
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=g)
    flips = torch.randint(0, 2, (n,), generator=g, dtype=torch.bool) & flip
    shard = perm[: n - n % world_size][rank::world_size]
    return Epoch(shard.to(device), offsets.to(device), flips.to(device))


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
