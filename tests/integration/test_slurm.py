"""The Slurm batch script and `harness launch --target slurm` on a real cluster: plain sbatch, launches,
allocations and preflight over srun (the script rendered: tests/unit/test_slurm_batch.py)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.node.collectives import done, read_trace
from harness.node.proctable import environ, run_processes
from harness.node.store_port import ephemeral_start
from harness.payload import checkpoint
from harness.record.hosts_out import bring_back, hosts_file, hosts_out
from harness.spec.job import load_job
from harness.targets.slurm.batch import batch_script
from harness.targets.slurm.client import SlurmClient
from harness.targets.slurm.srun import slurm_machine
from testbed.slurm_cluster import SlurmCluster
from testbed.throttle import throttled

from conftest import (
    REPO,
    SCRIPT,
    STANDIN_ENV,
    Launch,
    Streamed,
    assert_secret_kept,
    harness,
    secret_looking_env,
    with_secret,
    worker_pid,
)
from resume_job import assert_same_weights, final_weights, payload_job
from slurm_job import sum_job

RANK = REPO / "testbed" / "standin" / "rank.py"  # the stand-in ranks' script: steps, a hang at a step


def rank_job(write_yaml, args: str, tail: str = "", nnodes: int = 2, port: str | None = None) -> Path:
    """sum_job on the stand-in torch with the stand-in ranks' script in ddp_sum.py's place, args its flags."""
    job = Path(sum_job(write_yaml, port=port, tail=tail, standin=True))
    text = re.sub(r"(?m)^  args: .*$", f"  args: {args}", job.read_text().replace(str(SCRIPT), str(RANK)))
    job.write_text(text.replace("\nnnodes: 2\n", f"\nnnodes: {nnodes}\n"))
    return job

# --- on a real Slurm cluster (testbed/slurm_cluster.py) ----------------------------------------------

@pytest.fixture(autouse=True)
def _slurm_nodes_back() -> Iterator[None]:
    """A node a test's job lost is kept out of later runs (record/hosts_out.py): the clusters' nodes are
    every test's, so each test brings back the ones it left out."""
    yield
    for entry in hosts_out(hosts_file()):
        if entry.machine == slurm_machine(entry.name):
            bring_back(hosts_file(), entry.name)


def submit(cluster: SlurmCluster, script: str, tmp_path: Path, environment: dict[str, str] | None = None) -> int:
    """environment: variables added to the environment sbatch runs in (and hands the job)."""
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    return cluster.sbatch(f"--output={tmp_path}/slurm-%j.out", str(path), environment=environment)


def ended(cluster: SlurmCluster, job_id: int, timeout: float = 240) -> dict[str, str]:
    """The job's fields from `scontrol show job` once it has ended."""
    cluster.wait_job(job_id, timeout=timeout)
    return shown_job(cluster, job_id)


def shown_job(cluster: SlurmCluster, job_id: int) -> dict[str, str]:
    """The job's fields from `scontrol show job`."""
    shown = cluster.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
    return dict(word.split("=", 1) for word in shown.split() if "=" in word)


def test_plain_sbatch_runs_the_rendered_script_as_a_two_node_gloo_job(slurm_cluster, write_yaml, tmp_path):
    """master_port auto: the batch script picks the port on the master node. A secret from a file: the script reads it
    where it runs, and holds no value, nor does Slurm's state. Values that look secret written in env: the script
    holds none, and takes each from the environment sbatch ran in."""
    env = secret_looking_env()
    job, secret = with_secret(Path(sum_job(write_yaml, port="auto", STEPS="10", SHOW_DIGEST=",".join(env), **env)),
                              f"{{file: {tmp_path / 'hf-token'}}}")
    (tmp_path / "hf-token").write_text(secret)
    job_id = submit(slurm_cluster, batch_script(load_job(job), "job.yaml"), tmp_path, env)
    fields = ended(slurm_cluster, job_id)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert_secret_kept(secret, output, 2, slurm_cluster.dir)
    assert secret not in (tmp_path / "job.sbatch").read_text()
    for name, value in env.items():
        assert_secret_kept(value, output, 2, name=name)
        assert value not in (tmp_path / "job.sbatch").read_text()
    args = "['--tag', 'two words', \"it's\", '$HOME', '${local_rank}', 'a\"b']"
    assert f"[node0] [rank0]: rank 0/2 up on n1; args={args}" in output, output
    assert f"[node1] [rank1]: rank 1/2 up on n2; args={args}" in output, output
    weights = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", output)
    assert sorted(r for r, _ in weights) == ["0", "1"] and len({w for _, w in weights}) == 1
    slurm_cluster.assert_no_job_processes()


