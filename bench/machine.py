"""Where and with what a benchmark ran: machine, versions, commit. Every result file carries this."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity), matched against torch's device name in order.
GPU_PEAKS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return 0.0


def memory_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def gpu_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def gpu_peak_flops(name: str) -> float | None:
    """Dense bf16 peak of a known GPU (None when this table does not know it)."""
    return next((peak for key, peak in GPU_PEAKS if key in name), None)


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def describe() -> dict[str, Any]:
    """The machine, date, versions and commit, for the result file and the report."""
    import torch
    import torchvision

    import harness

    status = git("status", "--porcelain", "--untracked-files=no")
    # BENCH_COMMIT: the commit a copied tree was made from (a lent machine's copy may carry a stale .git).
    named = os.environ.get("BENCH_COMMIT")
    load = os.getloadavg()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib(),
        "gpus": gpus(),
        "load_average_at_start": [round(x, 2) for x in load],
        "os": platform.platform(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            "driver": gpu_driver(),
            "harness": harness.__version__,
        },
        "git": {"commit": named or git("rev-parse", "HEAD"),
                "dirty": None if named or status is None else bool(status)},
        "argv": sys.argv,
    }
