"""Run records: typed, validated on reading, and one damaged record never hides the other runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from harness.node.proctable import start_ticks
from harness.record.index import create_run_dir, list_runs
from harness.record.rundir import RunDir
from harness.record.schema import (
    Attempt,
    ControllerId,
    Failure,
    FailureKind,
    HealthEvent,
    HealthEventKind,
    LiveHealth,
    RankRow,
    RecordedNode,
    RecordError,
    RunState,
    RunStatus,
    RunSummary,
    Slowed,
)
from harness.view.status import node_lines, run_details

from conftest import harness


def _state(run_id: str, status: RunStatus, started_at: float, controller: ControllerId) -> RunState:
    return RunState(run_id=run_id, name="job", mode="local", status=status, started_at=started_at, nnodes=2,
                    world_size=4, controller=controller, hosts=["localhost", "localhost"])


def _ended_process() -> ControllerId:
    """The identity of a process that has exited: a controller that is gone."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    identity = ControllerId(process.pid, start_ticks(process.pid))
    process.kill()
    process.wait()
    return identity


def _summary(state: RunState, run: RunDir) -> RunSummary:
    node = RecordedNode(node_rank=1, host="localhost", ranks=[2, 3], exit_code=1, signal=None, error=None,
                      duration_s=4.5, log=str(run.log_file(1)))
    failure = Failure(node_rank=1, host="localhost", ranks=[2, 3], rank=3, rank_exit_code=1, exit_code=1,
                      description="exit code 1", after_s=4.5, last_lines=["[rank3]: boom"],
                      kind=FailureKind.PROGRAM, evidence="rank 3 exit code 1")
    attempt = Attempt(attempt=0, hosts=["localhost", "localhost"], status=RunStatus.FAILED,
                      started_at=state.started_at, ended_at=state.started_at + 5, nodes=[node], failures=[failure],
                      kind=FailureKind.PROGRAM, down=[], preflight_s=0.01, teardown_s=0.5)
    return RunSummary(run_id=state.run_id, name=state.name, status=RunStatus.FAILED, exit_code=1,
                      started_at=state.started_at, ended_at=state.started_at + 5, duration_s=5.0, nodes=[node],
                      first_failure=failure, attempts=[attempt], reason="restarts are off (restarts.max: 0)")


def test_records_round_trip_and_keep_their_json_shape(tmp_path: Path) -> None:
    run = create_run_dir(tmp_path, "job-1")
    state = _state("job-1", RunStatus.FAILED, 1000.0, ControllerId(4242, 17))
    summary = _summary(state, run)
    run.write_state(state)
    run.write_summary(summary)
    assert run.read_state() == state and run.read_summary() == summary
    raw = json.loads(run.summary_file.read_text())
    assert raw["status"] == "failed" and raw["first_failure"]["rank"] == 3 and raw["nodes"][0]["ranks"] == [2, 3]
    assert raw["attempts"][0]["kind"] == raw["first_failure"]["kind"] == "program"
    assert json.loads(run.state_file.read_text())["controller"] == {"pid": 4242, "start_ticks": 17, "host": None}
    with pytest.raises(Exception, match="already taken"):
        create_run_dir(tmp_path, "job-1")


def test_status_lists_every_run_when_one_record_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    good = create_run_dir(root, "job-good")
    good.write_state(_state("job-good", RunStatus.SUCCEEDED, 1000.0, ControllerId(1, 1)))
    lost = create_run_dir(root, "job-lost")
    lost.write_state(_state("job-lost", RunStatus.RUNNING, 1001.0, _ended_process()))
    (root / "job-torn").mkdir()
    (root / "job-torn" / "state.json").write_text('{"run_id": "job-torn", "status": "runn')
    (root / "job-old").mkdir()
    (root / "job-old" / "state.json").write_text(json.dumps({"run_id": "job-old", "status": "running"}))

    listing = harness("status", "--runs-dir", str(root))
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert set(rows) == {"job-good", "job-lost", "job-torn", "job-old"}
    assert rows["job-good"].split()[1] == "succeeded" and rows["job-lost"].split()[1] == "lost"
    assert "unreadable" in rows["job-torn"] and f"{root}/job-torn/state.json: not a valid run record" in rows["job-torn"]
    assert "(name: Field required)" in rows["job-old"]
    assert [e.run.run_id for e in list_runs(root)][:2] == ["job-good", "job-lost"]  # readable ones by start time

    detail = harness("status", "job-torn", "--runs-dir", str(root))
    assert detail.returncode == 2
    assert detail.stderr.startswith(f"harness: error: {root}/job-torn/state.json: not a valid run record")
    assert harness("stop", "job-old", "--runs-dir", str(root)).returncode == 2


def test_a_record_with_a_wrong_status_is_refused(tmp_path: Path) -> None:
    run = create_run_dir(tmp_path, "job-x")
    run.write_state(_state("job-x", RunStatus.SUCCEEDED, 1.0, ControllerId(1, 1)))
    run.state_file.write_text(run.state_file.read_text().replace('"succeeded"', '"exploded"'))
    with pytest.raises(RecordError, match=r"status: Input should be 'running', 'succeeded'"):
        run.read_state()


