"""A gloo job whose every step computes (so that a rank making progress plainly uses CPU) and then
all_reduces, for the health-watch tests (tests/integration/test_health_ssh.py). SLEEP_RANK sleeps in
its step at SLEEP_AT_STEP, before that step's all_reduce, as a rank stuck in its data loading would.
Rank 0 prints `step N` every step; STEPS and STEP_SECONDS set the pace."""

import os
import socket
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
steps = int(os.environ.get("STEPS", "100000"))
pause = float(os.environ.get("STEP_SECONDS", "0.05"))
sleep_rank, sleep_at = int(os.environ.get("SLEEP_RANK", "-1")), int(os.environ.get("SLEEP_AT_STEP", "-1"))
torch.set_num_threads(1)


def fetch_batch(step: int) -> torch.Tensor:
    if rank == sleep_rank and step == sleep_at:
        print(f"rank {rank} sleeping in its step {step}", flush=True)
        time.sleep(3600)
    return torch.full((256,), float(step))


def train_step(step: int) -> torch.Tensor:
    batch = fetch_batch(step)
    weights = torch.randn(128, 128, generator=torch.Generator().manual_seed(step))
    for _ in range(20):  # a few milliseconds of real work: progress the watch can see
        weights = torch.tanh(weights @ weights)
    batch += weights.mean()
    dist.all_reduce(batch)
    return batch


print(f"rank {rank}/{world} up on {socket.gethostname()}", flush=True)
for step in range(steps):
    total = train_step(step)
    if rank == 0:
        print(f"step {step} sum {total[0].item():g}", flush=True)
    time.sleep(pause)
dist.destroy_process_group()
