"""A hang that restarts: a rank stopped (SIGSTOP) mid-run makes no progress, the health watch calls the
job hung, keeps every rank's stack and stops it, and with `hang` in restarts.on the next attempt resumes
from the newest checkpoint and ends bitwise equal to a run that never failed (resume_job.py)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import yaml

from conftest import assert_nothing_left, harness, worker_pid
from resume_job import KILL_AT, assert_same_weights, final_weights, payload_job

STALL = 10
DETECT_WITHIN = STALL + 15  # seconds from the SIGSTOP to the verdict, on a busy 2-core machine


def hang_restarting_job(root: Path) -> Path:
    """The resumable payload job, restarted after infrastructure failures and hangs, watched with a short stall."""
    path = payload_job(root)
    spec = yaml.safe_load(path.read_text())
    spec["restarts"] = {"max": 2, "on": ["infra", "hang"], "backoff": 0}
    spec["health"] = {"stall": STALL}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_stopped_rank_is_a_hang_and_the_restart_resumes_bitwise_equal(uninterrupted, launch, tmp_path):
    run = launch(hang_restarting_job(tmp_path / "job"))
    run.wait_for(KILL_AT, timeout=240)
    stopped_pid = worker_pid(run.run_id, 1)
    os.kill(stopped_pid, signal.SIGSTOP)
    stopped_at, stopped_wall = time.monotonic(), time.time()
    verdict = run.wait_for(r"^harness: hang: (no progress for .*?) \(stacks in (\S+)/\)$", timeout=DETECT_WITHIN + 30)
    # guard: the watch's stall + 15 s (~1.5 s past the stall on a quiet machine: bench 9), not gloo's 30 min timeout
    assert time.monotonic() - stopped_at < DETECT_WITHIN, f"hang seen {time.monotonic() - stopped_at:.1f} s after"
    assert run.finish(timeout=300) == 0, run.output
    assert_same_weights(uninterrupted, final_weights(tmp_path / "job"))

    assert re.fullmatch(rf"no progress for {STALL} s: rank 1 \(node1 on sim1\) is stopped \(SIGSTOP\) .+; "
                        rf"rank 0 waits .+", verdict.group(1)), verdict.group(1)
    summary = run.summary()
    assert summary["status"] == "succeeded", summary
    first, second = summary["attempts"]
    assert (first["status"], first["kind"], second["status"]) == ("failed", "hang", "succeeded"), summary["attempts"]
    failure = first["failures"][0]
    assert (failure["kind"], failure["node_rank"], failure["rank"]) == ("hang", 1, 1), failure
    assert failure["evidence"] == verdict.group(1)
    assert first["started_at"] + failure["after_s"] - stopped_wall < DETECT_WITHIN  # guard: the same, as recorded
    assert re.search(r"harness: attempt 0 failed at the hang level .*; restart 1 of 2", run.output), run.output
    assert re.search(rf"harness: run {run.run_id} attempt 1, 2 node\(s\)", run.output), run.output
    # from a regular checkpoint written after step 11, or a just-in-time one of the last step (rank 0, its peer's
    # collective lost, saved it: the stop SIGKILLed the stopped rank)
    resume = re.search(r"\[rank0\]: resume: epoch 1/\d+ step (\d+)/\d+ \(global step \1\) from \S+/ckpt-\d+(\.jit)?\.pt",
                       run.output)
    resumed, just_in_time = int(resume.group(1)), resume.group(2) is not None
    assert resumed == first["progress"]["last_step"] if just_in_time else resumed in range(8, 64, 4), resume.group(0)

    # Where the time went: every second in one bucket; hung from the last step to the verdict (the stall, and
    # up to a step's time before the SIGSTOP; less by up to a sample interval when rank 0's last step line, of a
    # step the stopped rank had done its part in, came after that rank's last busy sample), restarting from the
    # verdict to the next attempt's first step.
    spent, hang_at = summary["goodput"]["seconds"], first["started_at"] + failure["after_s"]
    assert sum(spent.values()) == pytest.approx(summary["duration_s"], rel=0.01), spent
    assert STALL - 1 <= spent["hung"] < DETECT_WITHIN + 5, spent  # guard: the detection bound and a step before it
    assert spent["hung"] == pytest.approx(hang_at - first["progress"]["last_at"], abs=0.01), (spent, first)
    assert spent["restarting"] == pytest.approx(second["progress"]["first_at"] - hang_at, abs=0.01), spent
    assert spent["training"] > 0 and spent["start-up"] > 0 and spent["ending"] > 0, spent
    # a checkpoint every 4 steps, each saying how long it took (`checkpoint: 8 steps saved in 0.012 s`; the stopped
    # rank 1 may hold rank 0 back before step 12's)
    assert re.search(r"^\[node0\] \[rank0\]: checkpoint: 8 steps saved in \d+\.\d{3} s$", run.output, re.M)
    saving = first["progress"]["saving_s"] + second["progress"]["saving_s"]
    assert saving > 0 and spent["checkpoint"] == pytest.approx(saving, abs=0.01), (spent, first, second)
    # the attempt's count starts at the resume line's step, which is no step taken: its first step is the next
    reached, redone = first["progress"]["last_step"], second["restart"]["steps_redone"]
    assert second["progress"]["resumed_step"] == resumed < second["progress"]["first_step"], second
    assert resumed <= reached < second["progress"]["last_step"] == 64, second
    assert redone == reached - resumed, (redone, reached, resumed)
    assert spent["redone"] == pytest.approx(second["progress"]["new_at"] - second["progress"]["first_at"], abs=0.01)
    status = harness("status", run.run_id, "--runs-dir", str(run.runs_dir)).stdout
    assert f"  time: {summary['duration_s']:.1f} s, goodput {100 * summary['goodput']['goodput']:.0f}%: " \
           f"start-up " in status and " hung " in status and "  progress: step 64/64 (100%)\n" in status, status

    stacks = run.runs_dir / run.run_id / "stacks" / "attempt-0"
    assert verdict.group(2) == str(stacks)
    stopped = (stacks / "rank1.txt").read_text()
    assert stopped.startswith(f"rank 1 (node1 on sim1), pid {stopped_pid}, stopped (SIGSTOP)\n"), stopped
    # What the stopped rank's stack says is test_health_ssh.py's test_a_stopped_rank_s_stack_is_read.
    waiting = (stacks / "rank0.txt").read_text()
    assert waiting.startswith("rank 0 (node0 on sim0), pid ") and "(harness/payload/train.py:" in waiting, waiting
    assert not (run.runs_dir / run.run_id / "stacks" / "attempt-1").exists()
    assert_nothing_left(run.run_id)