def test_a_failing_rank_ends_the_whole_job_within_seconds(slurm_cluster, write_yaml, tmp_path):
    """On the stand-in torch: srun's end of the job is what is tested, and the stand-in torchrun exits 1 at its first
    failed rank, as torchrun does."""
    job = sum_job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05", FAIL_RANK="1", FAIL_AT_STEP="20",
                  HANG_AT_STEP="20")
    job_id = submit(slurm_cluster, batch_script(load_job(job), "job.yaml"), tmp_path)
    fields = ended(slurm_cluster, job_id, timeout=180)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert fields["JobState"] == "FAILED", output
    hours, minutes, seconds = (int(part) for part in fields["RunTime"].split(":"))
    # guard: srun ends the job at the failure, not after rank 0's hour-long sleep
    assert hours * 3600 + minutes * 60 + seconds < 90, "rank 0 hangs for an hour unless srun ends it"
    assert "rank 1 failing on purpose at step 20" in output
    assert re.search(rf"harness: job {job_id} failed: srun exited \d+", output), output
    slurm_cluster.assert_no_job_processes()


# --- harness launch --target slurm on a real cluster --------------------------------------------------

def _launcher(launch, cluster: SlurmCluster):
    """`harness launch JOB --target slurm` against the test cluster; whatever a failed test leaves in the
    queue is cancelled, so that it holds no node for the next test."""

    def start(job: Path | str, *flags: str) -> Launch:
        return launch(Path(job), "--target", "slurm", *flags, env=cluster.env)

    yield start
    queued = cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
    if queued:
        cluster.run(["scancel", *queued])


@pytest.fixture
def launch_slurm(launch, slurm_cluster: SlurmCluster):
    yield from _launcher(launch, slurm_cluster)


@pytest.fixture
def launch_slurm3(launch, slurm_cluster3: SlurmCluster):
    yield from _launcher(launch, slurm_cluster3)


def job_id_of(run: Launch) -> int:
    return int(run.wait_for(r"submitted Slurm job (\d+)").group(1))


def test_launch_submits_follows_and_streams_every_node(slurm_cluster, write_yaml, launch_slurm, tmp_path):
    """With the job's setup run once in the workdir both nodes share, before torchrun; and a secret from a file of
    the user's, read by the batch step: every rank has it, and neither the run's record nor Slurm's state holds it.
    Values that look secret written in env: every rank has them too, and no file of the run (job.json, job.sbatch,
    spec.yaml, the plans) holds one: they travel in the job's environment, as a secret from the environment does.
    On the stand-in torch: submission, streaming and records are the harness's, not torch's."""
    setup = "setup: ['echo $SLURM_NODEID >> setup-ran', mkdir -p data]\ndata_paths: [data]\n"
    env = secret_looking_env()
    job, secret = with_secret(Path(sum_job(write_yaml, workdir=tmp_path, tail=setup, standin=True, STEPS="10",
                                           SHOW_DIGEST=",".join(env), **env)), f"{{file: {tmp_path / 'hf-token'}}}")
    (tmp_path / "hf-token").write_text(secret)
    run = launch_slurm(job, "--time", "00:05:00")
    assert run.finish(timeout=240) == 0, run.output
    assert_secret_kept(secret, run.output, 2, run.runs_dir, slurm_cluster.dir)
    for name, value in env.items():
        assert_secret_kept(value, run.output, 2, run.runs_dir, name=name)
        assert run.output.count(f"harness: env.{name} looks like a secret: ") == 1, run.output
    assert json.loads((run.runs_dir / run.run_id / "job.json").read_text())["env_from_environment"] == list(env)
    assert len((tmp_path / "setup-ran").read_text().split()) == 1, run.output
    assert run.output.count("harness setup: done before") == 1, run.output
    job_id = job_id_of(run)
    assert re.search(rf"harness: Slurm job {job_id} running on n\[1-2\]", run.output), run.output
    assert re.search(r"^\[node0\] \[rank0\]: rank 0/2 up on n1;", run.output, re.M), run.output
    assert re.search(r"^\[node1\] \[rank1\]: rank 1/2 up on n2;", run.output, re.M), run.output
    assert re.search(rf"harness: run {run.run_id} succeeded in ", run.output)
    path = run.runs_dir / run.run_id
    state = json.loads((path / "state.json").read_text())
    assert (state["mode"], state["scheduler_job"], state["hosts"]) == ("slurm", str(job_id), ["n1", "n2"])
    assert "#SBATCH --time=00:05:00" in (path / "job.sbatch").read_text(), "the flag overrides slurm.time"
    assert "rank 1 final loss" in (path / "node1.log").read_text()
    summary = run.summary()
    assert summary["status"] == "succeeded" and [n["exit_code"] for n in summary["nodes"]] == [0, 0]
    status = harness("status", run.run_id, "--runs-dir", str(run.runs_dir))
    assert f"(slurm job {job_id}" in status.stdout.lower(), status.stdout
    logs = harness("logs", run.run_id, "--rank", "1", "--runs-dir", str(run.runs_dir)).stdout.splitlines()
    assert logs and all(line.startswith("[node1] [rank1]: ") for line in logs), logs
    assert "[node1] [rank1]: rank 1 final loss" in "\n".join(logs) and len(logs) == run.output.count("[rank1]: ")
    slurm_cluster.assert_no_job_processes()


