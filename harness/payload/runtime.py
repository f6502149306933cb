"""Where this process sits in the job: rank, device and process group, all from the torchrun env.

With no torchrun env (no RANK/WORLD_SIZE) the payload runs as a plain single process without a
process group, and every collective here degrades to a no-op.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.payload import PayloadError

BACKENDS = ("auto", "nccl", "gloo")
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def setup(device: str = "auto", local_rank: int | None = None) -> Runtime:
    """Read the torchrun env, pick the device and backend, and join the process group."""
    local_rank = int(os.environ.get("LOCAL_RANK", local_rank or 0))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise PayloadError("--device cuda was asked for but torch sees no CUDA device")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = os.environ.get("HARNESS_BACKEND", "auto")
    if backend not in BACKENDS:
        raise PayloadError(f"HARNESS_BACKEND={backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise PayloadError("HARNESS_BACKEND=nccl needs a CUDA device; use gloo on CPU")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Runtime(0, local_rank, 1, dev, None)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_agent()
    dist.init_process_group(backend=backend, device_id=dev if backend == "nccl" else None)
    return Runtime(int(os.environ["RANK"]), local_rank, int(os.environ["WORLD_SIZE"]), dev, backend)


def _die_with_agent() -> None:
    """torchrun starts workers in sessions of their own, so a SIGKILLed agent would orphan them."""
    agent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent:
        os._exit(1)


def barrier(rt: Runtime) -> None:
    if rt.distributed:
        dist.barrier(device_ids=[rt.local_rank] if rt.backend == "nccl" else None)


def all_reduce_sum(rt: Runtime, tensor: torch.Tensor) -> torch.Tensor:
    if rt.distributed:
        dist.all_reduce(tensor)
    return tensor


def peak_memory_mib(rt: Runtime) -> float:
    """The most memory any rank held at once: on CUDA the tensors' (the caching allocator's peak), on
    CPU the whole process's resident set (interpreter and dataset included)."""
    if rt.device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(rt.device) / 2**20
    else:
        mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    return most_of_any_rank(rt, mine)


def most_of_any_rank(rt: Runtime, mine: float) -> float:
    """The largest of every rank's value (a collective)."""
    peak = torch.tensor(mine, dtype=torch.float64, device=rt.device)
    if rt.distributed:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def any_rank(rt: Runtime, flag: bool) -> bool:
    """True on every rank when it is true on one: a decision all ranks take at the same step."""
    return bool(all_reduce_sum(rt, torch.tensor(int(flag), device=rt.device)).item())


def warning_signal() -> threading.Event:
    """Set on SIGUSR1: the batch system's warning before a time limit or preemption (Slurm's
    --signal). Installed over an inherited "ignore" too: the launcher may ignore it for itself."""
    warned = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: warned.set())
    return warned


def broadcast(rt: Runtime, obj: object) -> object:
    """Rank 0's value of a small picklable object, on every rank."""
    if not rt.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def teardown(rt: Runtime) -> None:
    if rt.distributed:
        dist.destroy_process_group()
