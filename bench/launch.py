"""Benchmarks 3 and 5: what `harness launch` costs before the first step, and how fast it ends a job
after a node dies, each against the same job under plain torchrun.

3. Time from starting the command to the payload's first progress line (`--log-every 1`, printed by
   rank 0 right after step 1), for `harness launch` (2 simulated nodes x 1 process) and for plain
   torchrun: two agents started by hand (the same topology), in interleaved rounds until the 95%
   interval of the difference is within +-half_width or the round limit (bench/stats.py); also one
   agent with 2 processes and the agents by hand with default threads, in the first rounds. And the
   whole of a trivial job (bench/noop.py: join, one all_reduce, leave), end to end: `harness launch
   bench/noop.py --nnodes 2` as a user types it against the two agents by hand, in rounds the same way.
5. bench/ddp_fail.py: rank 1 records the time and dies at step 3 while rank 0 is blocked. The figure
   is the time from that death to the moment no process of the job is left. Plain torchrun gets a
   bounded wait, after which the survivors still alive are counted and killed.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import procs, stats

FIRST_STEP = r"epoch 1/1 step 1/"
LAST_LINE = r"\bdone: test_acc="  # rank 0's last line: what follows it to the end of the job is the launcher's
PAYLOAD_ARGS = ["--data", "synthetic", "--subset", "256", "--model", "small", "--epochs", "1", "--max-steps", "2",
                "--batch-size", "32", "--log-every", "1", "--device", "cpu"]
PAYLOAD = ["-m", "harness.payload.train", *PAYLOAD_ARGS]
GLOO = {"HARNESS_BACKEND": "gloo"}
# `harness launch` gives each simulated node's worker its share of the cores (OMP_NUM_THREADS), as
# torchrun does for an agent with several workers; agents started by hand get the same, so that the
# comparison is about launching, not thread oversubscription (the `naive` row shows what that costs).
def share(nnodes: int) -> dict[str, str]:
    """The OMP threads `harness launch` gives the worker of each of nnodes simulated nodes (one process each)."""
    return {"OMP_NUM_THREADS": str(max(1, procs.cpu_count() // nnodes))}


SHARE = share(2)
JOB = """\
name: {name}
nnodes: 2
nproc_per_node: 1
backend: gloo
master_port: {port}
entrypoint:
  {kind}: {target}
  args: {args}