def test_status_shows_each_nodes_real_end_and_the_failing_ranks_own_code(tmp_path: Path) -> None:
    """A node that failed: its rank's own code (torchrun's is 1); the other: stopped by the harness."""
    run = create_run_dir(tmp_path, "job-failed")
    state = _state("job-failed", RunStatus.FAILED, 1000.0, ControllerId(1, 1))
    failed = _summary(state, run)
    failure = replace(failed.first_failure, rank_exit_code=3, description="exit code 3")
    stopped = RecordedNode(node_rank=0, host="localhost", ranks=[0, 1], exit_code=None, signal="SIGTERM", error=None,
                         duration_s=4.6, log=str(run.log_file(0)))
    nodes = [stopped, failed.nodes[0]]
    run.write_state(state)
    run.write_summary(replace(failed, nodes=nodes, first_failure=failure,
                              attempts=[replace(failed.attempts[0], nodes=nodes, failures=[failure])]))
    detail = run_details(run)
    assert ("  node0 on localhost: stopped by the harness after the first failure (torchrun's signal SIGTERM) after "
            "4.6 s") in detail, detail
    assert "  node1 on localhost: failed: rank 3 exit code 3 after 4.5 s" in detail, detail
    assert "running" not in detail


@pytest.mark.parametrize(("status", "why"), [(RunStatus.INTERRUPTED, "on Ctrl-C or SIGTERM to the controller"),
                                             (RunStatus.STOPPED, "by `harness stop`")])
def test_status_says_what_stopped_the_nodes_of_a_run_that_was_stopped(tmp_path: Path, status: RunStatus,
                                                                     why: str) -> None:
    """Ctrl-C and `harness stop` take one path (run/stopper.stop_on_signals); the record tells them apart."""
    run = create_run_dir(tmp_path, "job-stopped")
    state = _state("job-stopped", status, 1000.0, ControllerId(1, 1))
    node = RecordedNode(node_rank=0, host="sim0", ranks=[0], exit_code=None, signal="SIGTERM", error=None,
                        duration_s=4.6, log=str(run.log_file(0)))
    run.write_state(state)
    run.write_summary(replace(_summary(state, run), status=status, nodes=[node], first_failure=None, attempts=[]))
    detail = run_details(run)
    assert detail.startswith(f"run job-stopped: {status.value}"), detail
    assert f"  node0 on sim0: stopped {why} (torchrun's signal SIGTERM) after 4.6 s" in detail, detail
    assert "running" not in detail


def test_status_of_a_lost_run_reads_its_nodes_from_the_process_table(tmp_path: Path) -> None:
    """No summary, the controller gone: a node with no process left is lost; one with a process left says
    so and how to end it."""
    run = create_run_dir(tmp_path, "job-lost")
    run.write_state(_state("job-lost", RunStatus.RUNNING, 1000.0, _ended_process()))
    env = {**os.environ, "HARNESS_RUN_ID": "job-lost", "NODE_RANK": "1", "HARNESS_ATTEMPT": "0"}
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        detail = run_details(run)
    finally:
        left.kill()
        left.wait()
    assert detail.startswith("run job-lost: lost"), detail
    assert "  node0 on localhost: lost (its controller was killed; no process of it is left); log" in detail, detail
    assert ("  node1 on localhost: 1 process(es) of it still running without a controller: `harness stop job-lost` "
            "ends them; log") in detail, detail
    run.write_state(replace(run.read_state(), status=RunStatus.STOPPED))  # what `harness stop` of a lost run leaves
    assert "  node1 on localhost: stopped by `harness stop` after its controller was lost" in run_details(run)


def test_a_lost_run_that_is_stopped_ended_when_it_last_wrote_and_its_duration_stays(tmp_path: Path) -> None:
    """A detached run whose controller was SIGKILLed 22 s after it began, stopped much later: stopped, 22 s."""
    root = tmp_path / "runs"
    run = create_run_dir(root, "job-lost")
    began = time.time() - 300
    run.write_state(_state("job-lost", RunStatus.RUNNING, began, _ended_process()))
    (run.path / "node0.log").write_text("[rank0]: step 1\n")
    for path in run.path.iterdir():
        os.utime(path, (began + 22, began + 22))
    assert harness("stop", "job-lost", "--runs-dir", str(root)).returncode == 0
    state = run.read_state()
    assert (state.status, state.ended_at) == (RunStatus.STOPPED, began + 22)
    rows = [harness("status", "--runs-dir", str(root)).stdout for _ in range(2)]
    assert rows[0] == rows[1] and "     22.0s" in rows[0], rows


