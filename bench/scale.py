"""Benchmark 14: the harness at scale. N simulated nodes x R ranks, the controller and one real node agent per
node exactly as in a run, the ranks stand-ins that cost no torch import (testbed/standin: the stand-in torchrun
forks each rank with torchrun's environment; each step sleeps, computes a millisecond and
all-reduces through node 0's coordinator; every rank prints its progress line; the harness's rank hook serves
their Flight Recorder entries as torch's worker server does), so that what grows with N is the harness's own cost.

Per N: launch to every rank running (the first `step 1` line: step 1's all_reduce needs every rank); then over a
steady window, the controller's CPU (per node per second) and memory, its threads and file descriptors, the
agents' CPU and memory, the stream's lines per second (the run's record), and `harness status`, `top --once` and
`logs --rank` answer times (whole commands, as a user types them, on the loaded machine); then the last rank
hangs in its data loading: the time from its last step to the verdict (goal: stall + 15 s) and whether the
verdict names it, and how long every node then takes to stop; and the ranks named slow, wrongly (none is).

The same rows with stand-in nodes (testbed/fleet.py) go to 2,048 nodes x 8 ranks: one process serves every node's
agent side of the protocol over a socket each, so that on two cores what grows is the controller's work alone;
the controller, its record and its verdicts are a launch's own.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import random
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import procs
from harness.control.health_loop import TICK_SECONDS
from harness.health.arrivals import Arrivals
from harness.health.judge import SLOW_WINDOW, HealthJudge
from harness.node.collectives import ArrivalsDigest
from harness.node.proctable import children
from harness.node.protocol import (
    Arrival,
    RankSample,
    arrivals_bodies,
    health_bodies,
    paced,
    parse_arrivals,
    parse_health,
)
from harness.node.ranks import ProgressWatch
from harness.plan.planner import Node
from harness.preflight.runner import run_preflight
from harness.record.stream import STAMP_WIDTH, each_rank, stamp, unstamp
from harness.spec.inventory import load_inventory
from harness.spec.job import Health, load_job
from testbed import cluster

STANDIN = procs.REPO / "testbed" / "standin"
PAGE = os.sysconf("SC_PAGE_SIZE")
JOB = """\
name: scale
nnodes: {nnodes}
nproc_per_node: {nproc}
backend: gloo
entrypoint:
  script: {script}
  args: [--steps, "100000", --step-seconds, "{step_seconds}", --warning, --hang-rank, "{hang_rank}",
         --hang-step, "{hang_step}"]
env:
  PYTHONPATH: {shim}:{repo}
health:
  stall: {stall}
simulated:
  network: {network}
timeouts:
  stop_grace: 3
  rendezvous: 900
"""
STEP_ONE = re.compile(r"\]: epoch 1/1 step 1/")
HANG = re.compile(r"^harness: hang: (.*)")
SLOW = re.compile(r"^harness: slow: rank (\d+) ")  # no rank is slowed here: each one named is named wrongly


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError):
        return 0


def _agents(controller: int, fleet: bool) -> list[int]:
    """The node agents: the controller's children that run `harness-agent` (simulated nodes are its children); or
    the stand-in nodes' one process."""
    found = []
    for pid in children(controller):
        with contextlib.suppress(OSError):
            if (b"testbed.fleet" if fleet else b"harness-agent") in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def _status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def _timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    begun = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    return time.monotonic() - begun


def _record_lines(run_dir: Path, start: float, end: float) -> tuple[int, int]:
    """The ranks' lines the run's record got between two wall-clock times, and the lines it holds them in (an agent
    says identical lines of its ranks as one: protocol.RankLines)."""
    first, last = stamp(start), stamp(end)
    ranks_lines = written = 0
    for log in (run_dir / "logs" / "attempt0").glob("node*.log"):
        with open(log, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if first <= line[:STAMP_WIDTH] < last:
                    written += 1
                    ranks_lines += sum(1 for _ in each_rank(line))
    return ranks_lines, written


def _stamps(folder: Path, pattern: str) -> tuple[float, float]:
    """When the record got the first and the last line matching pattern among the files in folder (UTC seconds)."""
    regex, found = re.compile(pattern), []
    for log in folder.glob("*.log"):
        with open(log, encoding="utf-8", errors="replace") as handle:
            found += [line[:STAMP_WIDTH] for line in handle if regex.search(unstamp(line))]
    if not found:
        raise RuntimeError(f"no line {pattern!r} in {folder}")
    first, last = (datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC).timestamp()
                   for text in (min(found), max(found)))
    return first, last


