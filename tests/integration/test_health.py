"""The health watch for real, on simulated nodes: real gloo jobs hung by real faults (a rank stuck in its data
loading while every rank's CPU spins, or in its DataLoader worker; a collective mismatch), each found within
health.stall + 15 s from torch's own Flight Recorder with the right rank named and every rank's stacks kept; a slow
rank of four named from its arrivals at real collectives, and `harness stacks` of that running job. What is the
harness's alone runs on the stand-in torch of testbed/standin: a hang that begins while no controller watches, and
no false alarm for a rank that computes in silence. A SIGSTOPped rank on real torch: test_health_resume.py (SSH
hosts and a partition: test_health_ssh.py)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, STANDIN_ENV, Streamed, assert_nothing_left, free_port, harness, worker_pid

STALL = 8
MARGIN = 15  # the bound: detection within stall + 15 s (bench 9: ~1.5 s past the stall at most, quiet)
SCRIPT = REPO / "tests" / "scripts" / "ddp_hang.py"
SUM_SCRIPT = REPO / "tests" / "scripts" / "ddp_sum.py"  # what the stand-in runs here: its steps, no torch import
STANDIN_RANK = REPO / "testbed" / "standin" / "rank.py"


def hang_job(write_yaml, stall: float = STALL, nnodes: int = 2, script: Path = SCRIPT, args: tuple[str, ...] = (),
             **env: str) -> Path:
    """script with args on nnodes simulated nodes, watched with health.stall; env: its environment (with
    STANDIN_ENV: on the stand-in torch)."""
    flow = ", ".join(f"{k}: '{v}'" for k, v in env.items())
    listed = ", ".join(f"'{arg}'" for arg in args)
    return write_yaml(f"""
        name: hang
        nnodes: {nnodes}
        backend: gloo
        master_port: {free_port()}
        entrypoint: {{script: {script}, args: [{listed}]}}
        health: {{stall: {stall}}}
        env: {{{flow}}}
        """)



def verdict(run) -> tuple[str, float]:
    """The hang line and when it came (seconds since the epoch)."""
    match = run.wait_for(r"harness: hang: (.*)", timeout=STALL + MARGIN + 60)
    return match.group(1), time.time()


def assert_hang_recorded(run, runs: Path, culprit: int | None) -> dict:
    assert run.finish(timeout=90) == 1
    summary = run.summary()
    failure = summary["first_failure"]
    assert failure["kind"] == "hang" and failure["rank"] == culprit, failure
    # The rank's last words before the verdict, not torchrun's reaction to the harness's stop that followed it.
    assert not any("SignalException" in line or "got signal" in line for line in failure["last_lines"]), failure
    assert summary["attempts"][0]["kind"] == "hang"
    # The stop that followed the verdict may break a peer's connection before its TERM comes: no failure of its own.
    assert [f["kind"] for f in summary["attempts"][0]["failures"]] == ["hang"], summary["attempts"][0]["failures"]
    kept = runs / run.run_id / "stacks" / "attempt-0"
    assert sorted(p.name for p in kept.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"] or culprit is not None
    assert_nothing_left(run.run_id)
    status = harness("status", run.run_id, "--runs-dir", str(runs))
    assert "hang" in status.stdout, status.stdout
    # One figure for the hang, the stream's and status's: when it was found.
    said = f"hung after {failure['after_s']} s"
    assert said in run.output and re.findall(r"hung after [\d.]+ s", status.stdout) == [said], status.stdout
    return summary


# Where rank 1 is while rank 0 waits for it in all_reduce #N: asleep in its own data loading while every
# rank's CPU is kept busy by a polling thread (as NCCL's wait in a CUDA synchronization keeps it: only the
# collective that never completes shows the hang), or waiting for its DataLoader worker, asleep in __getitem__.
STUCK = {
    "spin": r"at .*ddp_hang.py:\d+ in load_batch: time.sleep\(3600\)",
    "loader": r"waiting for its DataLoader worker 0 \(pid \d+\) at \S*ddp_hang.py:\d+ in Batches.__getitem__: "
              r"time.sleep\(3600\)",
}


@pytest.mark.parametrize("fault", STUCK)
def test_a_rank_stuck_before_its_collective_is_found_named_behind_and_its_stacks_kept(fault, write_yaml, launch,
                                                                                      tmp_path):
    run = launch(hang_job(write_yaml, FAULT=fault, FAULT_RANK="1", FAULT_STEP="20"))
    run.wait_for(r"\[rank0\]: step 10")
    began = time.time()
    text, seen = verdict(run)
    assert seen - began < STALL + MARGIN, f"found after {seen - began:.1f} s"  # guard: not gloo's 30 min timeout
    assert re.match(rf"no progress for 8 s: rank 0 waits in all_reduce #(\d+) at .*ddp_hang.py:\d+ in train_step; "
                    rf"rank 1 \(node1 on sim1\) has not reached #\1, {STUCK[fault]} \(stacks in ", text), text
    assert_hang_recorded(run, tmp_path / "runs", culprit=1)
    kept = tmp_path / "runs" / run.run_id / "stacks" / "attempt-0"
    assert "time.sleep(3600)" in (kept / "rank1.txt").read_text()
    assert "all_reduce" in (kept / "rank0.txt").read_text()
    collectives = {rank: answer["collectives"] for rank, answer in
                   json.loads((kept / "stacks.json").read_text()).items()}
    assert [e["done"] for e in collectives["0"]][-2:] == [True, False], collectives["0"]
    assert all(e["done"] for e in collectives["1"]), collectives["1"]
    assert re.search(r"^rank 0's last collectives \(Flight Recorder\):\n(    #\d+ all_reduce \[\[100, 100\]\] completed\n)+"
                     r"    #\d+ all_reduce \[\[100, 100\]\] unfinished\n\Z", (kept / "rank0.txt").read_text(), re.M)
    if fault == "loader":  # the worker's stack, after its rank's
        assert re.search(r"^rank 1's DataLoader worker 0, pid \d+, sleeping\n(.*\n)*\s+time.sleep\(3600\)",
                         (kept / "rank1.txt").read_text(), re.M)


def test_a_hang_that_begins_while_no_controller_watches_is_named_once_one_attaches(write_yaml, launch, tmp_path):
    """Rank 0 SIGSTOPped after its controller was killed: the samples its agent kept meanwhile reach the controller
    that attaches, whose health watch names the hang as it would have (the stall already seen in them). On the
    stand-in torch: what the agents keep and hand over is the harness's; a stopped rank reads alike on either."""
    run = launch(hang_job(write_yaml, script=SUM_SCRIPT, **STANDIN_ENV, STEPS="100000", STEP_SECONDS="0.05"))
    run.wait_for(r"\[rank0\]: step 10 ")
    run.kill_group()
    os.kill(worker_pid(run.run_id, 0), signal.SIGSTOP)
    runs = tmp_path / "runs"
    attached = Streamed([sys.executable, "-m", "harness.cli", "attach", run.run_id, "--runs-dir", str(runs)])
    try:
        text = attached.wait_for(r"harness: hang: (.*)", timeout=STALL + MARGIN + 60).group(1)
        assert re.match(r"no progress for 8 s: rank 0 \(node0 on sim0\) is stopped \(SIGSTOP\)", text), text
        assert attached.finish(timeout=90) == 1, attached.output
    finally:
        attached.kill_group()
    summary = json.loads((runs / run.run_id / "summary.json").read_text())
    failure = summary["first_failure"]
    assert (failure["kind"], failure["rank"], len(summary["attempts"])) == ("hang", 0, 1), failure
    assert summary["attempts"][0]["unwatched"], summary["attempts"][0]
    assert_nothing_left(run.run_id)


