"""A gloo DDP-style job that hangs the way real jobs do (benchmark 9), chosen by env.

Every step each rank computes for COMPUTE s of its CPU time (matmuls on a batch "loaded" in load_batch),
all-reduces the result and sleeps STEP_SLEEP s (a job that is well uses its CPU, as training does);
rank 0 prints `step S` every step. FAULT picks what goes wrong at step FAULT_STEP
on rank FAULT_RANK, which first writes the wall-clock time to FAULT_FILE:
  sleep  the rank is stuck in time.sleep inside its step (load_batch), its peers wait in all_reduce;
  skip   the rank skips that step's all_reduce and ends its loop: it waits in the script's final barrier
         while its peers wait in that all_reduce (the hang form; gloo pairs neither);
  stop   nothing here: the benchmark SIGSTOPs the rank's process from outside (and writes the time).
PG_TIMEOUT (seconds) sets init_process_group's timeout, for plain torchrun's row (default: torch's,
30 minutes for gloo). Run it under torchrun or `harness launch`.
"""

import datetime
import os
import time

import torch
import torch.distributed as dist

FAULT = os.environ.get("FAULT", "")
FAULT_RANK = int(os.environ.get("FAULT_RANK", "1"))
FAULT_STEP = int(os.environ.get("FAULT_STEP", "20"))
STEPS = int(os.environ.get("STEPS", "100000"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.03"))
COMPUTE = float(os.environ.get("COMPUTE", "0.02"))


def mark() -> None:
    with open(os.environ["FAULT_FILE"], "w") as f:
        f.write(repr(time.time()))


def load_batch(rank: int, step: int) -> torch.Tensor:
    if FAULT == "sleep" and rank == FAULT_RANK and step == FAULT_STEP:
        mark()
        time.sleep(3600)
    return torch.randn(128, 128)


def train_step(rank: int, step: int, weights: torch.Tensor) -> bool:
    """One step; False when this rank skipped its all_reduce and ends."""
    batch, began = load_batch(rank, step), time.thread_time()
    grad = batch @ weights
    while time.thread_time() - began < COMPUTE:
        grad = torch.tanh(batch @ grad)
    if FAULT == "skip" and rank == FAULT_RANK and step == FAULT_STEP:
        mark()
        return False
    dist.all_reduce(grad)
    weights -= 1e-4 * grad
    return True


def main() -> None:
    timeout = os.environ.get("PG_TIMEOUT")
    if timeout:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(timeout)))
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    weights = torch.eye(128)
    for step in range(STEPS):
        if not train_step(rank, step, weights):
            print(f"rank {rank} skipped the all_reduce of step {step} and ends", flush=True)
            break
        if rank == 0:
            print(f"step {step}", flush=True)
        time.sleep(STEP_SLEEP)
    dist.barrier()  # as many scripts end: after a skipped all_reduce the ranks wait in different collectives
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
