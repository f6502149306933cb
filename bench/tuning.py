"""Benchmark 1b: the payload's fast path over batch sizes and torch.compile modes, on one GPU.

What the fastest CIFAR trainers tune, tried side by side in one process: the per-rank batch (a
larger one with the learning rate scaled is the same recipe) and the compile mode (none, default,
reduce-overhead: CUDA graphs; the max-autotune modes, searched kernels, where the settings name
them). Each row is the payload's real training loop in bf16: its steady img/s, MFU, peak GPU
memory, the seconds the whole run took (compilation included, so a mode's start-up cost is seen
beside its speed), and the frames dynamo compiled (1: no recompiles, static shapes hold). The
`--gpu` profile alone runs it, and only on a CUDA machine.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch._dynamo.utils import counters

from bench import throughput


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cuda")
    flops = throughput.flops_per_image(cfg["model"])
    peak = throughput.device_peak(device)
    rows: list[dict[str, Any]] = []
    for batch, mode in cfg["runs"]:
        torch._dynamo.reset()
        counters.clear()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        argv = throughput.payload_argv(cfg | {"batch_size": batch}, "bf16", None if mode == "off" else mode)
        row: dict[str, Any] = {"batch_size": batch, "compile": mode}
        try:
            rate = throughput.payload_rate(argv)
        except Exception as exc:  # noqa: BLE001 - one mode failing is a finding; the others still run
            last = str(exc).strip().splitlines()[-1:] or [""]
            rows.append(row | {"error": f"{type(exc).__name__}: {last[0][:300]}"})
            continue
        rows.append(row | {
            "images_per_s": round(rate, 1), "mfu": throughput.mfu(rate, flops, peak),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "run_s": round(time.perf_counter() - started, 1),
            "compiled_frames": counters["frames"]["total"] if mode != "off" else None,
        })
    return {"device": torch.cuda.get_device_name(device), "model": cfg["model"], "precision": "bf16",
            "flops_per_image": flops, "peak": peak, "steps_timed": cfg["log_every"] * cfg["intervals"],
            "warmup_steps": cfg["log_every"], "rows": rows}
