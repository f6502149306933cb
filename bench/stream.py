"""Benchmark 11: the stream's speed. 2 nodes x 2 ranks print 1M lines in all (bench/spam.py); the
harness's stream -- its terminal (here a file, as a fast terminal is) and its timed record -- against two
torchrun agents with `--tee 3` teeing the same ranks to the same kind of file, alternating, the job's end
to end time each. Also the harness alone when its terminal is a pipe nobody reads for a while (the job
must not wait for it)."""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procs

SPAM = str(procs.REPO / "bench" / "spam.py")


def _run(argvs: list[list[str]], out: Path, env: dict[str, str]) -> float:
    """Seconds from the start to the end of every process; each writes to its own file beside out."""
    begun = time.monotonic()
    started = []
    for i, argv in enumerate(argvs):
        with open(out.with_suffix(f".{i}.txt"), "w") as sink:
            started.append(subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True))
    codes = [p.wait(timeout=600) for p in started]
    if any(codes):
        raise RuntimeError(f"exited {codes}: {out.with_suffix('.0.txt').read_text()[-2000:]}")
    return time.monotonic() - begun


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    per_rank = cfg["lines"] // 4
    env = procs.clean_env()
    seconds: dict[str, list[float]] = {"harness launch (2 nodes x 2 ranks)": [], "torchrun --tee 3 (2 agents)": []}
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        for attempt in range(cfg["repeats"]):
            for name in seconds:
                out = Path(tmp) / f"{attempt}-{len(seconds[name])}-{name.split()[0]}"
                if name.startswith("harness"):
                    argvs = [[procs.PY, "-m", "harness.cli", "launch", SPAM, "--nnodes", "2", "--nproc-per-node", "2",
                              "--runs-dir", f"{tmp}/runs", "--", str(per_rank)]]
                else:
                    port = procs.free_port()
                    argvs = [[*procs.torchrun(nnodes=2, node_rank=r, nproc=2, port=port), "--tee", "3", SPAM,
                              str(per_rank)] for r in (0, 1)]
                seconds[name].append(_run(argvs, out, env))
                printed = sum(1 for path in Path(tmp).glob(f"{out.name}.*.txt") for _ in path.open())
                if printed < cfg["lines"]:
                    raise RuntimeError(f"{name}: {printed} of {cfg['lines']} lines reached its output")
    harness, torchrun = (statistics.median(s) for s in seconds.values())
    return {"job": f"{cfg['lines']:,} lines in all from 2 nodes x 2 ranks (bench/spam.py), stdout to a file",
            "repeats": cfg["repeats"], "statistic": "median", "ratio": round(harness / torchrun, 3),
            "rows": [{"name": name, "seconds": round(statistics.median(s), 2), "attempts_s": [round(a, 2) for a in s]}
                     for name, s in seconds.items()]}
