"""A gloo job with the faults that hang real jobs, chosen by env: FAULT (sleep: FAULT_RANK sleeps in
its data loading at step FAULT_STEP; spin: the same, while every rank's CPU is kept busy by a thread that
polls, as NCCL's wait in a CUDA synchronization does; loader: the same sleep in the __getitem__ of
FAULT_RANK's DataLoader worker; mismatch: at step FAULT_STEP rank 0 calls all_reduce and the others
broadcast, in the two branches of an if/else (SWAP=1 swaps the branches); skip: FAULT_RANK skips an
all_reduce and goes on to the final barrier; silent:
every rank computes for SILENT_SECONDS without printing or a collective, then ends), STEPS, RUN_SECONDS, and
WORK: matrix products per step (a compute-bound step, as training's is), else a 0.05 s pause; SLOW_RANK
takes SLOW_SECONDS longer to load each batch, asleep (as a rank waits for a slower GPU: its CPU is idle)."""

import os
import threading
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
fault, fault_rank, fault_step = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_RANK", "1")), \
    int(os.environ.get("FAULT_STEP", "20"))
steps = int(os.environ.get("STEPS", "100000"))
work = int(os.environ.get("WORK", "0"))
slower = float(os.environ.get("SLOW_SECONDS", "0")) if rank == int(os.environ.get("SLOW_RANK", "-1")) else 0.0
run_until = time.monotonic() + float(os.environ.get("RUN_SECONDS", "inf"))


def time_is_up() -> bool:
    """Every rank's clock, agreed on by a collective, so that every rank stops on the same step."""
    if run_until == float("inf"):
        return False
    up = torch.tensor([float(time.monotonic() > run_until)])
    dist.all_reduce(up, op=dist.ReduceOp.MAX)
    return bool(up.item())


def poll() -> None:
    """About a tenth of a CPU, forever: the rank never looks idle."""
    while True:
        sum(range(20000))
        time.sleep(0.005)


if fault == "spin":
    threading.Thread(target=poll, daemon=True).start()


def sync_metrics(batch: torch.Tensor) -> None:
    if (rank == 0) != bool(int(os.environ.get("SWAP", "0"))):
        dist.all_reduce(batch)
    else:
        dist.broadcast(batch, src=0)


def load_batch(step: int) -> torch.Tensor:
    if fault in ("sleep", "spin") and rank == fault_rank and step == fault_step:
        time.sleep(3600)
    time.sleep(slower)
    x = torch.ones(100, 100) / 100
    for _ in range(work):
        x = torch.tanh(x @ x)
    return x


class Batches(torch.utils.data.Dataset):
    """load_batch's batches, read by a DataLoader worker (a process of its own)."""

    def __len__(self) -> int:
        return steps

    def __getitem__(self, step: int) -> torch.Tensor:
        if rank == fault_rank and step == fault_step:
            time.sleep(3600)
        return load_batch(step)


loader = iter(torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=1)) if fault == "loader" else None


def train_step(step: int) -> None:
    batch = next(loader) if loader is not None else load_batch(step)
    if fault == "skip" and rank == fault_rank and step == fault_step:
        return
    if fault == "mismatch" and step == fault_step:
        sync_metrics(batch)
    dist.all_reduce(batch)


if fault == "silent":
    end = time.monotonic() + float(os.environ["SILENT_SECONDS"])
    x = torch.randn(200, 200)
    while time.monotonic() < end:
        x = torch.tanh(x @ x)
    print(f"rank {rank} computed silently", flush=True)
else:
    for step in range(steps):
        if time_is_up():
            break
        train_step(step)
        if fault == "skip" and rank == fault_rank and step == fault_step:
            print(f"rank {rank} skipped an all_reduce and ends", flush=True)
            break
        if step % 10 == 0:
            print(f"step {step}", flush=True)
        if not work:
            time.sleep(0.05)
dist.barrier()  # as many scripts end: with a skipped all_reduce, the ranks wait in different collectives
dist.destroy_process_group()
