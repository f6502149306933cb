"""Benchmark 2b: the payload's two strategies, --strategy ddp and --strategy fsdp (FSDP2), side by side:
the same model, global batch, synthetic data and ranks. Per row the steady img/s (rank 0's progress
lines) and, from the payload's done line, the fullest rank's peak memory (peak_memory_mib: CUDA tensors
on a GPU, the process's resident set on CPU) and training state (state_mib: parameters, gradients and
optimizer state, which FSDP shards); for FSDP each as a ratio to DDP's at the same ranks.

FSDP shards parameters, gradients and optimizer state, so its memory per rank falls as ranks grow,
paid for with an all-gather per block. As in benchmark 2, a CPU rank gets one thread
(OMP_NUM_THREADS=1) and a GPU rank a GPU of its own, so a row with more ranks than GPUs is skipped.
The strategies alternate within each repeat, so that a shared machine's load falls on both alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from bench import procs
from harness.payload.strategy import STRATEGIES

DONE = re.compile(r"done: .*peak_memory_mib=(\d+) state_mib=([\d.]+)")


def _argv(cfg: dict[str, Any], strategy: str, world: int) -> list[str]:
    steps = cfg["log_every"] * (1 + cfg["intervals"])
    global_batch = cfg["batch_size"] * world
    return [
        "-m", "harness.payload.train", "--data", "synthetic", "--subset", str(global_batch * steps),
        "--model", cfg["model"], "--batch-size", str(cfg["batch_size"]), "--global-batch", str(global_batch),
        "--strategy", strategy, "--epochs", "1", "--max-steps", str(steps), "--log-every", str(cfg["log_every"]),
        "--lr", "0.02", "--precision", cfg["precision"], "--device", cfg["device"],
    ]


def memory_mib(lines: Sequence[str]) -> tuple[int, float]:
    """The payload's done line's (peak memory, training state), each already the most of any rank."""
    for line in reversed(lines):
        if match := DONE.search(line):
            return int(match.group(1)), float(match.group(2))
    raise RuntimeError("no `done: ... peak_memory_mib=N state_mib=M` line in the payload's output:\n"
                       + "\n".join(lines[-15:]))


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    cuda = cfg["device"] == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    env = procs.clean_env(HARNESS_BACKEND="auto", **({} if cuda else {"OMP_NUM_THREADS": "1"}))
    rows: list[dict[str, Any]] = []
    for world in cfg["ranks"]:
        pair = [{"strategy": name, "ranks": world, "global_batch": cfg["batch_size"] * world,
                 "attempts_images_per_s": [], "attempts_peak_memory_mib": []} for name in STRATEGIES]
        if cuda and world > gpus:
            rows += [row | {"skipped": f"needs {world} GPUs, this machine has {gpus}"} for row in pair]
            continue
        for _ in range(cfg["repeats"]):
            for row in pair:
                argv = [*procs.torchrun(nproc=world, port=procs.free_port()), *_argv(cfg, row["strategy"], world)]
                lines = procs.run_lines(argv, env, timeout=cfg.get("timeout", 300))
                peak, state = memory_mib(lines)
                row["attempts_images_per_s"].append(round(procs.steady_images_per_second(lines), 1))
                row["attempts_peak_memory_mib"].append(peak)
                row["state_mib"] = state  # the same in every attempt: the model's and optimizer's tensors
        for row in pair:
            row |= {"images_per_s": max(row["attempts_images_per_s"]),
                    "peak_memory_mib": max(row["attempts_peak_memory_mib"])}
        ddp = next(row for row in pair if row["strategy"] == "ddp")
        for row in pair:
            if row is not ddp:
                row |= {key + "_vs_ddp": round(row[key] / ddp[key], 3)
                        for key in ("images_per_s", "peak_memory_mib", "state_mib")}
        rows += pair
    return {
        "device": "cuda" if cuda else "cpu", "backend": "nccl" if cuda else "gloo", "model": cfg["model"],
        "batch_size_per_rank": cfg["batch_size"], "precision": cfg["precision"],
        "threads_per_rank": None if cuda else 1, "steps_timed": cfg["log_every"] * cfg["intervals"],
        "repeats": cfg["repeats"], "rows": rows,
    }
