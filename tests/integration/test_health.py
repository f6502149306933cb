"""The health watch for real, on simulated nodes: real gloo jobs hung by real faults (a rank stuck in a
sleep, SIGSTOPped, one that skips an all_reduce and ends), each found within health.stall + 15 s with
the right rank named and every rank's stacks kept; no false alarm for ranks that compute in silence;
`harness stacks` on a running job; a slow rank named. (SSH hosts and a partition: test_health_ssh.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import REPO, assert_nothing_left, free_port, harness, worker_pid

STALL = 8
MARGIN = 15  # the bound: detection within stall + 15 s
SCRIPT = REPO / "tests" / "scripts" / "ddp_hang.py"


def hang_job(write_yaml, stall: float = STALL, nnodes: int = 2, **env: str) -> Path:
    flow = ", ".join(f"{k}: '{v}'" for k, v in env.items())
    return write_yaml(f"""
        name: hang
        nnodes: {nnodes}
        backend: gloo
        master_port: {free_port()}
        entrypoint: {{script: {SCRIPT}}}
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
    assert summary["attempts"][0]["kind"] == "hang"
    kept = runs / run.run_id / "stacks" / "attempt-0"
    assert sorted(p.name for p in kept.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"] or culprit is not None
    assert_nothing_left(run.run_id)
    status = harness("status", run.run_id, "--runs-dir", str(runs))
    assert "hang" in status.stdout, status.stdout
    return summary


# Where rank 1 sleeps: in its own data loading, or in its DataLoader worker's __getitem__ (named as the place).
STUCK = {
    "sleep": r"rank 1 \(node1 on sim1\) at .*ddp_hang.py:\d+ in load_batch: time.sleep\(3600\)",
    "loader": r"rank 1's DataLoader worker 0 \(node1 on sim1, pid \d+\) at \S*ddp_hang.py:\d+ in "
              r"Batches.__getitem__: time.sleep\(3600\)",
}


@pytest.mark.parametrize("fault", STUCK)
def test_a_rank_stuck_in_a_sleep_is_found_named_and_its_stacks_kept(fault, write_yaml, launch, tmp_path):
    run = launch(hang_job(write_yaml, FAULT=fault, FAULT_RANK="1", FAULT_STEP="20"))
    run.wait_for(r"\[rank0\]: step 10")
    began = time.time()
    text, seen = verdict(run)
    assert seen - began < STALL + MARGIN, f"found after {seen - began:.1f} s"
    assert re.match(rf"no progress for 8 s: {STUCK[fault]}; rank 0 waits in all_reduce at .*ddp_hang.py:\d+ in "
                    r"train_step", text), text
    assert_hang_recorded(run, tmp_path / "runs", culprit=1)
    kept = tmp_path / "runs" / run.run_id / "stacks" / "attempt-0"
    assert "time.sleep(3600)" in (kept / "rank1.txt").read_text()
    assert "all_reduce" in (kept / "rank0.txt").read_text()
    if fault == "loader":  # the worker's stack, after its rank's
        assert re.search(r"^rank 1's DataLoader worker 0, pid \d+, sleeping\n(.*\n)*\s+time.sleep\(3600\)",
                         (kept / "rank1.txt").read_text(), re.M)


def test_a_sigstopped_rank_is_named_stopped(write_yaml, launch, tmp_path):
    """And once the run has ended, `harness stacks` of it says where the hang's stacks are kept."""
    run = launch(hang_job(write_yaml))
    run.wait_for(r"\[rank1\]: step 10")
    pid = worker_pid(run.run_id, 0)
    os.kill(pid, signal.SIGSTOP)
    began = time.time()
    text, seen = verdict(run)
    assert seen - began < STALL + MARGIN, f"found after {seen - began:.1f} s"
    assert "rank 0 (node0 on sim0) is stopped (SIGSTOP)" in text, text
    assert re.search(r"rank 1 waits in all_reduce at .*ddp_hang.py:\d+ in train_step", text), text
    assert_hang_recorded(run, tmp_path / "runs", culprit=0)
    shown = harness("stacks", run.run_id, "--runs-dir", str(tmp_path / "runs"))
    assert shown.returncode == 2, shown
    assert "is not running (failed)" in shown.stderr and "stacks/attempt-N/" in shown.stderr, shown.stderr


def test_a_rank_that_skips_an_all_reduce_hangs_in_another_collective(write_yaml, launch, tmp_path):
    run = launch(hang_job(write_yaml, FAULT="skip", FAULT_RANK="1", FAULT_STEP="15"))
    run.wait_for(r"rank 1 skipped an all_reduce and ends")
    began = time.time()
    text, seen = verdict(run)
    assert seen - began < STALL + MARGIN, f"found after {seen - began:.1f} s"
    assert re.search(r"rank 1 waits in barrier at .*ddp_hang.py:\d+ in <module>; rank 0 waits in all_reduce at "
                     r".*ddp_hang.py:\d+ in train_step; the ranks wait in different collectives, and rank 1 got "
                     r"further in <module> \(.*ddp_hang.py:\d+, the others at :\d+\): it likely skipped a collective",
                     text), text
    summary = assert_hang_recorded(run, tmp_path / "runs", culprit=1)
    assert summary["error"], summary


def test_ranks_that_compute_in_silence_for_three_stalls_are_not_hung(write_yaml, launch):
    run = launch(hang_job(write_yaml, stall=5, FAULT="silent", SILENT_SECONDS="16"))
    assert run.finish(timeout=180) == 0, run.output
    assert "harness: hang" not in run.output and "no progress" not in run.output
    assert run.summary()["status"] == "succeeded"


def test_harness_stacks_shows_every_rank_of_a_running_job_grouped(write_yaml, launch, tmp_path):
    """Of 4 nodes: every agent asked at once, every answer within the bound."""
    run = launch(hang_job(write_yaml, nnodes=4))
    run.wait_for(r"\[rank3\]: step 10")
    began = time.monotonic()
    shown = harness("stacks", run.run_id, "--runs-dir", str(tmp_path / "runs"), timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert time.monotonic() - began < 5 * 4, "harness stacks took too long"  # the 5 s, with CI's margin
    ranks = set(map(int, re.findall(r"\b(\d+) \(node\d on sim\d, pid \d+", shown.stdout)))
    assert ranks == {0, 1, 2, 3}, shown.stdout
    assert "ddp_hang.py" in shown.stdout
    run.wait_for(r"\[rank0\]: step \d*[02468]0$")  # the job goes on
    assert run.proc.poll() is None
    kept = json.loads(next((tmp_path / "runs" / run.run_id / "stacks").glob("*/stacks.json")).read_text())
    assert set(kept) == {"0", "1", "2", "3"}


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


@contextmanager
def cpu_throttled(pid: int, share: float) -> Iterator[None]:
    """pid (every thread) held to `share` of one CPU by the kernel's CFS bandwidth control, as a throttled
    host's is: a cgroup of the cpu controller (v2 where it has one, else v1), removed afterwards."""
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        group, parent = v2 / f"harness-slow-{os.getpid()}", v2
        group.mkdir()
        (group / "cpu.max").write_text(f"{int(share * 100000)} 100000")
    else:
        parent = Path("/sys/fs/cgroup/cpu")
        assert (parent / "cpu.cfs_quota_us").exists(), "this machine has no cgroup cpu controller (v1 or v2)"
        group = parent / f"harness-slow-{os.getpid()}"
        group.mkdir()
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(share * 100000)))
    try:
        (group / "cgroup.procs").write_text(str(pid))
        yield
    finally:
        for member in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # a process that ended meanwhile
                (parent / "cgroup.procs").write_text(member)
        group.rmdir()


