"""Benchmark 11: the stream's speed. 2 nodes x 2 ranks print 1M lines in all (bench/spam.py); the
harness's stream -- its terminal (here a file, as a fast terminal is) and its timed record -- against two
torchrun agents with `--tee 3` teeing the same ranks to the same kind of file, the job's end to end time
each, in interleaved rounds until the 95% interval of the ratio harness / torchrun (paired by round) is
within +-half_width or the round limit (bench/stats.py)."""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import launch, procs, stats

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


HARNESS = "harness launch (2 nodes x 2 ranks)"
TORCHRUN = "torchrun --tee 3 (2 agents)"


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    per_rank = cfg["lines"] // 4
    env = procs.clean_env()
    seconds: dict[str, list[float]] = {HARNESS: [], TORCHRUN: []}
    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        def one(name: str) -> float:
            out = Path(tmp) / f"{len(seconds[name])}-{name.split()[0]}"
            if name == HARNESS:
                argvs = [[procs.PY, "-m", "harness.cli", "launch", SPAM, "--nnodes", "2", "--nproc-per-node", "2",
                          "--runs-dir", f"{tmp}/runs", "--", str(per_rank)]]
            else:
                port = procs.free_port()
                argvs = [[*procs.torchrun(nnodes=2, node_rank=r, nproc=2, port=port), "--tee", "3", SPAM,
                          str(per_rank)] for r in (0, 1)]
            took = _run(argvs, out, env)
            printed = sum(1 for path in Path(tmp).glob(f"{out.name}.*.txt") for _ in path.open())
            if printed < cfg["lines"]:
                raise RuntimeError(f"{name}: {printed} of {cfg['lines']} lines reached its output")
            return took

        ratio = stats.rounded(stats.compare(launch.recorded(seconds[HARNESS], lambda: one(HARNESS)),
                                            launch.recorded(seconds[TORCHRUN], lambda: one(TORCHRUN)),
                                            half_width=cfg["half_width"], max_rounds=cfg["max_rounds"],
                                            statistic="ratio"), 3)
    print(f"bench: stream, end to end harness / torchrun --tee 3: {stats.describe(ratio)}; {stats.stopped(ratio)}",
          flush=True)
    harness, torchrun = (statistics.median(s) for s in seconds.values())
    return {"job": f"{cfg['lines']:,} lines in all from 2 nodes x 2 ranks (bench/spam.py), stdout to a file",
            "repeats": ratio["rounds"], "statistic": "median", "ratio": round(harness / torchrun, 3),
            "paired_ratio": ratio,
            "rows": [{"name": name, "seconds": round(statistics.median(s), 2), "attempts_s": [round(a, 2) for a in s]}
                     for name, s in seconds.items()]}