def test_status_says_what_a_slow_node_costs_while_it_runs_and_the_harnesss_stop_for_it_after(tmp_path: Path) -> None:
    """While the run runs, the slowness of the rank named slow, as health.json says it; after, the attempt the
    harness stopped for it, with the pace, and the weighing in full among the verdicts."""
    now = time.time()
    run = create_run_dir(tmp_path, "job-slow")
    me = ControllerId(os.getpid(), start_ticks(os.getpid()))
    run.write_state(_state("job-slow", RunStatus.RUNNING, now - 60, me))
    run.write_health(LiveHealth(attempt=0, t=now, slow={1: 48.0}, started_at=now - 59,
                                ranks={1: RankRow("node0", "sim0", "computing")}, slowed=Slowed(1, now - 30, 39.2, 19.9)))
    onset = time.strftime("%H:%M:%S", time.localtime(now - 30))
    detail = run_details(run)
    assert "  slow: rank 1: its peers wait for it 48% of the time\n" in detail, detail
    assert (f"  slowed: rank 1 (node0 on sim0) for 30 s: the job runs at 0.51x its pace before {onset} (39.2 -> 19.9 "
            f"steps/s)\n") in detail, detail
    run.write_health(replace(run.read_health(0), slowed=Slowed(1, now - 3, None, None)))
    onset = time.strftime("%H:%M:%S", time.localtime(now - 3))
    assert f"  slowed: rank 1 (node0 on sim0) for 3 s: its pace before {onset} is not known yet (too few step " \
           f"lines)\n" in run_details(run)

    weighed = ("slow: rank 1 (node0 on sim0) for 30 s: the slowness costs 12 s by the job's end (...); a restart without "
               "it 8 s (...): a restart without it costs less; stopping the job to restart without sim0 (restarts.on: "
               "slow)")
    slow = Failure(node_rank=0, host="sim0", ranks=[0, 1], rank=1, rank_exit_code=None, exit_code=None,
                   description="slow", after_s=31.0, last_lines=[], kind=FailureKind.SLOW,
                   evidence=weighed.removeprefix("slow: "), host_down=True)
    ended = _summary(run.read_state(), run)
    first = replace(ended.attempts[0], hosts=["sim0", "sim1"], failures=[slow], kind=FailureKind.SLOW, down=["sim0"],
                    health=[HealthEvent(now - 29, HealthEventKind.SLOW, "slow: rank 1 ...", 1, 48.0, now - 30, 39.2, 19.9),
                            HealthEvent(now, HealthEventKind.WEIGHED, weighed, 1, None, now - 30, 39.2, 19.9, acted=True)])
    second = replace(ended.attempts[0], attempt=1, hosts=["sim2", "sim1"], failures=[], kind=None,
                     status=RunStatus.SUCCEEDED)
    run.write_state(replace(run.read_state(), controller=ControllerId(1, 1), status=RunStatus.SUCCEEDED))
    run.write_summary(replace(ended, status=RunStatus.SUCCEEDED, first_failure=None, attempts=[first, second]))
    detail = run_details(run)
    assert "  attempt 0 on sim0, sim1: stopped for sim0's slowness (rank 1 on node0: the job at 0.51x its pace before); " \
           "took sim0 out\n" in detail, detail
    assert f"(attempt 0): {weighed}\n" in detail, detail


def test_health_json_is_written_and_read_through_its_schema_and_an_older_file_still_reads(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    health = LiveHealth(attempt=1, t=5.0, slow={1: 50.0}, ranks={0: RankRow("node0", "sim0", "computing", cpu=0.5,
                                                                            step=3)})
    run.write_health(health)
    assert run.read_health(1) == health
    assert run.read_health(0) is None, "another attempt's"
    # as the controller wrote it before health.json had a schema: compact, every key a string
    run.health_file.write_text(
        '{"attempt": 0, "t": 1.5, "slow": {"1": 72.5}, "hang": null, "ranks": {"0": {"node": "node0", "host": "sim0", '
        '"state": "waiting", "cpu": 0.1, "busy": 0.05, "last_line": "[rank0]: step 3", "last_line_at": 1.2, "step": 3, '
        '"step_rate": 0.5}}}')
    old = run.read_health(0)
    assert old is not None and old.slow == {1: 72.5} and old.ranks[0].step == 3 and old.ranks[0].state == "waiting"
    run.health_file.write_text('{"attempt": 0, "ranks": {"0": {"no": "node"}}}')
    assert run.read_health(0) is None, "a damaged file is no health, not an error"


def test_status_names_many_nodes_by_state_and_the_odd_ones_each():
    """Of 256 nodes, status says a line per state, its nodes as ranges; a node alone in its state as always."""
    logs = Path("runs/job")
    nodes = {rank: (f"sim{rank}", "running", logs / f"node{rank}.log", "") for rank in range(256)}
    nodes[8] = ("sim8", "lost", logs / "node8.log", " after 3.5 s")
    assert node_lines(nodes) == ["  nodes 0-7,9-255 (255, on sim0...): running; logs runs/job/node<N>.log",
                                 "  node8 on sim8: lost after 3.5 s; log runs/job/node8.log"]
    few = {rank: nodes[rank] for rank in range(2)}
    assert node_lines(few) == ["  node0 on sim0: running; log runs/job/node0.log",
                               "  node1 on sim1: running; log runs/job/node1.log"]