def test_a_failing_rank_ends_the_launch_with_the_failure_named(slurm_cluster, write_yaml, launch_slurm):
    """On the stand-in torch, whose torchrun reports its first failed worker in torchrun's words (ChildFailedError)."""
    job = sum_job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05", FAIL_RANK="1", FAIL_AT_STEP="20",
                  HANG_AT_STEP="20")
    run = launch_slurm(job)
    run.wait_for(r"rank 1 failing on purpose at step 20", timeout=180)
    failed_at = time.monotonic()
    assert run.finish(timeout=120) == 1, run.output
    # guard: the job ends seconds after the failure, not after rank 0's hour-long sleep
    assert time.monotonic() - failed_at < 60, "rank 0 hangs in the collective unless the job ends"
    assert re.search(rf"harness: run {run.run_id} FAILED: first failure on node 1 \(n2, global rank 1\): exit code 1 "
                     r"after [\d.]+ s \(program\)", run.output), run.output
    assert "    [rank1]: rank 1 failing on purpose at step 20" in run.output
    assert "ChildFailedError" not in run.output, "torchrun's own report stays in the node log"
    assert "ChildFailedError" in (run.runs_dir / run.run_id / "node1.log").read_text()
    assert slurm_cluster.job_state(job_id_of(run)) == "FAILED"
    slurm_cluster.assert_no_job_processes()


def long_job(write_yaml) -> str:
    """A job that runs until it is stopped, on the stand-in torch: what stops it is Slurm's and the harness's."""
    return sum_job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05")


def test_ctrl_c_cancels_the_job_and_leaves_nothing_on_any_node(slurm_cluster, write_yaml, launch_slurm):
    run = launch_slurm(long_job(write_yaml))
    run.wait_for(r"^\[node0\] \[rank0\]: step 5 ", timeout=180)
    os.kill(run.proc.pid, signal.SIGINT)
    assert run.finish(timeout=120) == 130, run.output
    assert f"stop requested: cancelling Slurm job {job_id_of(run)}" in run.output
    assert slurm_cluster.job_state(job_id_of(run)) == "CANCELLED"
    assert run.summary()["status"] == "interrupted"
    slurm_cluster.assert_no_job_processes()


def test_harness_stop_and_scancel_end_the_job_and_its_record_says_so(slurm_cluster, write_yaml, launch_slurm):
    """`harness stop` reaches the controller in the batch step through Slurm; a job submitted with --detach
    is followed with `harness logs --follow`, and a plain `scancel` ends it, the controller recording the stop."""
    run = launch_slurm(long_job(write_yaml))
    run.wait_for(r"^\[node0\] \[rank0\]: step 5 ", timeout=180)
    stopped = harness("stop", run.run_id, "--runs-dir", str(run.runs_dir), env=slurm_cluster.env)
    assert stopped.returncode == 0 and f"run {run.run_id} stopped" in stopped.stdout, stopped.stdout
    assert run.finish(timeout=120) == 130, run.output
    assert run.summary()["status"] == "stopped"
    slurm_cluster.assert_no_job_processes()
    detached = launch_slurm(long_job(write_yaml), "--detach")
    assert detached.finish(timeout=60) == 0, detached.output
    job_id = job_id_of(detached)
    assert f"follow: harness logs {detached.run_id} --follow" in detached.output
    follow = Streamed([sys.executable, "-m", "harness.cli", "logs", detached.run_id, "--follow", "--runs-dir",
                       str(detached.runs_dir)], env=slurm_cluster.env)
    follow.wait_for(r"^\[node0\] \[rank0\]: step 5 ", timeout=180)
    status = harness("status", detached.run_id, "--runs-dir", str(detached.runs_dir), env=slurm_cluster.env)
    assert f"run {detached.run_id}: running" in status.stdout, status.stdout
    slurm_cluster.run(["scancel", str(job_id)])
    assert follow.finish(timeout=120) == 0, follow.output
    summary = detached.summary()
    assert summary["status"] == "interrupted" and summary["exit_code"] == 130, summary
    assert "harness: run " in follow.output.splitlines()[-1] and "interrupted" in follow.output.splitlines()[-1]
    slurm_cluster.assert_no_job_processes()


def test_a_job_that_can_never_start_is_refused_before_submission(slurm_cluster, write_yaml, tmp_path):
    job = write_yaml(Path(sum_job(write_yaml)).read_text().replace("nnodes: 2", "nnodes: 3"), name="three.yaml")
    queued = set(slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split())  # an earlier job may be ending
    result = harness("launch", str(job), "--target", "slurm", "--runs-dir", str(tmp_path / "runs"),
                     env=slurm_cluster.env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "harness: error: Slurm refuses the job: allocation failure: Requested node configuration is not " \
           "available (checked with `sbatch --test-only`" in result.stderr
    assert not (tmp_path / "runs").exists()
    assert set(slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()) <= queued, "nothing was submitted"


def _release(cluster: SlurmCluster, run: Launch, job_id: int, requeues: int) -> None:
    """A requeued job waits for its BeginTime (about 2 minutes), so that its nodes are done with the last
    run; the test lets it start once they are: no process of it left, and the clock two seconds on
    (slurmd refuses, "Job N already killed", a launch in the second the job was killed in)."""
    run.wait_for(rf"Slurm job {job_id} was requeued \(restart {requeues}\)", timeout=120)
    cluster.wait_job(job_id, frozenset({"PENDING"}), timeout=60)
    cluster.assert_no_job_processes(within=30)
    pending = time.time()
    while time.time() < math.floor(pending) + 2:
        time.sleep(0.05)
    cluster.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])