def one(nnodes: int, nproc: int, cfg: dict[str, Any], fleet: bool = False) -> dict[str, Any]:
    """fleet: the nodes are testbed/fleet.py's stand-ins (one process), not agents."""
    step_seconds, stall = cfg["step_seconds"], cfg["stall"]
    world = nnodes * nproc
    # the hang comes after the warm-up and the window, counted in steps from the first one (steps need every rank)
    hang_step = math.ceil((cfg["warmup"] + cfg["window"] + cfg["queries_margin"]) / step_seconds)
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        work = Path(tmp)
        job = work / "job.yaml"
        job.write_text(JOB.format(nnodes=nnodes, nproc=nproc, script=STANDIN / "rank.py", step_seconds=step_seconds,
                                  hang_rank=world - 1, hang_step=hang_step, shim=STANDIN / "shim", repo=procs.REPO,
                                  stall=stall, network="host" if fleet else "private"))
        env = procs.clean_env(XDG_STATE_HOME=str(work / "state"))
        harness = [procs.PY, "-m", "harness.cli"]
        launcher = [procs.PY, "-m", "testbed.fleet"] if fleet else [*harness, "launch"]
        with procs.Proc([*launcher, str(job)], env=env | {"PYTHONPATH": str(procs.REPO)}, cwd=work) as launch:
            _, ran = launch.wait_for(r"^harness: run (\S+): ", timeout=120)
            run_id = ran[1]
            running, _ = launch.wait_for(STEP_ONE.pattern, timeout=cfg["start_timeout"])
            controller = launch.proc.pid
            time.sleep(cfg["warmup"])
            agents = _agents(controller, fleet)
            begun, wall_begun = time.monotonic(), time.time()
            cpu0 = procs.process_cpu_s(controller)
            agents0 = {pid: procs.process_cpu_s(pid) for pid in agents}
            rss, agent_rss = [], []
            answers: dict[str, list[float]] = {"status": [], "top": [], "logs_rank": []}
            queries = [("status", [*harness, "status", run_id]), ("top", [*harness, "top", run_id, "--once"]),
                       ("logs_rank", [*harness, "logs", run_id, "--rank", str(world // 2)])]
            asked = 0
            while time.monotonic() - begun < cfg["window"]:
                if launch.proc.poll() is not None:
                    raise RuntimeError(f"the launch ended in the window, exit {launch.proc.returncode}:\n"
                                       + "\n".join(line[:300] for _, line in launch.lines[-30:]))
                rss.append(_rss(controller))
                agent_rss.append(statistics.mean(_rss(pid) for pid in agents))
                if asked < cfg["queries"] * len(queries):
                    name, argv = queries[asked % len(queries)]
                    answers[name].append(_timed(argv, work, env))
                    asked += 1
                else:
                    time.sleep(1.0)
            seconds = time.monotonic() - begun
            wall_ended = time.time()
            controller_cpu = procs.process_cpu_s(controller) - cpu0
            agents_cpu = sum(procs.process_cpu_s(pid) - cpu for pid, cpu in agents0.items())
            threads, fds = _status_field(controller, "Threads"), len(os.listdir(f"/proc/{controller}/fd"))
            peak = _status_field(controller, "VmHWM") * 1024
            said, verdict = launch.wait_for(HANG.pattern, timeout=hang_step * step_seconds + stall + 600)
            launch.wait(timeout=300)
            record = work / "runs" / run_id
            # Every rank prints the hang's last step together (its all_reduce just ended): the first of their lines
            # the record got is when the step was made; the last, how far behind the record's slowest node ran.
            last_step, last_taken = _stamps(record / "logs" / "attempt0", rf"\]: epoch 1/1 step {hang_step - 1}/")
            _, hung_at = _stamps(record / "logs", r"^harness: hang: ")
            _, found_at = _stamps(record / "logs", r"^harness: no progress for \S+ s on ")
            lines, written = _record_lines(record, wall_begun, wall_ended)
            record_bytes = sum(f.stat().st_size for f in record.rglob("*") if f.is_file())
            timeline_bytes = (record / "timeline.jsonl").stat().st_size
            lasted = (launch.ended or time.monotonic()) - launch.started
            shown = sum(1 for when, line in launch.lines if begun <= when < begun + seconds)
    culprit = f"rank {world - 1} (node{nnodes - 1} on sim{nnodes - 1}) has not reached #{hang_step}"
    return {
        "nodes": nnodes, "ranks": world, "window_s": round(seconds, 1),
        "launch_to_running_s": round(running - launch.started, 2),
        "controller_cpu_per_node_per_s": round(controller_cpu / nnodes / seconds, 5),
        "controller_cores": round(controller_cpu / seconds, 3),
        "controller_rss_mib": round(max(rss) / 2**20, 1), "controller_peak_rss_mib": round(peak / 2**20, 1),
        "controller_threads": threads, "controller_fds": fds,
        "agent_cpu_per_s": round(agents_cpu / len(agents) / seconds, 5), "stand_ins": fleet,
        "agent_rss_mib": round(statistics.mean(agent_rss) / 2**20, 1),
        "answer_s": {name: round(statistics.median(times), 2) for name, times in answers.items() if times},
        "answer_attempts_s": {name: [round(t, 2) for t in times] for name, times in answers.items()},
        "record_lines_per_s": round(lines / seconds, 1), "printed_lines_per_s": round(world / step_seconds, 1),
        "record_written_lines_per_s": round(written / seconds, 1),
        "record_mib": round(record_bytes / 2**20, 1),
        "record_bytes_per_rank_per_s": round(record_bytes / world / lasted, 1),
        "timeline_bytes_per_rank_per_s": round(timeline_bytes / world / lasted, 2),
        "terminal_lines_per_s": round(shown / seconds, 1),
        "record_behind_s": round(last_taken - last_step, 1),
        "found_s": round(found_at - last_step, 1), "capture_s": round(hung_at - found_at, 1),
        "verdict_s": round(hung_at - last_step, 1), "verdict_goal_s": stall + 15 + step_seconds,
        "culprit_named": culprit in verdict[1], "verdict": verdict[1][:600],
        "stopped_s": round((launch.ended or time.monotonic()) - said, 1),
        "wrongly_slow": len({match[1] for _, line in launch.lines if (match := SLOW.match(line))}),
        "wrongly_slow_said": [line[:300] for _, line in launch.lines if SLOW.match(line)][:3],  # by which measure
    }


def _sockets(pid: int) -> int:
    """The process's open sockets (its SSH connections, pipes excluded)."""
    found = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            found += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return found


def ssh(cfg: dict[str, Any]) -> dict[str, Any]:
    """The same stand-in job over SSH: cfg["ssh_hosts"] sshd hosts in network namespaces (testbed/cluster.py),
    each a node of cfg["ssh_nproc"] ranks that runs a few steps and ends: the fast checks `harness launch --hosts`
    runs first, timed alone; launch to every rank running; the controller's threads, sockets and CPU while it
    runs; launch to its end. timeouts.connect is cfg["ssh_connect"]: 64 hosts' probes share this machine's cores
    (on a cluster each host has its own), and some take longer than the default 10 s."""
    hosts, nproc = cfg["ssh_hosts"], cfg["ssh_nproc"]
    world = hosts * nproc
    begun = time.monotonic()
    with cluster.namespace_cluster(hosts) as hosts_up, tempfile.TemporaryDirectory(prefix="bench-scale-ssh-") as tmp:
        built = time.monotonic() - begun
        work = Path(tmp)
        inventory = hosts_up.write_inventory(work / "hosts.yaml")
        job = work / "job.yaml"
        job.write_text(JOB.format(nnodes=hosts, nproc=nproc, script=STANDIN / "rank.py", step_seconds=1.0,
                                  hang_rank=-1, hang_step=-1, shim=STANDIN / "shim", repo=procs.REPO,
                                  stall=cfg["stall"], network="private").replace('"100000"', f'"{cfg["ssh_steps"]}"')
                       + f"  connect: {cfg['ssh_connect']}\n")
        checked = time.monotonic()  # as `harness launch --hosts` runs them (its gate), timed alone
        report = run_preflight(load_inventory(inventory), load_job(job), known_hosts=hosts_up.known_hosts, fast=True,
                               timeout=cfg["ssh_connect"])
        checks = time.monotonic() - checked
        if not report.ok:
            raise RuntimeError(f"the fast checks over {hosts} hosts failed:\n{report.render_table()[-3000:]}")
        env = procs.clean_env(XDG_STATE_HOME=str(work / "state"))
        argv = [procs.PY, "-m", "harness.cli", "launch", str(job), "--hosts", str(inventory), "--known-hosts",
                str(hosts_up.known_hosts)]
        with procs.Proc(argv, env=env, cwd=work) as launch:
            running, _ = launch.wait_for(STEP_ONE.pattern, timeout=cfg["start_timeout"])
            controller = launch.proc.pid
            cpu0, window_begun = procs.process_cpu_s(controller), time.monotonic()
            time.sleep(cfg["ssh_window"])
            seconds = time.monotonic() - window_begun
            cpu = procs.process_cpu_s(controller) - cpu0
            threads, sockets = _status_field(controller, "Threads"), _sockets(controller)
            peak = _status_field(controller, "VmHWM") * 1024
            code = launch.wait(timeout=cfg["ssh_steps"] * 3 + 300)
            if code != 0:
                raise RuntimeError(f"the {hosts}-host launch exited {code}:\n{launch.output[-3000:]}")
        hosts_up.assert_only_sshd_left()
    return {"hosts": hosts, "ranks": world, "cluster_build_s": round(built, 1), "fast_checks_s": round(checks, 2),
            "launch_to_running_s": round(running - launch.started, 2),
            "launch_to_end_s": round((launch.ended or time.monotonic()) - launch.started, 2),
            "controller_threads": threads, "controller_sockets": sockets,
            "controller_cpu_per_node_per_s": round(cpu / hosts / seconds, 5),
            "controller_cores": round(cpu / seconds, 3),
            "controller_peak_rss_mib": round(peak / 2**20, 1)}


def arrivals_cost(nnodes: int, nproc: int, rate: float, seconds: float) -> dict[str, Any]:
    """The controller's CPU on the ranks' arrivals alone, side by side: `seconds` of a job of nnodes x nproc ranks,
    each arriving at `rate` collectives a second within a millisecond of its node's others (rank 0 a tenth of the
    time between them late), taken as each node's agent says them (collectives.ArrivalsDigest) and as an agent of
    an older harness did (every rank's own): every message parsed and kept (Arrivals.add), and each rank's wait
    weighed once a sample interval (Arrivals.waited). CPU seconds per second of job, and the waits each found."""
    interval, rng = paced(1.0, nnodes), random.Random(14)
    nodes = [Node(host=f"sim{n}", address="127.0.0.1", node_rank=n, nproc=nproc) for n in range(nnodes)]
    digests = [ArrivalsDigest() for _ in nodes]
    found: dict[str, dict[str, Any]] = {}
    said: dict[str, list[list[tuple[Node, str]]]] = {"digest": [], "every rank": []}
    for k in range(int(seconds / interval)):
        t, first = 1000.0 + (k + 1) * interval, int(k * interval * rate)
        seqs = range(first, int((k + 1) * interval * rate))
        said["digest"].append([])
        said["every rank"].append([])
        for node in nodes:
            arrived = {rank: [Arrival("0", seq, int((1000.0 + (seq + (0.1 if rank == 0 else 0)) / rate
                                                     + rng.uniform(0, 0.001)) * 1e9)) for seq in seqs]
                       for rank in node.ranks}
            said["every rank"][-1].append((node, json.dumps({"t": t, "ahead": 0.0, "ranks": arrived})))
            said["digest"][-1] += [(node, body) for body in arrivals_bodies(
                t, digests[node.node_rank].add(node.ranks, arrived, int(t * 1e9)), 0.0)]
    live = list(range(nnodes * nproc))
    for name, intervals in said.items():
        arrivals, waited = Arrivals(horizon=2 * SLOW_WINDOW), {}
        started = time.process_time()
        for k, messages in enumerate(intervals):
            for node, body in messages:
                arrivals.add(node, 1000.0 + (k + 1) * interval, parse_arrivals(body))
            waited = arrivals.waited(live, SLOW_WINDOW)
        found[name] = {"cores": round((time.process_time() - started) / seconds, 4),
                       "messages_per_s": round(sum(map(len, intervals)) / seconds, 1),
                       "rank0_waited_pct": round(waited.get(0, 0.0), 1),
                       "others_waited_max_pct": round(max((v for r, v in waited.items() if r), default=0.0), 2)}
    return {"nodes": nnodes, "ranks": nnodes * nproc, "collectives_per_s": rate, "seconds": seconds,
            "interval_s": round(interval, 2), **found}


def hang_look_cost(nnodes: int, nproc: int, seconds: float, stall: float) -> dict[str, Any]:
    """The controller's CPU on looking for a hang, side by side: `seconds` of a job of nnodes x nproc ranks whose last
    rank stops a third of the way in, each node's health messages as its agent says them (each rank's progress judged
    there: ranks.ProgressWatch), parsed and taken (HealthJudge.observe), and at every tick of the health loop the
    look for a hang as the judge makes it (its suspects) against a look at every rank (what each tick did before the
    agents judged their ranks' progress, each rank's rule alone: that tick also gathered and sorted the live ranks,
    10.9 ms at 2,048 x 8 against this one's 2-3). CPU seconds per second of job, and when each found the rank."""
    interval = paced(Health(stall=stall).sample_seconds, nnodes)
    nodes = [Node(host=f"sim{n}", address="127.0.0.1", node_rank=n, nproc=nproc) for n in range(nnodes)]
    watches, hung, stops = [ProgressWatch() for _ in nodes], nnodes * nproc - 1, seconds / 3
    judge = HealthJudge(stall=stall, slow=0)
    spent = {"messages": 0.0, "suspects": 0.0, "every_rank": 0.0}
    found: dict[str, float | None] = {"suspects": None, "every_rank": None}
    t, sampled = 0.0, 0.0
    while t < seconds:
        t += TICK_SECONDS
        if t - sampled >= interval:
            sampled = t
            bodies = [(node, body) for node, watch in zip(nodes, watches, strict=True) for body in health_bodies(
                t, watch.judged(t, {rank: RankSample(rank, "S", min(t, stops) if rank == hung else t, t / 2, 0)
                                    for rank in node.ranks}))]
            started = time.process_time()
            for node, body in bodies:
                judge.observe(node, t, parse_health(body).samples)
            spent["messages"] += time.process_time() - started
        started = time.process_time()
        if judge.stalled() and found["suspects"] is None:
            found["suspects"] = t
        spent["suspects"] += time.process_time() - started
        started = time.process_time()
        if [number for number, rank in judge.ranks.items() if rank.hung(stall)] and found["every_rank"] is None:
            found["every_rank"] = t
        spent["every_rank"] += time.process_time() - started
    return {"nodes": nnodes, "ranks": nnodes * nproc, "seconds": seconds, "interval_s": round(interval, 2),
            "stall_s": stall, **{f"{name}_cores": round(value / seconds, 6) for name, value in spent.items()},
            **{f"{name}_found_after_stop_s": None if at is None else round(at - stops, 1)
               for name, at in found.items()}}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    rows, stand_ins = [], []
    for nnodes in cfg["nodes"]:
        print(f"bench: scale: {nnodes} nodes x {cfg['nproc']} ranks ...", flush=True)
        rows.append(one(nnodes, cfg["nproc"], cfg))
    for nnodes in cfg["fleet_nodes"]:
        print(f"bench: scale: {nnodes} stand-in nodes x {cfg['fleet_nproc']} ranks ...", flush=True)
        stand_ins.append(one(nnodes, cfg["fleet_nproc"], cfg, fleet=True))
    for found in (rows, stand_ins):
        smallest = found[0]["controller_cpu_per_node_per_s"] or 1e-9 if found else 1e-9
        for row in found:
            row["cost_per_node_vs_smallest"] = round(row["controller_cpu_per_node_per_s"] / smallest, 2)
    reason = cluster.missing_support()
    try:
        over_ssh = {"skipped": reason} if reason else ssh(cfg)
    except Exception as exc:  # noqa: BLE001 - recorded, whatever it was: the simulated nodes' rows stand
        over_ssh = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
    arrivals = [arrivals_cost(cfg["fleet_nodes"][-1], cfg["fleet_nproc"], rate, cfg["arrivals_seconds"])
                for rate in cfg["arrivals_rates"]]
    hang_look = hang_look_cost(cfg["fleet_nodes"][-1], cfg["fleet_nproc"], cfg["hang_look_seconds"], cfg["stall"])
    return {"ssh": over_ssh, "arrivals": arrivals, "hang_look": hang_look,
            "job": f"stand-in ranks (testbed/standin), {cfg['nproc']} per node, a step every "
                   f"{cfg['step_seconds']:g} s with every rank printing, stall {cfg['stall']:g} s; window "
                   f"{cfg['window']:g} s after {cfg['warmup']:g} s of warm-up",
            "cores": procs.cpu_count(), "rows": rows, "stand_in_rows": stand_ins}


if __name__ == "__main__":  # the side-by-side rows alone (arrivals, the look for a hang): python -m bench.scale
    from bench.run import profile
    scale = profile("full", "cpu")["scale"]
    print(json.dumps({"arrivals": [arrivals_cost(scale["fleet_nodes"][-1], scale["fleet_nproc"], rate,
                                                 scale["arrivals_seconds"]) for rate in scale["arrivals_rates"]],
                      "hang_look": hang_look_cost(scale["fleet_nodes"][-1], scale["fleet_nproc"],
                                                  scale["hang_look_seconds"], scale["stall"])}, indent=1))