def test_a_throttled_rank_is_named_slow_within_a_minute(write_yaml, launch, tmp_path):
    run = launch(write_yaml(f"""
        name: slow
        nnodes: 2
        backend: gloo
        master_port: {free_port()}
        entrypoint: {{script: {SCRIPT}}}
        env: {{WORK: '300', OMP_NUM_THREADS: '1'}}
        health: {{stall: 60, slow: 20}}
        """))
    run.wait_for(r"\[rank1\]: step 10")
    with cpu_throttled(worker_pid(run.run_id, 1), 0.1):
        began = time.monotonic()
        named = run.wait_for(r"harness: slow: rank (\d) \(node\d on sim\d\): its peers wait for it (\d+)% of "
                             r"the time", timeout=120)
        assert time.monotonic() - began < 60, f"named after {time.monotonic() - began:.0f} s"
        assert named.group(1) == "1" and int(named.group(2)) >= 20, named.group(0)
        status = harness("status", run.run_id, "--runs-dir", str(tmp_path / "runs"))
        assert re.search(r"slow: rank 1: its peers wait for it [\d.]+% of the time", status.stdout), status.stdout
        # Every rank as the watch sees it: state, CPU, the step it printed and its rate, its last line.
        rows = re.findall(r"^ +(\d) node\d +sim\d +(computing|waiting) +(\d+)% +(\d+) +([\d.]+) +(\d+)s ago: "
                          r"\[rank\1\]: step (\d+)", status.stdout, re.MULTILINE)
        assert sorted(row[0] for row in rows) == ["0", "1"], status.stdout
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
    assert "slow: rank 0" not in run.output
    assert followed and all(line.startswith("[node1] [rank1]: ") for line in followed), followed[-5:]
    assert followed[-1] in run.output.splitlines()
    events = run.summary()["attempts"][0]["health"]
    assert [(e["kind"], e["rank"]) for e in events][:1] == [("slow", 1)] and events[0]["waited"] >= 20, events
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
        assert shown.returncode == 0 and time.monotonic() - began < 5 * 4, shown  # the 5 s, CI's margin
        assert set(map(int, re.findall(r"\b(\d) \(node\d on sim\d, pid", shown.stdout))) == {0, 1, 2, 3}
        run.wait_for(r"\[rank0\]: step \d+", timeout=60)
    assert run.finish(timeout=600) == 0, run.output
    assert "slow:" not in run.output and "harness: hang" not in run.output, run.output
