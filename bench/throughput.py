"""Benchmark 1: payload training throughput against the seed recipe, model FLOP utilisation, and
time-to-accuracy on the digits job.

The seed recipe (bench/seed.py) and the payload run in this process, one after the other, on the
same model, batch size and synthetic CIFAR-shaped images; the payload is the real training loop
(`harness.payload.train.main`), its rate read from its own progress lines with the first interval
dropped as warm-up. Each row is the best of `repeats` runs, interleaved, so that a burst of load on a
shared machine hits one attempt, not one row. FLOPs per image come from FlopCounterMode on one
forward+backward; the peak is the GPU's dense bf16 datasheet figure, or on a CPU the fastest dense
kernel (GEMM or 3x3 convolution, fp32 or bf16) measured here, since a VM's CPU peak is not known.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from bench import machine, procs, seed
from harness.payload import model as models
from harness.payload import train as payload_train


def flops_per_image(model_name: str, channels: int = 3, size: int = 32) -> float:
    """Training FLOPs (forward + backward) per image, counted by torch on a CPU batch of 2."""
    net = models.build(model_name, channels, 10)
    x, y = torch.randn(2, channels, size, size), torch.randint(0, 10, (2,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(net(x), y).backward()
    return counter.get_total_flops() / 2


def _rate(work: Callable[[], object], flops: float, repeat: int = 5) -> float:
    work()
    best = 0.0
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        best = max(best, flops / (time.perf_counter() - started))
    return best


def cpu_peak_flops() -> dict[str, float]:
    """Measured dense FLOP/s of this CPU: best of a 2048^2 GEMM and a 3x3 conv (64x256x16x16,
    channels_last), in fp32 and bf16."""
    found = {}
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    conv = torch.nn.Conv2d(256, 256, 3, padding=1, bias=False).to(memory_format=torch.channels_last)
    x = torch.randn(64, 256, 16, 16).contiguous(memory_format=torch.channels_last)
    gemm_flops, conv_flops = 2 * 2048**3, 2 * 64 * 256 * 256 * 9 * 16 * 16
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
                found[str(dtype).removeprefix("torch.")] = max(
                    _rate(lambda: a @ b, gemm_flops), _rate(lambda: conv(x), conv_flops)
                )
    return found


def device_peak(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = machine.gpu_peak_flops(name)
        return {"flops": peak, "source": f"{name} dense bf16 datasheet" if peak else f"{name}: peak unknown"}
    measured = cpu_peak_flops()
    return {"flops": max(measured.values()), "measured": measured,
            "source": "best dense kernel measured on this CPU (GEMM / 3x3 conv, fp32 / bf16); datasheet peak unknown"}


def mfu(images_per_s: float, flops_per_image: float, peak: dict[str, Any]) -> float | None:
    """Model FLOP utilisation against device_peak's figure (None where the peak is unknown)."""
    return round(images_per_s * flops_per_image / peak["flops"], 4) if peak["flops"] else None


def payload_rate(argv: list[str]) -> float:
    """Run the payload's real training loop here (one process, no process group); steady img/s."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):  # not a tty: no tqdm
        code = payload_train.main(argv)
    lines = out.getvalue().splitlines()
    if code != 0:
        raise RuntimeError(f"payload exited {code}: " + "\n".join(lines[-10:]))
    return procs.steady_images_per_second(lines)


def payload_argv(cfg: dict[str, Any], precision: str, compile: str | None) -> list[str]:
    """One epoch of exactly the steps timed plus one warm-up interval; compile: torch.compile's mode."""
    steps = cfg["log_every"] * (1 + cfg["intervals"])
    return [
        "--data", "synthetic", "--subset", str(cfg["batch_size"] * steps), "--model", cfg["model"],
        "--batch-size", str(cfg["batch_size"]), "--epochs", "1", "--max-steps", str(steps),
        "--log-every", str(cfg["log_every"]), "--lr", "0.02", "--precision", precision,
        "--device", cfg["device"], *(["--compile", compile] if compile else []),
    ]