def test_a_collective_mismatch_names_both_sides(write_yaml, launch, tmp_path):
    """Rank 0 broadcasts while rank 1 all-reduces, in the two branches of an if/else: gloo completes neither side,
    not even the broadcast's root, which only sends (the other branch order, where each side plainly waits for the
    other's data, gives these words the other way round: unit/test_health_rules.py), and the verdict names both
    collectives and neither rank as the culprit. Once the run has ended, `harness stacks` of it says where the
    hang's stacks are kept."""
    run = launch(hang_job(write_yaml, FAULT="mismatch", FAULT_STEP="15", SWAP="1"))
    run.wait_for(r"\[rank0\]: step 10")
    began = time.time()
    text, seen = verdict(run)
    assert seen - began < STALL + MARGIN, f"found after {seen - began:.1f} s"  # guard: not gloo's 30 min timeout
    assert re.match(r"no progress for 8 s: collective mismatch at #\d+: rank 0 in broadcast at \S*ddp_hang.py:\d+ in "
                    r"sync_metrics, rank 1 in all_reduce at \S*ddp_hang.py:\d+ in sync_metrics: the program calls "
                    r"different collectives on different ranks \(stacks in ", text), text
    summary = assert_hang_recorded(run, tmp_path / "runs", culprit=None)
    assert summary["error"], summary
    shown = harness("stacks", run.run_id, "--runs-dir", str(tmp_path / "runs"))
    assert shown.returncode == 2, shown
    assert "is not running (failed)" in shown.stderr and "stacks/attempt-N/" in shown.stderr, shown.stderr


