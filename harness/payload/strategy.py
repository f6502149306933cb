"""How the ranks hold the model: `ddp` keeps a full replica on every rank and all-reduces gradients;
`fsdp` (FSDP2, ZeRO-3) shards parameters, gradients and optimizer state across the ranks, one unit per
residual block plus the whole model, gathering a unit's parameters only while it computes. Both step
with the same gradient, the mean over the global batch, so their losses agree step by step.

Each also owns its checkpoint layout (payload/checkpoint.py): DDP's one file from rank 0, FSDP's
shards written by every rank through torch.distributed.checkpoint, which loads them on any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.payload import PayloadError, checkpoint, runtime
from harness.payload import model as models
from harness.payload.runtime import Runtime

STRATEGIES = ("ddp", "fsdp")


class Replicated:
    """DDP across ranks (a plain module in a single process); checkpoints: one file from rank 0."""

    name = "ddp"
    sharded = False

    def __init__(self, model: nn.Module, rt: Runtime) -> None:
        self.model, self.rt = model.to(memory_format=torch.channels_last), rt  # the convolutions' fast layout

    def wrap(self, net: Callable[..., Any]) -> Callable[..., Any]:
        if not self.rt.distributed:
            return net
        cuda = self.rt.device.type == "cuda"
        return DDP(net, device_ids=[self.rt.local_rank] if cuda else None, gradient_as_bucket_view=True)

    def accumulating(self, net: Callable[..., Any], last: bool) -> AbstractContextManager[Any]:
        """Gradients are averaged across ranks only on a step's last micro-batch."""
        return net.no_sync() if isinstance(net, DDP) and not last else nullcontext()

    def save(self, optimizer: torch.optim.Optimizer, saved: checkpoint.Checkpoint, ckpt_dir: Path,
             global_step: int, keep: int) -> None:
        if self.rt.is_main:
            whole = replace(saved, model=self.model.state_dict(), optimizer=optimizer.state_dict())
            checkpoint.save(whole, ckpt_dir, global_step, keep)
        runtime.barrier(self.rt)

    def load(self, path: Path, saved: checkpoint.Checkpoint, optimizer: torch.optim.Optimizer) -> None:
        assert saved.model is not None and saved.optimizer is not None, "checkpoint.load checks a file's weights"
        self.model.load_state_dict(saved.model)
        optimizer.load_state_dict(saved.optimizer)

    def full_state(self) -> dict[str, Any] | None:
        """The whole model's state on rank 0 (None elsewhere)."""
        return self.model.state_dict() if self.rt.is_main else None


class Sharded:
    """FSDP2 over every rank (fully_shard per unit of models.shard_units, then the root)."""

    name = "fsdp"
    sharded = True

    def __init__(self, model: nn.Module, rt: Runtime) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not rt.distributed:
            raise PayloadError("--strategy fsdp needs a process group: run under torchrun "
                               "(`torchrun --nproc-per-node 1 ...` for one process)")
        self.model, self.rt = model, rt  # contiguous: FSDP cannot shard channels_last weights
        mesh = init_device_mesh(rt.device.type, (rt.world_size,))
        for unit in models.shard_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def wrap(self, net: Callable[..., Any]) -> Callable[..., Any]:
        return net

    def accumulating(self, net: Callable[..., Any], last: bool) -> AbstractContextManager[Any]:
        """Unsharded gradients accumulate locally; the last micro-batch reduce-scatters their sum."""
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return nullcontext()

    def _shards(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, optimizer: torch.optim.Optimizer, saved: checkpoint.Checkpoint, ckpt_dir: Path,
             global_step: int, keep: int) -> None:
        checkpoint.save_sharded(self._shards(optimizer), saved, ckpt_dir, global_step, keep,
                                is_main=self.rt.is_main, barrier=lambda: runtime.barrier(self.rt))

    def load(self, path: Path, saved: checkpoint.Checkpoint, optimizer: torch.optim.Optimizer) -> None:
        """Each rank reads the parts of the shards it holds now, whatever world size wrote them."""
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        shards = self._shards(optimizer)
        load(shards, checkpoint_id=path)
        set_state_dict(self.model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])

    def full_state(self) -> dict[str, Any] | None:
        """Collective: gathered from every rank, on rank 0's CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return full if self.rt.is_main else None


def state_mib(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """What this rank holds of the training state: parameters, gradients and optimizer state (an FSDP
    rank only its shards). The share FSDP divides by the world size, apart from the activations."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(local(t).nbytes for t in tensors) / 2**20


def build(name: str, model: nn.Module, rt: Runtime) -> Replicated | Sharded:
    """Before the optimizer is made: FSDP replaces the parameters with their shards."""
    return Sharded(model, rt) if name == "fsdp" else Replicated(model, rt)
