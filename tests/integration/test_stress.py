"""The controller SIGKILLed again and again while the CPU is saturated: no process of any run is left.

Local nodes run under the node agent, whose stdin is a pipe from the controller; the kernel closes
it when the controller dies, however it dies, and the agent stops its node (at once: supervision.grace 0;
with a grace it holds it that long first, which test_recovery.py proves). This must hold on a busy
machine, where the old mechanism (a parent-death signal to torchrun) leaked workers.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import STOP_GRACE, Launch, ddp_job, leftover

ROUNDS = 10
BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def saturated_cpu() -> Iterator[None]:
    """One CPU-bound process per core, for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True)
            for _ in range(len(os.sched_getaffinity(0)))]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _gone_after(run_id: str, limit: float) -> float | None:
    """Seconds until no process of the run is left, or None if some are still there after limit."""
    started = time.monotonic()
    while leftover(run_id):
        if time.monotonic() - started > limit:
            return None
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.soak  # it saturates every core for a minute: in `make test`, the other tests' timings would pay
def test_sigkilled_controller_leaves_nothing_ten_times_under_load(write_yaml, tmp_path: Path) -> None:
    chance = random.Random(20261122)  # kill moments vary, and the same ones every run
    limit = STOP_GRACE + 2
    results: list[tuple[str, int, float | None]] = []
    runs: list[Launch] = []
    try:
        with saturated_cpu():
            for round_ in range(ROUNDS):
                job = ddp_job(write_yaml, STEPS="100000", STEP_SECONDS="0.05")
                job.write_text(job.read_text() + "supervision: {grace: 0}\n")  # a lost controller's nodes stop at once
                run = Launch(job, tmp_path / "runs")
                runs.append(run)
                run_id = run.run_id
                if round_ % 2:  # deep in training: workers in sessions of their own, mid-collective
                    run.wait_for(r"\[rank1\]: rank 1/2 up", timeout=180)
                else:  # anywhere from the agents' start through torchrun's rendezvous
                    deadline = time.monotonic() + 120
                    while len(leftover(run_id)) < 2 and time.monotonic() < deadline:
                        time.sleep(0.02)
                    time.sleep(chance.uniform(0, 2.0))
                alive = len(leftover(run_id))
                os.kill(run.proc.pid, signal.SIGKILL)
                results.append((run_id, alive, _gone_after(run_id, limit)))
                run.finish()
        report = "\n".join(f"{run_id}: {alive} processes at the kill, gone after "
                           + (f"{took:.2f} s" if took is not None else f"more than {limit} s")
                           for run_id, alive, took in results)
        print(report)  # shown with `pytest -rP`: the figures behind the claim
        assert all(alive >= 2 for _, alive, _ in results), report
        # guard: the agents end their nodes within stop_grace (+2 s), not never; this soak test's load is the point
        assert all(took is not None for _, _, took in results), report
        assert [run_id for run_id, _, _ in results if leftover(run_id)] == [], report
    finally:
        for run in runs:
            run.cleanup()