def test_a_rank_that_computes_in_silence_for_three_stalls_is_not_hung(write_yaml, launch):
    """One rank computes for 10 CPU-seconds, printing nothing and calling no collective (health.stall 3): its CPU
    time is its progress. On the stand-in torch, one rank: what is judged is each rank's CPU as its agent samples it,
    whatever computes (the stall rules: unit/test_health_rules.py)."""
    run = launch(hang_job(write_yaml, stall=3, nnodes=1, script=STANDIN_RANK, **STANDIN_ENV,
                          args=("--steps", "1", "--step-seconds", "10", "--busy-ms", "10000")))
    assert run.finish(timeout=180) == 0, run.output
    assert "harness: hang" not in run.output and "no progress" not in run.output
    assert "[rank0]: epoch 1/1 step 1/1 " in run.output, run.output  # its silence ended after the compute
    assert run.summary()["status"] == "succeeded"


def top_in_a_terminal(run_id: str, runs: Path) -> str:
    """`harness top` in a terminal (a pty) until it has drawn twice, then q: what it drew. It must quit."""
    main, terminal = os.openpty()
    top = subprocess.Popen([sys.executable, "-m", "harness.cli", "top", run_id, "--runs-dir", str(runs)],
                           stdin=terminal, stdout=terminal, stderr=terminal, start_new_session=True)
    os.close(terminal)
    drawn, deadline = b"", time.monotonic() + 60
    try:
        while drawn.count(b"\x1b[2J") < 2 and time.monotonic() < deadline:
            if select.select([main], [], [], 1)[0]:
                drawn += os.read(main, 65536)
        os.write(main, b"q")
        assert top.wait(timeout=30) == 0
    finally:
        top.kill()
        os.close(main)
    return drawn.decode(errors="replace")


