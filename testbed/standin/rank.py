"""The stand-in ranks' script (run by the stand-in torchrun, or any launcher that sets torchrun's environment):
a training loop's shape without its cost. Each step computes for --busy-ms, sleeps the rest of --step-seconds
(its data loading), then all-reduces; the progress line (`epoch 1/1 step N/STEPS loss L`, the same on every rank)
every --log-every steps, by every rank or rank 0 only (--print). --warning: every rank prints the same warning
first, as a library's deprecation notice does. --hang-rank R --hang-step S: rank R sleeps forever in its data
loading at step S, so that its peers wait in that step's all_reduce."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch.distributed as dist


def fetch_batch(step: int, hang: bool, seconds: float) -> None:
    """The data loading: where a hung rank stays."""
    while hang:
        time.sleep(3600)
    time.sleep(seconds)


def compute(milliseconds: float) -> float:
    end = time.thread_time() + milliseconds / 1000
    total = 0.0
    while time.thread_time() < end:
        total += sum(range(1000))
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--busy-ms", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=1)
    parser.add_argument("--print", choices=("all", "first"), default="all")
    parser.add_argument("--warning", action="store_true")
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-step", type=int, default=-1)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    speaks = args.print == "all" or rank == 0
    if args.warning:
        print("UserWarning: this stand-in rank's library is deprecated and prints it on every rank",
              file=sys.stderr, flush=True)
    dist.init_process_group("gloo")
    for step in range(1, args.steps + 1):
        fetch_batch(step, rank == args.hang_rank and step == args.hang_step,
                    max(0.0, args.step_seconds - args.busy_ms / 1000))
        compute(args.busy_ms)
        dist.all_reduce(1.0)  # type: ignore[call-overload]  # the stand-in all-reduces a number
        if speaks and step % args.log_every == 0:
            print(f"epoch 1/1 step {step}/{args.steps} loss {1 / step:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
