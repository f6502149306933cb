"""Benchmark 3b: what the harness costs the payload's throughput. The payload at its fast settings
(benchmark 1's fast row: bf16, channels_last, device-resident data; the run's model and batch; no
torch.compile, which each launch would redo) as 1 node x 1 process under `harness launch` (controller,
node agent, health watch, stream and record all running) and under plain `torchrun --nproc-per-node 1`
of the same command, alternating in rounds until the 95% interval of the ratio of their img/s
(harness / torchrun, paired by round) is within +-half_width or the round limit (bench/stats.py).
img/s: rank 0's progress lines after the first interval (warm-up). Both get the same OMP threads,
those `harness launch` gives a lone simulated node (every core). Goal on a GPU: harness / torchrun >=
0.99 (at most 1% of the img/s); on a CPU the harness's processes share the payload's cores.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
from typing import Any

from bench import launch, procs, stats, throughput

HARNESS = "harness launch (1 node x 1 process)"
TORCHRUN = "torchrun (1 process)"
GOAL = 0.99  # harness / torchrun img/s, at least


def _images_per_second(argv: list[str], env: dict[str, str], timeout: float) -> float:
    return procs.steady_images_per_second(procs.run_lines(argv, env, timeout=timeout))


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    args = throughput.payload_argv(cfg, "bf16", cfg["compile"])
    env = procs.clean_env(**launch.share(1))
    rates: dict[str, list[float]] = {HARNESS: [], TORCHRUN: []}
    with tempfile.TemporaryDirectory(prefix="bench-harness-cost-") as tmp:
        harness = [procs.PY, "-m", "harness.cli", "launch", "-m", "harness.payload.train", "--nnodes", "1",
                   "--nproc-per-node", "1", "--runs-dir", f"{tmp}/runs", "--", *args]

        def torchrun() -> list[str]:
            return [*procs.torchrun(nproc=1, port=procs.free_port()), "-m", "harness.payload.train", *args]

        measure = functools.partial(_images_per_second, timeout=cfg.get("timeout", 600))
        ratio = stats.rounded(stats.compare(
            launch.recorded(rates[HARNESS], lambda: measure(harness, procs.clean_env())),
            launch.recorded(rates[TORCHRUN], lambda: measure(torchrun(), env)),
            half_width=cfg["half_width"], max_rounds=cfg["max_rounds"], min_rounds=cfg.get("min_rounds", 3),
            statistic="ratio"), 4)
    print(f"bench: harness_cost, img/s harness launch / torchrun: {stats.describe(ratio)}; {stats.stopped(ratio)}",
          flush=True)
    rows = []
    for name, found in rates.items():
        spread = stats.interval(found)
        rows.append({"name": name, "images_per_s": round(spread.mean, 1), "low": round(spread.low, 1),
                     "high": round(spread.high, 1), "median": round(statistics.median(found), 1),
                     "attempts_images_per_s": [round(r, 1) for r in found]})
    steps = cfg["log_every"] * cfg["intervals"]
    device = cfg["device"]
    if device == "cuda":
        import torch

        device = torch.cuda.get_device_name(0)
    return {"job": f"payload at its fast settings: {cfg['model']}, batch {cfg['batch_size']}, bf16, channels_last, "
                   f"compile {cfg['compile'] or 'off'}, synthetic data, 1 process on {device}; img/s over "
                   f"{steps} steps after {cfg['log_every']} of warm-up",
            "device": device, "rows": rows, "ratio": ratio, "goal_ratio": GOAL}