def test_a_slow_rank_of_four_is_named_from_its_arrivals_within_a_minute(write_yaml, launch, tmp_path):
    """Rank 1 takes 0.1 s longer per step, asleep, as a rank waits for a slower GPU: it arrives last at every
    all_reduce and is named by its arrival times, which see what CPU time cannot (every rank sleeps). While it runs on,
    `harness stacks` of the running job asks its 4 nodes' agents at once, every answer within the bound. slow is not in
    restarts.on: the slowness is weighed once it lasted health.slow_for, said, and nothing is done about it."""
    run = launch(write_yaml(f"""
        name: slow
        nnodes: 4
        backend: gloo
        master_port: {free_port()}
        entrypoint: {{script: {SCRIPT}}}
        env: {{SLOW_RANK: '1', SLOW_SECONDS: '0.1', OMP_NUM_THREADS: '1'}}
        health: {{stall: 60, slow: 20, slow_for: 10}}
        """))
    run.wait_for(r"\[rank1\]: step 0$")
    began = time.monotonic()
    named = run.wait_for(r"harness: slow: rank (\d) \(node\d on sim\d\): its peers wait for it (\d+)% of the time "
                         r"\(over the last 20 s, by when it arrives at its collectives; -?\d+% by CPU time\); "
                         r"(the job runs at [\d.]+x its pace before \d\d:\d\d:\d\d \(\S+ -> \S+ steps/s\)|"
                         r"its pace before \d\d:\d\d:\d\d is not known yet \(too few step lines\))$", timeout=120)
    # guard: named after its 20 s window of arrivals and seconds more (quiet); CPU time alone never names it
    assert time.monotonic() - began < 60, f"named after {time.monotonic() - began:.0f} s"
    assert named.group(1) == "1" and int(named.group(2)) >= 20, named.group(0)
    # Named at least SLOW_CONFIRM after its onset, so weighed at once (slow_for 10): said, and the job goes on.
    weighed = run.wait_for(r"^harness: slow: rank 1 \(node1 on sim1\) for \d+ s: .*; the job goes on: (.*)$", after=named)
    began = time.monotonic()
    shown = harness("stacks", run.run_id, "--runs-dir", str(tmp_path / "runs"), timeout=60)
    assert shown.returncode == 0, shown.stderr
    # guard: no node waited out its 20 s to answer (STACKS_SECONDS); the 5 s with CI's margin
    assert time.monotonic() - began < 5 * 4, "harness stacks took too long"
    ranks = set(map(int, re.findall(r"\b(\d+) \(node\d on sim\d, pid \d+", shown.stdout)))
    assert ranks == {0, 1, 2, 3} and "ddp_hang.py" in shown.stdout, shown.stdout
    kept = json.loads(next((tmp_path / "runs" / run.run_id / "stacks").glob("*/stacks.json")).read_text())
    assert set(kept) == {"0", "1", "2", "3"}
    status = harness("status", run.run_id, "--runs-dir", str(tmp_path / "runs"))
    assert re.search(r"slow: rank 1: its peers wait for it [\d.]+% of the time", status.stdout), status.stdout
    # Every rank as the watch sees it: state, CPU, the step it printed and its rate, its last line.
    rows = re.findall(r"^ +(\d) node\d +sim\d +(computing|waiting) +(\d+)% +(\d+) +([\d.]+) +(\d+)s ago: "
                      r"\[rank\1\]: step (\d+)", status.stdout, re.MULTILINE)  # step 10, 20, ...: rate and line
    assert sorted(row[0] for row in rows) == ["0", "1", "2", "3"], status.stdout
    assert all(row[3] == row[6] and float(row[4]) > 0 for row in rows), status.stdout
    shown = harness("top", run.run_id, "--once", "--runs-dir", str(tmp_path / "runs"))
    assert status.stdout.splitlines()[0] in shown.stdout and "[node1] [rank1]: step" in shown.stdout, shown.stdout
    screens = top_in_a_terminal(run.run_id, tmp_path / "runs")
    assert screens.count("\x1b[2J") >= 2 and "RANK NODE" in screens, screens  # redrawn until q
    follow = subprocess.Popen([sys.executable, "-m", "harness.cli", "logs", run.run_id, "--follow", "--rank", "1",
                               "--runs-dir", str(tmp_path / "runs")], stdout=subprocess.PIPE, text=True)
    try:
        assert harness("stop", run.run_id, "--runs-dir", str(tmp_path / "runs")).returncode == 0
        assert run.finish(timeout=30) == 130
        followed = follow.communicate(timeout=30)[0].splitlines()  # it ends once the run has ended
    finally:
        follow.kill()
    assert not re.search(r"slow: rank [023]", run.output), run.output
    assert followed and all(line.startswith("[node1] [rank1]: ") for line in followed), followed[-5:]
    assert followed[-1] in run.output.splitlines()
    summary = run.summary()
    events = summary["attempts"][0]["health"]
    assert [(e["kind"], e["rank"]) for e in events][:2] == [("slow", 1), ("weighed", 1)], events
    assert events[0]["waited"] >= 20 and events[1]["acted"] is False, events
    assert events[1]["at"] == events[0]["at"], "weighed as it was named: SLOW_CONFIRM after its onset, past slow_for"
    assert events[1]["text"] == weighed[0].removeprefix("harness: "), events
    assert len(summary["attempts"]) == 1 and summary["attempts"][0]["kind"] != "slow", summary["attempts"]
    assert "stopping the job" not in run.output, run.output
    after = harness("status", run.run_id, "--runs-dir", str(tmp_path / "runs")).stdout
    assert re.search(r"^  at \d\d:\d\d:\d\d: slow: rank 1 \(node1 on sim1\): its peers wait for it", after, re.M), after


@pytest.mark.soak
def test_a_healthy_four_rank_job_runs_five_minutes_with_no_slow_rank_named(write_yaml, launch, tmp_path):
    """Also `harness stacks` of 4 nodes, three times along the way, each well within its bound."""
    run = launch(write_yaml(f"""
        name: healthy
        nnodes: 4
        backend: gloo
        master_port: {free_port()}
        entrypoint: {{script: {SCRIPT}}}
        env: {{WORK: '100', OMP_NUM_THREADS: '1', RUN_SECONDS: '300'}}
        health: {{stall: 60, slow: 20}}
        """))
    run.wait_for(r"\[rank3\]: step 10")
    for _ in range(3):
        began = time.monotonic()
        shown = harness("stacks", run.run_id, "--runs-dir", str(tmp_path / "runs"), timeout=60)
        # guard: no node waited out its 20 s to answer (STACKS_SECONDS); the 5 s with CI's margin
        assert shown.returncode == 0 and time.monotonic() - began < 5 * 4, shown
        assert set(map(int, re.findall(r"\b(\d) \(node\d on sim\d, pid", shown.stdout))) == {0, 1, 2, 3}
        run.wait_for(r"\[rank0\]: step \d+", timeout=60)
    assert run.finish(timeout=600) == 0, run.output
    assert "slow:" not in run.output and "harness: hang" not in run.output, run.output