def throughput_rows(cfg: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    warmup, steps = cfg["log_every"], cfg["log_every"] * cfg["intervals"]
    fast = f"bf16 + compile {cfg['compile']}" if cfg["compile"] else "bf16"
    rows: list[dict[str, Any]] = [
        {"name": "seed recipe", "precision": "fp32", "compile": "off", "channels_last": False,
         "input": f"PIL transforms, DataLoader + DistributedSampler, {procs.cpu_count()} workers",
         "run": lambda: seed.images_per_second(cfg["model"], cfg["batch_size"], warmup, steps, device)},
        {"name": "seed input pipeline alone (no model)", "precision": "-", "compile": "off", "channels_last": False,
         "input": f"PIL transforms, DataLoader, {procs.cpu_count()} workers", "no_model": True,
         "run": lambda: seed.images_per_second(cfg["model"], cfg["batch_size"], warmup, 4 * steps, device,
                                               train=False)},
        {"name": "payload, fp32 (the seed's settings)", "precision": "fp32", "compile": "off", "channels_last": True,
         "input": "device-resident uint8, batched on-device augmentation",
         "run": lambda: payload_rate(payload_argv(cfg, "fp32", None))},
        {"name": f"payload, {fast} (fast settings)", "fast": True, "precision": "bf16",
         "compile": cfg["compile"] or "off", "channels_last": True,
         "input": "device-resident uint8, batched on-device augmentation",
         "run": lambda: payload_rate(payload_argv(cfg, "bf16", cfg["compile"]))},
    ]
    for _ in range(cfg["repeats"]):  # interleaved: a burst of load hits one attempt, not one row
        for row in rows:
            row.setdefault("attempts", []).append(round(row["run"](), 1))
    for row in rows:
        del row["run"]
        row["images_per_s"] = max(row["attempts"])
    return rows


def time_to_accuracy(cfg: dict[str, Any], nproc: int, target: float = 0.9) -> dict[str, Any]:
    """The digits job from process start until the first epoch whose test accuracy reaches target."""
    batch = 64 // nproc  # the same global batch, so the same steps, for 1 and 2 ranks
    args = ["-m", "harness.payload.train", "--data", "digits", "--model", "small", "--epochs", str(cfg["epochs"]),
            "--batch-size", str(batch), "--log-every", "100000", "--device", cfg["device"]]
    port = procs.free_port()
    argv = [procs.PY, *args] if nproc == 1 else [*procs.torchrun(nproc=nproc, port=port), *args]
    epoch_line = re.compile(r"epoch (\d+)/\d+: .*test_acc ([0-9.]+)")
    with procs.Proc(argv, procs.clean_env(HARNESS_BACKEND="auto")) as p:
        code = p.wait(timeout=300)
        if code != 0:
            raise RuntimeError(f"digits job exited {code}:\n{p.output[-2000:]}")
        train_start = next(t for t, line in p.lines if "train: data=digits" in line)
        reached = next(((t, int(m.group(1)), float(m.group(2))) for t, line in p.lines
                        if (m := epoch_line.search(line)) and float(m.group(2)) >= target), None)
        done = re.search(r"done: test_acc=([0-9.]+)", p.output)
        assert done is not None and p.ended is not None, p.output[-2000:]
        final = float(done.group(1))
        total = p.ended - p.started
    row = {"ranks": nproc, "global_batch": batch * nproc, "epochs": cfg["epochs"], "target": target,
           "final_test_acc": final, "process_seconds": round(total, 2)}
    if reached is None:
        return row | {"seconds_from_start": None, "training_seconds": None, "epoch": None}
    return row | {"seconds_from_start": round(reached[0] - p.started, 2),
                  "training_seconds": round(reached[0] - train_start, 2), "epoch": reached[1]}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cuda" if cfg["device"] == "cuda" else "cpu")
    flops = flops_per_image(cfg["model"])
    peak = device_peak(device)
    rows = throughput_rows(cfg, device)
    base = rows[0]["images_per_s"]
    for row in rows:
        row["vs_seed"] = round(row["images_per_s"] / base, 2)
        if not row.get("no_model"):
            row["achieved_gflop_s"] = round(row["images_per_s"] * flops / 1e9, 1)
            row["mfu"] = mfu(row["images_per_s"], flops, peak)
    gpus = torch.cuda.device_count() if device.type == "cuda" else None
    accuracy = [time_to_accuracy(cfg["accuracy"], n) if gpus is None or n <= gpus else
                {"ranks": n, "skipped": f"needs {n} GPUs, this machine has {gpus}"}
                for n in cfg["accuracy"]["ranks"]]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next benchmarks' processes need the memory
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": cfg["model"], "batch_size": cfg["batch_size"], "flops_per_image": flops,
        "steps_timed": cfg["log_every"] * cfg["intervals"], "warmup_steps": cfg["log_every"],
        "repeats": cfg["repeats"], "threads": torch.get_num_threads(), "peak": peak,
        "rows": rows, "time_to_accuracy": accuracy,
    }
