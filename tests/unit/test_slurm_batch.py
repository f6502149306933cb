"""The Slurm batch script, rendered from the spec (pure): the allocation, restarts, the warning and the
launch mode, and srun's and scontrol's answers read (run on a real cluster: tests/integration/test_slurm.py)."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from harness.errors import HarnessError, SpecError
from harness.spec.job import load_job
from harness.targets.base import Outcome
from harness.targets.slurm.batch import batch_script
from harness.targets.slurm.client import parse_job, task_outcomes

from conftest import REPO, harness
from slurm_job import sum_job


def test_the_script_asks_for_the_allocation_the_spec_describes(write_yaml):
    job = sum_job(write_yaml, extra=', partition: debug, account: ml-team, qos: high, constraint: "a100&ib", '
                                    'extra: [--exclusive, "--mail-type=END"]')
    script = batch_script(load_job(job), "job.yaml")
    options = re.findall(r"^#SBATCH (.*)$", script, re.M)
    assert options == ["--job-name=sum", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1536M",
                       "--partition=debug", "--account=ml-team", "--qos=high", "--time=00:10:00",
                       "--constraint=a100&ib", f"--chdir={REPO}", "--no-requeue", "--open-mode=append",
                       "--signal=B:USR1@120", "--exclusive", "--mail-type=END"]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 " in script


def test_cifar_script_uses_gpus_and_the_contract(write_yaml):
    script = batch_script(load_job(REPO / "jobs/cifar.yaml"), "jobs/cifar.yaml")
    assert "#SBATCH --gpus-per-node=8\n" in script and "#SBATCH --mem=128G\n" in script
    assert "--nproc-per-node=8" in script and "export HARNESS_BACKEND=nccl\n" in script
    assert 'export HARNESS_ATTEMPT="${SLURM_RESTART_COUNT:-0}"' in script
    assert 'export HARNESS_RUN_ID=cifar-"$SLURM_JOB_ID"' in script


@pytest.mark.parametrize(("slurm", "message"), [
    ("{partition: 'gpu x'}", "slurm.partition: expected a Slurm name"),
    ("{time: 2h}", "slurm.time: expected a Slurm time limit such as 90 (minutes), 02:00:00 or 1-12:00:00"),
    ("{extra: [--nodes=3]}", "slurm.extra[0]: --nodes is written by the harness from the spec"),
    ("{extra: ['rm -rf /']}", "slurm.extra[0]: expected one sbatch option such as --exclusive"),
    ("{python: 'my python'}", "slurm.python: String should match pattern"),
    ("{nodes: 2}", "slurm.nodes: unknown key 'nodes'"),
])
def test_bad_slurm_values_are_located(write_yaml, slurm, message):
    with pytest.raises(SpecError) as caught:
        load_job(write_yaml(f"name: a\nnnodes: 2\nentrypoint: {{module: m}}\nslurm: {slurm}\n"))
    assert message in str(caught.value) and "job.yaml:4:" in str(caught.value)


def test_cli_prints_the_script(write_yaml):
    job = sum_job(write_yaml)
    result = harness("render", job, "--target", "slurm")
    assert result.returncode == 0 and result.stdout == batch_script(load_job(job), job)
    assert harness("render", job, "--target", "slurm", "--out", "x").returncode == 2


# --- the script's restarts, warning and launch mode (pure) -------------------------------------------

def test_restarts_become_requeues_and_the_time_limit_warning_reaches_the_training(write_yaml):
    spec = load_job(sum_job(write_yaml))
    script = batch_script(spec, "job.yaml")
    assert "#SBATCH --no-requeue\n" in script and "#SBATCH --open-mode=append\n" in script
    assert "#SBATCH --signal=B:USR1@120\n" in script and 'scancel --signal=USR1 "$SLURM_JOB_ID"' in script
    assert "\ntrap '' USR1\nexec " in script, "torchrun ignores the warning; the payload catches it"
    assert "scontrol requeue \"" not in script and 'if [ "$restarts" -gt 0 ]' in script
    again = batch_script(spec.model_copy(update={"restarts": spec.restarts.model_copy(update={"max": 2})}), "job.yaml")
    assert "#SBATCH --requeue\n" in again and 'if [ "$restarts" -lt 2 ]; then' in again
    quiet = batch_script(spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"warning": 0})}), "job.yaml")
    assert "--signal" not in quiet and "on_warning" not in quiet
    assert subprocess.run(["bash", "-n"], input=again, text=True).returncode == 0


def test_launch_mode_writes_each_node_log_into_the_run_directory(write_yaml, tmp_path):
    script = batch_script(load_job(sum_job(write_yaml)), "job.yaml", run_id="sum-1", log_dir=tmp_path / "my run")
    assert f"#SBATCH --output={tmp_path}/my run/slurm-%j.log\n" in script
    assert f"--output='{tmp_path}/my run'/node%n\"$attempt_suffix\".log bash -c" in script
    assert "export HARNESS_RUN_ID=sum-1\n" in script and "[node" not in script, "the file says the node"


def test_scontrol_and_srun_answers_are_read():
    job = parse_job("JobId=7 JobName=x JobState=PENDING Reason=PartitionNodeLimit Dependency=(null) Restarts=2 "
                    "NodeList=(null) ExitCode=0:0")
    assert (job.job_id, job.state, job.restarts, job.finished) == (7, "PENDING", 2, False)
    assert job.never_starts == "it asks for more nodes than the partition allows or has"
    assert parse_job("JobId=8 JobState=PENDING Reason=Resources").never_starts is None
    with pytest.raises(HarnessError, match="cannot read scontrol's answer"):
        parse_job("slurm_load_jobs error: Invalid job id specified")
    report = ["srun: error: n2: task 1: Exited with exit code 3", "srun: launch/slurm: _step_signal: Terminating",
              "srun: error: n1: task 0: Terminated", "srun: error: n3: tasks 2-3: Killed"]
    assert task_outcomes(report) == {1: Outcome(3), 0: Outcome(None, signal.SIGTERM),
                                     2: Outcome(None, signal.SIGKILL), 3: Outcome(None, signal.SIGKILL)}
    assert list(task_outcomes(report)) == [1, 0, 2, 3], "the first failure first"


@pytest.mark.parametrize(("flags", "message"), [
    (["--time", "2h"], "--time: expected a Slurm time limit"),
    (["--target", "slurm", "--partition", "a b"], "--partition: expected a Slurm name"),
    (["--partition", "gpu"], "--partition is for --target slurm"),
])
def test_bad_launch_flags_are_named(write_yaml, flags, message):
    result = harness("launch", sum_job(write_yaml), "--target", "slurm", *flags) if "--target" not in flags and \
        flags[0] == "--time" else harness("launch", sum_job(write_yaml), *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