def _signal_mask(pid: int, field: str) -> int:
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1], 16)


def catching_usr1(run_id: str, timeout: float = 240) -> list[int]:
    """The training processes of the run's current attempt, once each has its SIGUSR1 handler (the payload
    installs it before its first step)."""
    usr1 = 1 << (signal.SIGUSR1 - 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(AssertionError, OSError, StopIteration):
            pids = [worker_pid(run_id, rank) for rank in (0, 1)]
            if all(_signal_mask(pid, "SigCgt:") & usr1 for pid in pids):
                return pids
        time.sleep(0.02)
    raise AssertionError(f"no training process of {run_id} caught SIGUSR1 within {timeout:g} s")


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    """The processes stopped (SIGSTOP) for the block, then continued: what the test does to the job meanwhile
    lands at a known point however fast the job trains (a requeue kills them stopped)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_warning_requeue_and_a_lost_node_resume_and_end_bitwise_equal(uninterrupted, slurm_cluster3, launch_slurm3,
                                                                      tmp_path):
    """The payload job of resume_job.py (32 steps an epoch) on 2 nodes and a spare (slurm.spares 1): a time-limit
    warning in its first epoch, then a requeue (a preemption) at its second's start, then n2 lost in its second (its
    slurmd, slurmstepd and the job's processes killed) and n3 taking its place within the allocation, without a
    requeue; n2's slurmd comes back (a machine rebooted) once the harness has moved on, so that Slurm can end the job
    there. It ends with the weights of the same job never interrupted: one payload run for the three restarts."""
    cluster = slurm_cluster3
    job = payload_job(tmp_path / "job")
    job.write_text(job.read_text().replace("slurm: {python", "slurm: {spares: 1, python")
                   .replace("{max: 2, on: infra, backoff: 1", "{max: 3, on: infra, backoff: 0"))
    run = launch_slurm3(job)
    ranks = catching_usr1(run.run_id)
    job_id = job_id_of(run)
    with frozen(ranks):
        # What --signal=B:USR1@T does before a time limit: USR1 to the batch script alone, which sends it on.
        cluster.run(["scancel", "--batch", "--signal=USR1", str(job_id)])
        deadline = time.monotonic() + 60
        while not all(_signal_mask(pid, "ShdPnd:") & (1 << (signal.SIGUSR1 - 1)) for pid in ranks):
            assert time.monotonic() < deadline, "the warning never reached the training processes"
            time.sleep(0.05)
    saved = int(run.wait_for(r"\[node0\] \[rank0\]: warning signal \(SIGUSR1\): checkpoint saved at global step "
                             r"(\d+)", timeout=60).group(1))
    assert saved < 32, f"saved at global step {saved}, past the first epoch"
    _release(cluster, run, job_id, 1)
    warned = run.wait_for(rf"\[node0\] \[rank0\]: resume: epoch 1/\d+ step {saved}/\d+ \(global step {saved}\)",
                          timeout=240)
    ranks = catching_usr1(run.run_id)
    epoch_end = checkpoint.path_for(tmp_path / "job" / "ckpt", 32)
    deadline = time.monotonic() + 240
    while not epoch_end.exists():
        assert time.monotonic() < deadline and run.proc.poll() is None, f"{epoch_end} never came:\n{run.output}"
        time.sleep(0.01)
    with frozen(ranks):
        cluster.run(["scontrol", "requeue", str(job_id)])  # as a preemption does
        _release(cluster, run, job_id, 2)
    resume = r"\[node0\] \[rank0\]: resume: epoch \d/\d+ step \d+/\d+ \(global step (\d+)\)"
    requeued = run.wait_for(resume, timeout=240, after=warned)
    run.wait_for(r"\[node0\] \[rank0\]: epoch 2/2 step 11/32 ", timeout=240, after=requeued)
    killed = time.monotonic()
    kill_node(cluster, "n2", slurmd=True)
    failed = run.wait_for(r"^harness: attempt 2 failed at the infra level on n2 ", timeout=120)
    cluster.restart_slurmd("n2")
    resumed = run.wait_for(resume, timeout=240, after=failed)
    step = int(resumed.group(1))
    run.wait_for(rf"\[node0\] \[rank0\]: epoch 2/2 step {step % 32 + 1}/32 ", timeout=60, after=resumed)
    print(f"from the node kill to the next training step: {time.monotonic() - killed:.1f} s")
    assert run.finish(timeout=300) == 0, run.output
    assert_same_weights(uninterrupted, final_weights(tmp_path / "job"))
    summary = run.summary()
    assert [a["status"] for a in summary["attempts"]] == ["failed", "failed", "failed", "succeeded"]
    path = run.runs_dir / run.run_id
    assert "resume: epoch 2/2 step" in (path / "node0.attempt2.log").read_text()
    batch = (path / f"slurm-{job_id}.log").read_text()
    assert "harness: Slurm's time-limit warning: requeueing the job (restart 1 of 3)" in batch, batch
    assert summary["attempts"][1]["ended_by"] == "the allocation ended while it ran (Slurm requeued the job: " \
        "restart 2)", summary["attempts"][1]
    lost, spare = summary["attempts"][2:]
    assert (lost["hosts"], lost["kind"], lost["down"]) == (["n1", "n2"], "infra", ["n2"]), lost
    assert spare["hosts"] == ["n1", "n3"] and spare["status"] == "succeeded"
    fields = shown_job(cluster, job_id)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "2"), fields  # the spare took over: no requeue
    kept = harness("hosts").stdout  # the batch job's controller kept the lost node out of later runs
    assert re.search(rf"^n2 +n2 \(slurm\) +\d+ min more +{run.run_id} +", kept, re.M), kept
    cluster.assert_no_job_processes()


def kill_node(cluster: SlurmCluster, name: str, slurmd: bool = False) -> None:
    """The node's slurmstepd and every process of the job on it (and its slurmd): to the others, a node
    that died."""
    for pid in cluster.node_pids(name) if slurmd else cluster.job_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_hung_rank_of_a_batch_job_is_found_named_and_its_stacks_kept(slurm_cluster, write_yaml, launch_slurm):
    """The health watch of the controller in the batch step: `harness stacks` of the running job shows every
    rank; a rank asleep in its data path is named within health.stall + 15 s, with every rank's stack kept. On the
    stand-in ranks (testbed/standin/rank.py), whose collectives the rank hook serves as torch's Flight Recorder
    entries: reading them on torch is tests/integration/test_health.py's."""
    job = rank_job(write_yaml, '[--steps, "100000", --step-seconds, "0.05", --print, first, --log-every, "10", '
                   '--hang-rank, "1", --hang-step, "20"]', tail="health: {stall: 8}\n")
    run = launch_slurm(job)
    run.wait_for(r"^\[node0\] \[rank0\]: epoch 1/1 step 10/", timeout=180)
    shown = harness("stacks", run.run_id, "--runs-dir", str(run.runs_dir), env=slurm_cluster.env, timeout=60)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert set(map(int, re.findall(r"\b(\d+) \(node\d on n\d, pid \d+", shown.stdout))) == {0, 1}, shown.stdout
    began = time.monotonic()
    verdict = run.wait_for(r"harness: hang: (.*)", timeout=120).group(1)
    # guard: the watch's stall + 15 s (~1.5 s past the stall on a quiet machine: bench 9), not gloo's 30 min timeout
    assert time.monotonic() - began < 8 + 15, f"found after {time.monotonic() - began:.0f} s"
    assert re.match(r"no progress for 8 s: rank 0 waits in all_reduce #(\d+) at \S*collectives.py:\d+ in _collective; "
                    r"rank 1 \(node1 on n2\) has not reached #\1, at \S*rank.py:\d+ in fetch_batch: "
                    r"time.sleep\(3600\) \(stacks in ", verdict), verdict
    assert run.finish(timeout=120) == 1, run.output
    assert run.summary()["attempts"][0]["kind"] == "hang"
    kept = run.runs_dir / run.run_id / "stacks" / "attempt-0"
    assert "time.sleep(3600)" in (kept / "rank1.txt").read_text()
    slurm_cluster.assert_no_job_processes()


SLOW_FOR = 10
SLOW_SHARE = 0.05  # of a CPU, for the slow node's rank: its step's 10 ms of work take 200 ms and more


def test_a_slow_node_gives_way_to_a_spare_and_is_excluded_from_the_next_submission_and_a_requeue(
        slurm_cluster3, write_yaml, launch_slurm3):
    """A batch job with a spare in its allocation (slurm.spares 1): rank 1's node n2 made slow (its rank held to a
    twentieth of a CPU, as a noisy neighbour would): named, weighed once health.slow_for has passed, and the job
    restarted without it, once, on n3, within the allocation; n2 is kept out of later runs, the slowness its reason.
    The next launch says so and excludes it (sbatch --exclude), and the job runs on n1 and n3; requeued by its
    controller while n3 is kept out too, it waits with both excluded (what it was submitted with kept), not held. On
    the stand-in ranks (testbed/standin/rank.py: each step a CPU-bound computation and an all-reduce)."""
    cluster = slurm_cluster3
    job = rank_job(write_yaml, '[--steps, "100000", --step-seconds, "0.05", --busy-ms, "10", --print, first, '
                   '--log-every, "10"]', tail=f"restarts: {{max: 1, on: [infra, slow], backoff: 0}}\n"
                                             f"health: {{slow_for: {SLOW_FOR}}}\n")
    job.write_text(job.read_text().replace("slurm: {python", "slurm: {spares: 1, python"))
    slow = launch_slurm3(job)
    # 200 steps of at least 0.05 s each: the job's pace before the slowness is known (over 5 s and more)
    slow.wait_for(r"^\[node0\] \[rank0\]: epoch 1/1 step 200/", timeout=240)
    with throttled([worker_pid(slow.run_id, 1)], share=SLOW_SHARE):
        slow.wait_for(r"^harness: attempt 0 stopped for n2's slowness; restart 1 of 1 in 0 s, without n2$", timeout=120)
    weighed = slow.wait_for(r"^harness: slow: rank 1 \(node1 on n2\) for \d+ s: the slowness costs ").string
    assert weighed.endswith("a restart without it costs less; stopping the job to restart without n2 (restarts.on: "
                            "slow)"), weighed
    moved = slow.wait_for(rf"^harness: run {slow.run_id} attempt 1, 2 node\(s\) x 1 process\(es\) on n1, n3, ",
                          timeout=120)
    slow.wait_for(r"^\[node0\] \[rank0\]: epoch 1/1 step 10/", timeout=120, after=moved)
    stopped = harness("stop", slow.run_id, "--runs-dir", str(slow.runs_dir), env=cluster.env)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert slow.finish(timeout=120) == 130, slow.output
    first, second = slow.summary()["attempts"]
    assert (first["hosts"], first["kind"], first["down"]) == (["n1", "n2"], "slow", ["n2"]), first
    assert (second["hosts"], second["status"]) == (["n1", "n3"], "stopped"), second
    assert len(re.findall(r"^harness: slow: rank \d+ \(node\d on n\d\) for \d+ s: ", slow.output, re.M)) == 1
    evidence = first["failures"][0]["evidence"]
    assert evidence.startswith("rank 1 (node1 on n2) held the job at "), first["failures"][0]
    (kept,) = [entry for entry in hosts_out(hosts_file()) if entry.machine == slurm_machine("n2")]
    assert (kept.name, kept.reason, kept.run_id) == ("n2", evidence, slow.run_id), kept
    job = sum_job(write_yaml, tail="restarts: {max: 1}\n", standin=True, STEPS="100000", STEP_SECONDS="0.05")
    submitted = harness("launch", job, "--target", "slurm", "--runs-dir", str(slow.runs_dir), "--detach",
                        env=cluster.env)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert f"harness: {kept.said()} (sbatch --exclude)\n" in submitted.stdout, submitted.stdout
    job_id = int(re.search(r"submitted Slurm job (\d+)", submitted.stdout).group(1))
    try:
        cluster.wait_job(job_id, frozenset({"RUNNING"}), timeout=120)
        fields = shown_job(cluster, job_id)
        assert (fields["ExcNodeList"], fields["NodeList"]) == ("n2", "n[1,3]"), fields
        SlurmClient(env=cluster.env).requeue(job_id, exclude=["n3"])
        cluster.wait_job(job_id, frozenset({"PENDING"}), timeout=60)  # n1 alone cannot hold it: it waits
        fields = shown_job(cluster, job_id)
        assert fields["ExcNodeList"] == "n2,n3" and not fields["Reason"].startswith("JobHeld"), fields
    finally:
        cluster.run(["scancel", str(job_id)])
    cluster.assert_no_job_processes()


def _waits_in_a_collective(run_id: str, node_rank: int, rank: int) -> bool:
    """Whether a rank of the run has a collective it has not finished, by its Flight Recorder as its node agent
    reads it (harness.node.collectives, through the rank hook's socket in the agent's directory)."""
    for pid in run_processes(run_id, str(node_rank)):
        if directory := environ(pid).get(b"HARNESS_AGENT_DIR"):
            entries = read_trace(directory.decode(), rank)
            return isinstance(entries, list) and not all(map(done, entries))
    return False


def test_a_batch_job_without_a_spare_goes_on_with_fewer_nodes(slurm_cluster3, write_yaml, launch_slurm3):
    """nnodes 3, restarts.min_nnodes 2, no spare: n2 lost, attempt 1 runs on n1 and n3 as a world of 2. On the
    stand-in ranks: which nodes run is Slurm's and the harness's to choose, not torch's (the same math on fewer
    ranks is test_recovery.py's, on the payload). The stand-in's process group sees a peer die while it waits for
    it in a collective (gloo sees it at its next one), so n2 is lost while rank 0 waits in one: rank 2 sleeps in
    its data loading at step 5, a rank that attempt 1's world of 2 does not have."""
    cluster = slurm_cluster3
    job = rank_job(write_yaml, '[--steps, "40", --step-seconds, "0.05", --hang-rank, "2", --hang-step, "5"]',
                   tail="restarts: {max: 1, backoff: 0, min_nnodes: 2}\n", nnodes=3, port="auto")
    run = launch_slurm3(job)
    run.wait_for(r"^\[node0\] \[rank0\]: epoch 1/1 step 4/40 ", timeout=240)
    deadline = time.monotonic() + 60
    while not _waits_in_a_collective(run.run_id, 0, 0):
        assert time.monotonic() < deadline, f"rank 0 never waited in step 5's all_reduce:\n{run.output}"
        time.sleep(0.05)
    kill_node(cluster, "n2")
    assert run.finish(timeout=300) == 0, run.output
    assert re.search(r"^harness: n2 down and no spare left: attempt 1 runs on 2 of the job's 3 nodes "
                     r"\(restarts.min_nnodes: 2\), world size 2 instead of 3, ranks renumbered, master n1$",
                     run.output, re.M), run.output
    first, second = run.summary()["attempts"]
    assert (first["hosts"], first["down"], first["world_size"]) == (["n1", "n2", "n3"], ["n2"], 3), first
    assert (second["hosts"], second["status"], second["world_size"]) == (["n1", "n3"], "succeeded", 2), second
    attempt1 = (run.runs_dir / run.run_id / "node1.attempt1.log").read_text()
    assert re.search(r"^\[rank1\]: epoch 1/1 step 40/40 ", attempt1, re.M), attempt1
    cluster.assert_no_job_processes()


# --- inside an allocation: srun steps under the supervisor --------------------------------------------

def _descendants(pid: int) -> list[int]:
    """Every living process below pid (salloc's command and the sruns it starts in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.setdefault(int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(
                int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


@pytest.fixture
def in_allocation():
    """`salloc --nodes=N harness launch JOB --target slurm`, as a user types it on a login node; a test that
    fails with it still running leaves none of its processes (salloc, the harness, its sruns) behind."""
    started: list[Streamed] = []

    def start(cluster: SlurmCluster, nodes: int, job: Path | str, runs: Path, *flags: str) -> Streamed:
        started.append(Streamed(["salloc", f"--nodes={nodes}", sys.executable, "-m", "harness.cli", "launch",
                                 str(job), "--target", "slurm", "--runs-dir", str(runs), *flags], env=cluster.env))
        return started[-1]

    yield start
    for run in started:
        for pid in [*_descendants(run.proc.pid), run.proc.pid] if run.proc.poll() is None else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.proc.wait()


def test_inside_an_allocation_the_nodes_run_as_srun_steps(slurm_cluster, write_yaml, tmp_path, in_allocation):
    """On the stand-in torch: the steps and the port asked of n1 are Slurm's and the harness's."""
    run = in_allocation(slurm_cluster, 2, sum_job(write_yaml, port="auto", standin=True, STEPS="10"), tmp_path / "runs")
    assert run.finish(timeout=240) == 0, run.output
    found = re.search(r"harness: run \S+: 2 node\(s\) x 1 process\(es\) on n1, n2, master "
                      rf"{re.escape(slurm_cluster.node('n1').address)}:(\d+)", run.output)
    assert found and 20000 <= int(found.group(1)) < ephemeral_start(), run.output  # auto: asked of n1 in a step
    assert re.search(r"^\[node1\] \[rank1\]: rank 1/2 up on n2;", run.output, re.M), run.output
    assert "submitted Slurm job" not in run.output, "inside an allocation nothing is submitted"
    assert run.output.count("harness: n1, n2 started cold (torchrun, then its workers, each importing torch): under "
                            "Slurm a standby would be a step of its own holding the node's CPUs") == 1, run.output
    state = json.loads(next((tmp_path / "runs").glob("*/state.json")).read_text())
    assert (state["mode"], state["hosts"]) == ("srun", ["n1", "n2"])
    slurm_cluster.assert_no_job_processes()


def test_inside_an_allocation_a_failure_and_ctrl_c_stop_every_step(slurm_cluster, write_yaml, tmp_path, in_allocation):
    """On the stand-in torch: the steps' ends are Slurm's and the harness's."""
    job = sum_job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05", FAIL_RANK="1", FAIL_AT_STEP="20",
                  HANG_AT_STEP="20")
    failed = in_allocation(slurm_cluster, 2, job, tmp_path / "runs")
    assert failed.finish(timeout=240) == 1, failed.output
    assert re.search(r"FAILED: first failure on node 1 \(n2, global rank 1\): exit code 1 ", failed.output)
    slurm_cluster.assert_no_job_processes()
    interrupted = in_allocation(slurm_cluster, 2, long_job(write_yaml), tmp_path / "runs2")
    interrupted.wait_for(r"^\[node0\] \[rank0\]: step 5 ", timeout=180)
    controller = json.loads(next((tmp_path / "runs2").glob("*/state.json")).read_text())["controller"]["pid"]
    # Ctrl-C in a terminal reaches the foreground group: the one salloc puts its command in.
    os.killpg(os.getpgid(controller), signal.SIGINT)
    assert interrupted.finish(timeout=120) == 130, interrupted.output
    assert "stop requested: stopping every node" in interrupted.output
    slurm_cluster.assert_no_job_processes()


