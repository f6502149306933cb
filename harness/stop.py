"""`harness stop RUN_ID`: end exactly one run, from any terminal."""

from __future__ import annotations

import os
import signal
import time

from harness.launch import STOP_REQUEST
from harness.procs import is_alive, kill_run_processes
from harness.runs import RunDir, write_json_atomic


def stop_run(run: RunDir, timeout: float) -> int:
    """Ask the run's controller to stop its nodes; if the controller is gone, end the nodes directly."""
    state = run.read_state()
    if state["status"] != "running":
        print(f"run {run.run_id} already ended: {state['status']}")
        return 0
    controller = state["controller"]
    if is_alive(controller["pid"], controller["start_ticks"]):
        (run.path / STOP_REQUEST).touch()
        os.kill(controller["pid"], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while is_alive(controller["pid"], controller["start_ticks"]):
            if time.monotonic() > deadline:
                print(f"harness: run {run.run_id}: controller {controller['pid']} did not stop within {timeout} s")
                return 1
            time.sleep(0.1)
        print(f"run {run.run_id} stopped")
        return 0
    killed = kill_run_processes(run.run_id)
    write_json_atomic(run.state_file, state | {"status": "stopped", "ended_at": time.time()})
    print(f"run {run.run_id}: controller was gone; ended {len(killed)} leftover process(es)")
    return 0
