"""Benchmark 2: what DistributedDataParallel costs. The payload, same model and per-rank batch, as
1 process without a process group, 1 rank under torchrun with DDP, and 2 ranks (gloo on CPU, nccl
on GPU). Scaling efficiency = throughput per rank / throughput of the single process.

On a CPU every run gets one thread per rank (OMP_NUM_THREADS=1), so that 1 and 2 ranks have the
same compute per rank and the figure is DDP's cost, not thread contention; on GPUs each rank has a
GPU of its own, so 2 ranks need 2 GPUs.
"""

from __future__ import annotations

from typing import Any

import torch

from bench import procs


def _argv(cfg: dict[str, Any], world: int) -> list[str]:
    steps = cfg["log_every"] * (1 + cfg["intervals"])
    return [
        "-m", "harness.payload.train", "--data", "synthetic", "--subset", str(cfg["batch_size"] * world * steps),
        "--model", cfg["model"], "--batch-size", str(cfg["batch_size"]), "--epochs", "1",
        "--max-steps", str(steps), "--log-every", str(cfg["log_every"]), "--lr", "0.02",
        "--precision", cfg["precision"], "--device", cfg["device"],
    ]


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    cuda = cfg["device"] == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    env = procs.clean_env(HARNESS_BACKEND="auto", **({} if cuda else {"OMP_NUM_THREADS": "1"}))
    configs = [
        ("1 process, no DDP", 1, lambda: [procs.PY, *_argv(cfg, 1)]),
        ("1 rank, DDP", 1, lambda: [*procs.torchrun(nproc=1, port=procs.free_port()), *_argv(cfg, 1)]),
        ("2 ranks, DDP", 2, lambda: [*procs.torchrun(nproc=2, port=procs.free_port()), *_argv(cfg, 2)]),
    ]
    rows: list[dict[str, Any]] = []
    for name, world, argv in configs:
        row: dict[str, Any] = {"name": name, "ranks": world, "attempts": []}
        if cuda and world > gpus:
            rows.append(row | {"skipped": f"needs {world} GPUs, this machine has {gpus}"})
            continue
        for _ in range(cfg["repeats"]):
            lines = procs.run_lines(argv(), env, timeout=cfg.get("timeout", 300))
            row["attempts"].append(round(procs.steady_images_per_second(lines), 1))
        total = max(row["attempts"])
        rows.append(row | {"images_per_s": total, "per_rank": round(total / world, 1)})
    single = rows[0].get("per_rank")
    for row in rows:
        if single and row.get("per_rank"):
            row["efficiency"] = round(row["per_rank"] / single, 3)
    return {
        "device": "cuda" if cuda else "cpu", "backend": "nccl" if cuda else "gloo", "model": cfg["model"],
        "batch_size_per_rank": cfg["batch_size"], "precision": cfg["precision"],
        "threads_per_rank": None if cuda else 1, "steps_timed": cfg["log_every"] * cfg["intervals"],
        "repeats": cfg["repeats"], "rows": rows,
    }