def test_an_allocation_too_small_for_the_job_is_named(slurm_cluster, write_yaml, tmp_path, in_allocation):
    run = in_allocation(slurm_cluster, 1, sum_job(write_yaml), tmp_path / "runs")
    assert run.finish(timeout=120) == 2, run.output
    assert re.search(r"harness: error: allocation \d+ has 1 node\(s\) \(n1\) but the job needs nnodes=2; ask for "
                     r"them \(salloc --nodes=2\)", run.output), run.output


# --- preflight inside an allocation ------------------------------------------------------------------

def preflight_in_allocation(cluster: SlurmCluster, nodes: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["salloc", f"--nodes={nodes}", sys.executable, "-m", "harness.cli", "preflight",
                           "--target", "slurm", *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=cluster.env)


def test_preflight_inside_an_allocation_proves_versions_and_ports_over_srun(slurm_cluster3, write_yaml, tmp_path):
    runs = tmp_path / "runs"
    result = preflight_in_allocation(slurm_cluster3, 3, "--job", sum_job(write_yaml), "--runs-dir", str(runs))
    assert result.returncode == 0, result.stdout + result.stderr
    for host in ("n1", "n2"):  # what the batch step of `harness launch --target slurm` needs there
        assert re.search(rf"^{host} +batch_job +PASS +sees {runs} and imports harness \S+ with ", result.stdout,
                         re.M), result.stdout
    assert list(runs.iterdir()) == [], "the file the nodes read is gone"
    n1 = re.escape(slurm_cluster3.node("n1").address)
    for host in ("n1", "n2"):
        assert re.search(rf"^{host} +fingerprint +PASS +python .* torch .*; same on all hosts$", result.stdout, re.M)
        address = re.escape(slurm_cluster3.node(host).address)
        assert re.search(rf"^{host} +data_plane +PASS +ephemeral port \d+ on eth0 {address} reached from ", result.stdout,
                         re.M)
        # Inside an allocation the launch does not pin the interface: preflight names it.
        assert re.search(rf"^{host} +interface +PASS +eth0 {address}, mtu \d+, same on all hosts \(the kernel routes "
                         rf"to n\d through it\); set network.interface to pin it$", result.stdout, re.M), result.stdout
    assert re.search(rf"^n2 +master_port +PASS +n2 -> n1 {n1}:\d+ connected", result.stdout, re.M), result.stdout
    assert "note: not checked: n3 (the job runs on 2 nodes)" in result.stdout
    assert "every check ran as an srun step" in result.stdout
    slurm_cluster3.assert_no_job_processes()


def test_preflight_inside_an_allocation_names_a_dropped_port_and_missing_data(slurm_cluster, write_yaml):
    job = write_yaml(Path(sum_job(write_yaml)).read_text() + "data_paths: [no/such/data]\n", name="data.yaml")
    port = str(load_job(job).master_port)
    drop = ["INPUT", "-p", "tcp", "--dport", port, "-j", "DROP"]
    netns = ["ip", "netns", "exec", slurm_cluster.node("n1").netns, "iptables"]
    subprocess.run([*netns, "-I", *drop], check=True)
    try:
        result = preflight_in_allocation(slurm_cluster, 2, "--job", str(job), "--timeout", "5")
    finally:
        subprocess.run([*netns, "-D", *drop], check=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(rf"^n2 +master_port +FAIL +n2 -> n1 \S+:{port} timed out after \S+ \(a firewall drops the "
                     r"packets\)", result.stdout, re.M), result.stdout
    assert re.search(r"^n1 +data +FAIL +no/such/data is missing in ", result.stdout, re.M), result.stdout
    slurm_cluster.assert_no_job_processes()


def test_preflight_for_slurm_outside_an_allocation_says_how(slurm_cluster):
    result = harness("preflight", "--target", "slurm", env=slurm_cluster.env)
    assert result.returncode == 2 and "runs inside a Slurm allocation (SLURM_JOB_ID is not set): salloc --nodes=N " \
        "harness preflight --target slurm --job JOB" in result.stderr, result.stderr
    assert harness("preflight").returncode == 2


SLURM_CALL = """\
import socket, sys
import harness

def where():
    import os
    return socket.gethostname(), int(os.environ["RANK"])

run = harness.launch(where, nnodes=2, target="slurm", runs_dir=sys.argv[1], env={"PYTHONPATH": sys.argv[2]})
print("RESULTS", run.result(rank=None))
"""


def test_inside_an_allocation_a_function_runs_on_every_node(slurm_cluster, tmp_path):
    """`salloc --nodes=2 python script.py` whose script calls harness.launch(fn, target="slurm"): each node's rank, an
    srun step running the caller's Python, calls the function, and its result comes back (on the stand-in torch:
    the function needs none)."""
    script = tmp_path / "call.py"
    script.write_text(SLURM_CALL)
    run = Streamed(["salloc", "--nodes=2", sys.executable, str(script), str(tmp_path / "runs"),
                    STANDIN_ENV["PYTHONPATH"]], env=slurm_cluster.env, cwd=tmp_path)
    try:
        run.wait_for(r"^RESULTS ", timeout=240)
    finally:
        if run.proc.poll() is None:
            for pid in [*_descendants(run.proc.pid), run.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        run.proc.wait()
    assert "RESULTS [('n1', 0), ('n2', 1)]" in run.output, run.output
    state = json.loads(next((tmp_path / "runs").glob("*/state.json")).read_text())
    assert (state["mode"], state["hosts"], state["status"]) == ("srun", ["n1", "n2"], "succeeded")
    slurm_cluster.assert_no_job_processes()