env: {env}
timeouts: {{stop_grace: 3}}
"""
Start = Callable[[], list[procs.Proc]]  # starts a job; the first process prints rank 0's lines


def write_job(path: Path, kind: str, target: str, args: list[str], env: dict[str, str]) -> Path:
    """A 2-node x 1-process gloo job spec (JSON-style flow lists: valid YAML, every value a string)."""
    quoted = "[" + ", ".join(f'"{a}"' for a in args) + "]"
    env_text = "{" + ", ".join(f'{k}: "{v}"' for k, v in env.items()) + "}"
    path.write_text(JOB.format(name=f"bench-{path.stem}", port=procs.free_port(), kind=kind, target=target,
                               args=quoted, env=env_text))
    return path


def harness_launch(job: Path, runs: Path) -> procs.Proc:
    return procs.Proc([procs.PY, "-m", "harness.cli", "launch", str(job), "--runs-dir", str(runs)])


def torchrun_by_hand(entry: list[str], env: dict[str, str]) -> list[procs.Proc]:
    """Two torchrun agents, node ranks 0 and 1, as a user would type them on two machines."""
    port, tag = procs.free_port(), f"torchrun-{time.monotonic_ns()}"
    return [procs.Proc([*procs.torchrun(nnodes=2, node_rank=r, port=port), *entry], procs.clean_env(**env), tag=tag)
            for r in (0, 1)]


def _first_step(start: Start, timeout: float = 120) -> tuple[float, float, float]:
    """(seconds to rank 0's first step line, seconds to the end of the job, seconds from rank 0's last line to that
    end) for one start."""
    begun = time.monotonic()
    started = start()
    try:
        when, _ = started[0].wait_for(FIRST_STEP, timeout)
        last, _ = started[0].wait_for(LAST_LINE, timeout)
        codes = [p.wait(timeout) for p in started]
        if any(codes):
            raise RuntimeError(f"job exited {codes}:\n{started[0].output[-2000:]}")
        ended = max(p.ended or 0.0 for p in started)
        return when - begun, ended - begun, ended - last
    finally:
        for p in started:
            p.kill()


NOOP = str(procs.REPO / "bench" / "noop.py")
FIRST_STEP_GOAL = 0.0  # seconds harness launch may add to the first step, against torchrun by hand (issue 69)
TRIVIAL_GOAL = 0.3  # and to the trivial job's whole run


def _end_to_end(start: Start, timeout: float = 120) -> float:
    """Seconds from starting the command to the end of every process it started."""
    begun = time.monotonic()
    started = start()
    try:
        codes = [p.wait(timeout) for p in started]
        if any(codes):
            raise RuntimeError(f"job exited {codes}:\n{started[0].output[-2000:]}")
        return max(p.ended or 0.0 for p in started) - begun
    finally:
        for p in started:
            p.kill()


def recorded(record: list[Any], measure: Callable[[], Any], value: Callable[[Any], float] = float,
             ) -> Callable[[], float]:
    """measure() for stats.compare: each answer appended to record, value(answer) compared."""
    def run() -> float:
        record.append(measure())
        return value(record[-1])
    return run


HARNESS = "harness launch (2 nodes x 1 process)"
BY_HAND = "torchrun by hand (2 agents x 1 process)"
TRIVIAL_HARNESS = "harness launch bench/noop.py --nnodes 2"
TRIVIAL_BY_HAND = "torchrun by hand (2 agents)"


def trivial_job(cfg: dict[str, Any], runs: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """bench/noop.py end to end, the two launchers in interleaved rounds: medians, every attempt, and the
    paired difference's interval."""
    variants: dict[str, Start] = {
        TRIVIAL_HARNESS: lambda: [procs.Proc(
            [procs.PY, "-m", "harness.cli", "launch", NOOP, "--nnodes", "2", "--runs-dir", str(runs)])],
        TRIVIAL_BY_HAND: lambda: torchrun_by_hand([NOOP], SHARE),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    timed = {name: recorded(seconds[name], functools.partial(_end_to_end, start)) for name, start in variants.items()}
    difference = stats.rounded(stats.compare(timed[TRIVIAL_HARNESS], timed[TRIVIAL_BY_HAND],
                                             half_width=cfg["half_width"], max_rounds=cfg["trivial_rounds"]), 3)
    print(f"bench: trivial job end to end, harness - torchrun by hand: {stats.describe(difference)}; "
          f"{stats.stopped(difference)}", flush=True)
    by_hand = statistics.median(seconds[TRIVIAL_BY_HAND])
    rows = [{"name": name, "end_to_end_s": round(statistics.median(runs_s), 2),
             "vs_torchrun_by_hand_s": round(statistics.median(runs_s) - by_hand, 2),
             "ratio": round(statistics.median(runs_s) / by_hand, 3), "attempts_s": [round(s, 2) for s in runs_s]}
            for name, runs_s in seconds.items()]
    return rows, difference


def time_to_first_step(cfg: dict[str, Any]) -> dict[str, Any]:
    """Benchmark 3: the pair (harness launch, torchrun by hand) in rounds; with `others`, two more torchrun variants
    in the first `repeats` rounds; `harness render`; and the trivial job (where trivial_rounds)."""
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        job = write_job(Path(tmp) / "overhead.yaml", "module", "harness.payload.train", PAYLOAD_ARGS, {})
        variants: dict[str, Start] = {
            HARNESS: lambda: [harness_launch(job, Path(tmp) / "runs")],
            BY_HAND: lambda: torchrun_by_hand(PAYLOAD, GLOO | SHARE),
        }
        if cfg["others"]:
            variants["torchrun (1 agent x 2 processes)"] = lambda: [
                procs.Proc([*procs.torchrun(nproc=2, port=procs.free_port()), *PAYLOAD], procs.clean_env(**GLOO))]
            variants["torchrun by hand, default threads (naive)"] = lambda: torchrun_by_hand(PAYLOAD, GLOO)
        attempts: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
        timed = {name: recorded(attempts[name], functools.partial(_first_step, start), lambda got: got[0])
                 for name, start in variants.items()}

        def others(i: int) -> None:  # the other variants in the first rounds: a burst of load hits one round
            for name in list(variants)[2:] if i < cfg["repeats"] else []:
                timed[name]()

        difference = stats.rounded(stats.compare(timed[HARNESS], timed[BY_HAND], half_width=cfg["half_width"],
                                                 max_rounds=cfg["max_rounds"], after_round=others), 3)
        print(f"bench: first step, harness launch - torchrun by hand: {stats.describe(difference)}; "
              f"{stats.stopped(difference)}", flush=True)
        render = []
        for _ in range(cfg["repeats"]):
            begun = time.monotonic()
            procs.run_lines([procs.PY, "-m", "harness.cli", "render", str(job)])
            render.append(time.monotonic() - begun)
        trivial = trivial_job(cfg, Path(tmp) / "runs") if cfg.get("trivial_rounds") else None
    rows: list[dict[str, Any]] = [{"name": name, "first_step_s": round(statistics.median(r[0] for r in runs), 2),
                                   "job_end_s": round(statistics.median(r[1] for r in runs), 2),
                                   "ending_s": round(statistics.median(r[2] for r in runs), 2),
                                   "attempts_first_step_s": [round(r[0], 2) for r in runs]}
                                  for name, runs in attempts.items()]
    for row in rows:
        row["vs_torchrun_by_hand_s"] = round(row["first_step_s"] - rows[1]["first_step_s"], 2)
    found: dict[str, Any] = {"job": "payload: synthetic data, small model, batch 32, gloo on CPU, world size 2",
                             "repeats": cfg["repeats"], "statistic": "median", "rows": rows,
                             "difference": difference, "goal_s": FIRST_STEP_GOAL,
                             "harness_render_s": round(statistics.median(render), 2)}
    if trivial is not None:
        found |= {"trivial_job": trivial[0], "trivial_difference": trivial[1], "trivial_goal_s": TRIVIAL_GOAL}
    return found


def died_at(path: Path, watched: procs.Proc | None = None, timeout: float = 120) -> float:
    """When the failing rank died (it wrote the time to path), on this process's monotonic clock."""
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline or (watched is not None and watched.proc.poll() is not None):
            raise RuntimeError(f"no rank died within {timeout:g}s:\n{watched.output[-2000:] if watched else ''}")
        time.sleep(0.01)
    return float(path.read_text()) - (time.time() - time.monotonic())


def _all_gone(tag: str, ignore: set[int], until: float) -> float | None:
    """Poll until no process with the tag (but those ignored) is left; when, or None by `until`."""
    while time.monotonic() < until:
        if not set(procs.tagged(tag)) - ignore:
            return time.monotonic()
        time.sleep(0.02)
    return None


def failure_under_harness(tmp: Path, block: str, attempt: int, limit: float = 60) -> dict[str, Any]:
    death = tmp / f"death-harness-{block}-{attempt}"
    env = {"FAIL_RANK": "1", "FAIL_AT_STEP": "3", "BLOCK": block, "DEATH_FILE": str(death)}
    job = write_job(tmp / f"fail-{block}.yaml", "script", "bench/ddp_fail.py", [], env)
    with harness_launch(job, tmp / "runs") as p:
        died = died_at(death, p)
        gone = _all_gone(p.tag, {p.proc.pid}, died + limit)  # the controller itself is not a job process
        code = p.wait(timeout=limit)
        left = len(set(procs.tagged(p.tag)) - {p.proc.pid})
        detected, _ = p.wait_for(r"^harness: node\d+ .* failed \(", timeout=1)
        assert p.ended is not None
        return {"exit_code": code, "detected_s": detected - died, "all_gone_s": gone - died if gone else None,
                "launcher_exit_s": p.ended - died, "alive_at_end": left}


def harness_failures(tmp: Path, block: str, repeats: int) -> dict[str, Any]:
    """Median over repeats of each figure (a run that left processes counts as infinitely slow)."""
    runs = [failure_under_harness(tmp, block, i) for i in range(repeats)]

    def median(key: str) -> float | None:
        values = [r[key] if r[key] is not None else float("inf") for r in runs]
        value = statistics.median(values)
        return None if value == float("inf") else round(value, 2)

    return {"launcher": "harness launch", "block": block, "exit_codes": [r["exit_code"] for r in runs],
            "detected_s": median("detected_s"), "all_gone_s": median("all_gone_s"),
            "launcher_exit_s": median("launcher_exit_s"), "alive_at_end": max(r["alive_at_end"] for r in runs),
            "attempts_all_gone_s": [None if r["all_gone_s"] is None else round(r["all_gone_s"], 2) for r in runs]}


def failure_under_torchrun(tmp: Path, block: str, wait: float) -> dict[str, Any]:
    death = tmp / f"death-torchrun-{block}"
    env = {"FAIL_RANK": "1", "FAIL_AT_STEP": "3", "BLOCK": block, "DEATH_FILE": str(death)}
    agents = torchrun_by_hand(["bench/ddp_fail.py"], env | SHARE)
    try:
        died = died_at(death, agents[0])
        gone = _all_gone(agents[0].tag, set(), died + wait)
        left = len(procs.tagged(agents[0].tag))
        if gone is not None:
            for agent in agents:
                agent.wait(timeout=5)
        exits = {f"node{r}": (round(a.ended - died, 2) if a.ended else None) for r, a in enumerate(agents)}
    finally:
        for agent in agents:
            agent.kill()
    return {"launcher": "torchrun by hand", "block": block, "bounded_wait_s": wait,
            "all_gone_s": round(gone - died, 2) if gone else None, "alive_at_end": left,
            "agent_exit_s": exits}


def failure_propagation(cfg: dict[str, Any]) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-failure-") as tmp:
        for block in cfg["blocks"]:
            rows.append(harness_failures(Path(tmp), block, cfg["repeats"]))
            if cfg["torchrun_wait"]:  # the full run's: torchrun alone, given a bounded wait
                rows.append(failure_under_torchrun(Path(tmp), block, cfg["torchrun_wait"]))
    return {"script": "bench/ddp_fail.py: 2 nodes x 1 process, gloo on CPU, rank 1 dies at step 3",
            "repeats": cfg["repeats"], "statistic": "median", "goal_s": 5.0, "rows": rows}
