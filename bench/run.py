"""Run the benchmarks side by side and record them: `python -m bench [--quick | --full]`.

Writes bench/results/<UTC time>-<host>-<profile>.json and bench/results/latest-<profile>.json, then
regenerates docs/benchmarks.md from the latest quick and full results. A benchmark that fails is
recorded with its error and the others still run (exit status 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import machine, procs, report

RESULTS = procs.REPO / "bench" / "results"
DOCS = procs.REPO / "docs" / "benchmarks.md"
NAMES = ("throughput", "tuning", "ddp", "strategies", "first_step", "harness_cost", "preflight", "failure", "recovery",
         "attach", "slurm", "containers", "hangs", "watch_cost", "stream", "metrics_cost", "k8s", "scale", "slow")
HEALTH = ("hangs", "watch_cost", "metrics_cost")
# What each profile runs: gpu is the GPU's share alone (no namespaces, daemons or system packages needed);
# health is the health watch's alone (benchmarks 9, 10 and 12: 60 hung launches, ~22 min on 2 cores); quick is
# the smallest meaningful case of the full run's benchmarks that fit in about a minute on 2 cores: no Slurm,
# containers, stream, DDP or older packages side by side; launch is the launch's cost against torchrun by hand:
# benchmark 3, whose interval needs tens of rounds (~12 min on 2 cores) before it can judge its goal, and the stream
# (benchmark 11), so that the three figures of issue 69 come from one commit.
PROFILE_NAMES = {"gpu": ("throughput", "tuning", "ddp", "strategies", "harness_cost"),
                 "full": tuple(n for n in NAMES if n not in ("tuning", "attach", "k8s", "scale") and n not in HEALTH),
                 "quick": ("throughput", "harness_cost", "preflight", "failure", "recovery"),
                 "launch": ("first_step", "stream"),
                 "health": HEALTH,
                 "attach": ("attach",), "k8s": ("k8s",), "scale": ("scale",), "slow": ("slow",)}
HEALTH_FAULTS = 20  # per fault kind, the least


def profile(name: str, device: str, faults: int = HEALTH_FAULTS) -> dict[str, dict[str, Any]]:
    """Every knob of a run. quick: about a minute on a 2-core CPU; full: the real model, repeats; gpu:
    benchmarks 1, 1b, 2, 2b and 3b on the GPU; launch: benchmark 3 as in the full run; health: benchmarks 9
    and 10 (faults: hung launches per kind)."""
    quick = name == "quick"
    cuda = device == "cuda"
    if cuda:  # one H100-class GPU: ResNet-18 at the payload's default batch; compile only in the full runs
        from harness.payload import train as payload_train

        throughput = {"model": "resnet18", "batch_size": payload_train.parse_args([]).batch_size, "log_every": 20,
                      "intervals": 5, "repeats": 1 if quick else 2,
                      "compile": None if quick else "reduce-overhead"}
        ddp = {"model": "resnet18", "batch_size": throughput["batch_size"], "log_every": 20, "intervals": 5,
               "precision": "bf16", "repeats": 1 if quick else 2}
    elif quick:  # ResNet-18 trains at ~80 img/s on 2 cores: the small model, few steps
        throughput = {"model": "small", "batch_size": 128, "log_every": 3, "intervals": 4, "repeats": 1,
                      "compile": None}
        ddp = {"model": "small", "batch_size": 64, "log_every": 3, "intervals": 3, "precision": "fp32", "repeats": 1}
    else:
        throughput = {"model": "resnet18", "batch_size": 32, "log_every": 2, "intervals": 4, "repeats": 2,
                      "compile": "default"}
        ddp = {"model": "resnet18", "batch_size": 32, "log_every": 2, "intervals": 3, "precision": "fp32",
               "repeats": 2}
    throughput |= {"device": device, "accuracy": {"epochs": 8, "ranks": [] if quick else [1, 2], "device": device}}
    # benchmark 3b: the payload's fast row of benchmark 1 under harness launch and torchrun, more steps than
    # benchmark 1 times (the rate of a few steps on a CPU is noise); no compile: each launch would redo it
    fast = {k: throughput[k] for k in ("model", "batch_size", "device")} | {"compile": None}
    if cuda:
        harness_cost = fast | {"log_every": 20, "intervals": 5, "max_rounds": 3 if quick else 8}
    else:
        harness_cost = fast | {"log_every": 6 if quick else 4, "intervals": 4, "max_rounds": 2 if quick else 10,
                               "min_rounds": 2 if quick else 3}
    harness_cost["half_width"] = 0.005  # of the ratio: a 1% goal judged once the interval is this narrow
    return {
        "throughput": throughput,
        # (per-rank batch, compile mode); each compiled run costs about a minute of compilation, and the
        # max-autotune modes' kernel search minutes more per shape, so they are left to a run of their own.
        "tuning": {"model": "resnet18", "log_every": 20, "intervals": 4, "device": device, "runs": [
            [256, "off"], [256, "default"], [256, "reduce-overhead"], [512, "reduce-overhead"],
            [1024, "off"], [1024, "default"], [1024, "reduce-overhead"], [2048, "reduce-overhead"]]},
        "ddp": ddp | {"device": device},
        # benchmark 2's model and per-rank batch; a GPU rank needs a GPU of its own (2 ranks: skipped on one)
        "strategies": ddp | {"device": device, "ranks": [1, 2] if cuda else [2]},
        # (the full and launch runs) rounds of harness launch and torchrun by hand until the 95% interval of their
        # difference is within +-half_width s or max_rounds; the trivial job the same way; two more torchrun
        # variants in the first `repeats` rounds
        "first_step": {"repeats": 3, "others": True, "half_width": 0.1, "max_rounds": 30, "trivial_rounds": 30},
        "harness_cost": harness_cost,
        "preflight": {"hosts": [1, 4] if quick else [1, 4, 16], "repeats": 1 if quick else 2, "baseline": not quick,
                      "modes": ["fast"] if quick else ["full", "fast"]},
        "failure": {"blocks": ["sleep"] if quick else ["sleep", "collective"], "torchrun_wait": 0 if quick else 20,
                    "repeats": 1 if quick else 3},
        "recovery": {"ckpt_every": 10, "kill_at": 40, "repeats": 1 if quick else 3, "before": not quick,
                     "ssh": not quick},
        # benchmark 6b (its own run, --attach): a lost controller taken back by `harness attach`, against a relaunch
        # with supervision.grace 0, on simulated nodes and SSH hosts; a 10 s cut of an SSH host's traffic; 2 epochs so
        # that the job trains on well past the attach
        "attach": {"ckpt_every": 10, "kill_at": 40, "repeats": 3, "grace": 300, "epochs": 2, "ssh": True, "cut_s": 10},
        "slurm": {"repeats": 1 if quick else 3, "wait": 10 if quick else 30},
        "containers": {"repeats": 1 if quick else 3},
        # stall 5 s keeps 60 hung launches short; torchrun alone waits out init_process_group's timeout,
        # set to 30 s here (its default is 30 min for gloo), once per kind.
        "hangs": {"faults": faults, "stall": 5, "steps": [5, 15], "seed": 28, "torchrun_repeats": 1,
                  "torchrun_timeout": 30, "torchrun_wait": 15},
        "watch_cost": {"repeats": 4, "model": "small", "batch_size": 32, "steps": 300, "warmup": 20},
        "stream": {"lines": 1_000_000, "half_width": 0.05, "max_rounds": 10},
        "metrics_cost": {"model": "small", "batch_size": 32, "steps": 3000, "window": 15, "scrapes": 100, "every": 5,
                         "synthetic_repeats": 20},
        "k8s": {"repeats": 3, "kill_at": 40},
        # 256 x 4 stand-in ranks is about 1,300 processes on this machine: a step a second keeps them light
        "scale": {"nodes": [16, 64, 256], "nproc": 4, "fleet_nodes": [16, 256, 2048], "fleet_nproc": 8,
                  "step_seconds": 1.0, "stall": 30, "warmup": 10, "window": 30,
                  "queries": 3, "queries_margin": 20, "start_timeout": 600,
                  "ssh_hosts": 64, "ssh_nproc": 2, "ssh_steps": 40, "ssh_window": 15, "ssh_connect": 30,
                  "arrivals_rates": [1, 10], "arrivals_seconds": 24,
                  "hang_look_seconds": 120},
        # benchmark 15: per-rank batch 64 makes a step's CPU the rank's (at 16, gloo's waits are most of it, and a
        # quarter of a CPU hardly slows it); 34 epochs of 85 steps leave ~30 s of training after the action, the
        # throttle coming ~135 s in (the standbys 60 s after the ranks join, then 60 s healthy)
        "slow": {"subset": 16384, "batch": 64, "epochs": 34, "ckpt_every": 50, "slow_for": 60, "healthy_s": 60,
                 "window": 10, "timeout": 900, "ssh": True},
    }


def benchmarks() -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
    from bench import (
        attach,
        containers,
        ddp,
        harness_cost,
        health,
        k8s,
        launch,
        preflight,
        recovery,
        scale,
        slow,
        slurm,
        strategies,
        stream,
        throughput,
        tuning,
    )

    return {"throughput": throughput.run, "tuning": tuning.run, "ddp": ddp.run, "strategies": strategies.run,
            "first_step": launch.time_to_first_step, "harness_cost": harness_cost.run, "preflight": preflight.run,
            "failure": launch.failure_propagation, "recovery": recovery.run, "attach": attach.run, "slurm": slurm.run,
            "containers": containers.run, "hangs": health.hangs, "watch_cost": health.watch_cost,
            "stream": stream.run, "metrics_cost": health.metrics_cost, "k8s": k8s.run,
            "scale": scale.run, "slow": slow.run}


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run(name: str, device: str, only: list[str], faults: int = HEALTH_FAULTS) -> dict[str, Any]:
    started = time.monotonic()
    device = resolve_device(device)
    settings = profile(name, device, faults)
    result: dict[str, Any] = {"schema": 1, "profile": name,
                              "partial": only != list(PROFILE_NAMES[name]) or faults != HEALTH_FAULTS,
                              "machine": machine.describe(), "settings": settings, "benchmarks": {}}
    for bench_name, work in benchmarks().items():
        if bench_name not in only:
            continue
        print(f"bench: {bench_name} ...", flush=True)
        begun = time.monotonic()
        try:
            outcome = work(settings[bench_name])
        except Exception as exc:  # noqa: BLE001 - recorded, the other benchmarks still run
            traceback.print_exc()
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        outcome["seconds"] = round(time.monotonic() - begun, 1)
        result["benchmarks"][bench_name] = outcome
        print(f"bench: {bench_name} done in {outcome['seconds']} s", flush=True)
    result["goals"] = report.goals(result)
    result["duration_s"] = round(time.monotonic() - started, 1)
    return result


def write(result: dict[str, Any], results: Path = RESULTS) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    suffix = "-partial" if result["partial"] else ""
    path = results / f"{stamp}-{socket.gethostname()}-{result['profile']}{suffix}.json"
    text = json.dumps(result, indent=1) + "\n"
    targets = [path] if result["partial"] else [path, results / f"latest-{result['profile']}.json"]
    for target in targets:
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)
    return path


def write_docs(results: Path = RESULTS, docs: Path = DOCS) -> None:
    latest = {}
    for name in PROFILE_NAMES:
        path = results / f"latest-{name}.json"
        if path.exists():
            latest[name] = json.loads(path.read_text())
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(report.markdown(latest))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--quick", dest="profile", action="store_const", const="quick",
                       help="benchmarks 1, 3b, 4, 5 and 6 at their smallest meaningful case, none side by side "
                            "with an older package: about a minute on 2 cores")
    which.add_argument("--full", dest="profile", action="store_const", const="full",
                       help="ResNet-18, repeats and rounds, 16 hosts, Slurm, containers, the stream, older packages "
                            "side by side (default)")
    which.add_argument("--gpu", dest="profile", action="store_const", const="gpu",
                       help="benchmarks 1, 1b (batch and compile-mode tuning), 2, 2b (DDP vs FSDP) and 3b (the "
                            "harness's cost on the payload's img/s) on a CUDA GPU, nothing else")
    which.add_argument("--launch", dest="profile", action="store_const", const="launch",
                       help="benchmarks 3 and 11: harness launch against torchrun by hand to the first step and a "
                            "trivial job, in rounds until the 95%% interval of the difference is within +-0.1 s or "
                            "30 rounds (~12 min on 2 cores), and a chatty job's stream against torchrun --tee")
    which.add_argument("--health", dest="profile", action="store_const", const="health",
                       help=f"benchmarks 9 and 10 alone: {HEALTH_FAULTS} hung launches per fault kind against torchrun "
                            "alone, and the watch's cost (~21 min on 2 cores; no root)")
    which.add_argument("--attach", dest="profile", action="store_const", const="attach",
                       help="benchmark 6b alone: a lost controller taken back by `harness attach` against a relaunch, "
                            "on simulated nodes and SSH hosts, and a 10 s link cut (~35 min on 2 cores; root)")
    which.add_argument("--k8s", dest="profile", action="store_const", const="k8s",
                       help="benchmark 13 alone: supervised Kubernetes pods against bare torchrun pods, played here "
                            "as processes (~4 min on 2 cores)")
    which.add_argument("--scale", dest="profile", action="store_const", const="scale",
                       help="benchmark 14 alone: the controller with 16, 64 and 256 simulated nodes of 4 stand-in "
                            "ranks, 16, 256 and 2,048 stand-in nodes of 8, and 64 SSH hosts (~25 min on 2 cores; the "
                            "same as --only scale)")
    which.add_argument("--slow", dest="profile", action="store_const", const="slow",
                       help="benchmark 15 alone: a node throttled to a quarter of a CPU, taken out by restarts.on: "
                            "slow against left slow, on simulated nodes and SSH hosts with a spare (~20 min on 2 "
                            "cores; root; the same as --only slow)")
    which.add_argument("--docs-only", dest="profile", action="store_const", const="docs",
                       help="only regenerate docs/benchmarks.md from bench/results/latest-*.json")
    p.add_argument("--only", help=f"comma-separated subset of {','.join(NAMES)} (result marked partial)")
    p.add_argument("--faults", type=int, default=HEALTH_FAULTS,
                   help=f"hung launches per fault kind for --health (default {HEALTH_FAULTS}; "
                        "another number: the result is marked partial)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="for benchmarks 1, 2, 2b and 3b (3 and 4-8 always run on CPU with gloo)")
    args = p.parse_args(argv)
    # SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C, so namespaces and child processes are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.profile == "docs":
        write_docs()
        print(f"wrote {DOCS}")
        return 0
    alone = [profile for profile, names in PROFILE_NAMES.items() if args.only and [args.only] == list(names)]
    name = args.profile or (alone[0] if alone else "full")  # `--only k8s`: that benchmark's own profile, whole
    only = args.only.split(",") if args.only else list(PROFILE_NAMES[name])
    unknown = set(only) - set(PROFILE_NAMES[name])
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(sorted(unknown))} for the {name} run: expected some of "
                f"{', '.join(PROFILE_NAMES[name])}")
    if name == "gpu" and resolve_device(args.device) != "cuda":
        p.error("--gpu needs a CUDA GPU and torch sees none (or --device cpu was given)")
    with procs.scratch():
        result = run(name, args.device, only, args.faults)
    path = write(result)
    print(f"wrote {path.relative_to(procs.REPO)}")
    if not result["partial"]:
        write_docs()
        print(f"wrote {DOCS.relative_to(procs.REPO)}")
    print(report.summary(result))
    return 1 if any("error" in b for b in result["benchmarks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
