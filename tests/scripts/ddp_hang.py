"""A gloo job with the faults that hang real jobs, chosen by env: FAULT (sleep: FAULT_RANK sleeps in
its data loading at step FAULT_STEP; skip: FAULT_RANK skips an all_reduce and goes on to the final barrier; silent:
every rank computes for SILENT_SECONDS without printing or a collective, then ends), STEPS."""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
fault, fault_rank, fault_step = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_RANK", "1")), \
    int(os.environ.get("FAULT_STEP", "20"))
steps = int(os.environ.get("STEPS", "100000"))


def load_batch(step: int) -> torch.Tensor:
    if fault == "sleep" and rank == fault_rank and step == fault_step:
        time.sleep(3600)
    return torch.ones(1000) * step


def train_step(step: int) -> None:
    batch = load_batch(step)
    if fault == "skip" and rank == fault_rank and step == fault_step:
        return
    dist.all_reduce(batch)


if fault == "silent":
    end = time.monotonic() + float(os.environ["SILENT_SECONDS"])
    x = torch.randn(200, 200)
    while time.monotonic() < end:
        x = torch.tanh(x @ x)
    print(f"rank {rank} computed silently", flush=True)
else:
    for step in range(steps):
        train_step(step)
        if fault == "skip" and rank == fault_rank and step == fault_step:
            print(f"rank {rank} skipped an all_reduce and ends", flush=True)
            break
        if step % 10 == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.05)
dist.barrier()  # as many scripts end: with a skipped all_reduce, the ranks wait in different collectives
dist.destroy_process_group()
