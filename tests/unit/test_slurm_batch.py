"""The Slurm batch script, rendered from the spec (pure): the allocation, restarts, the warning and the
launch mode, and srun's and scontrol's answers read (run on a real cluster: tests/integration/test_slurm.py)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest

from harness import __version__
from harness.control.continued import earlier_attempts
from harness.errors import HarnessError, SpecError
from harness.record.rundir import RunDir
from harness.record.schema import ControllerId, FailureKind, RunState, RunStatus
from harness.spec.job import load_job
from harness.targets.slurm.batch import batch_script, controller_script
from harness.targets.slurm.client import parse_job
from harness.targets.slurm.job_file import job_json, read_job

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


def test_a_scripts_batch_file_names_the_command_that_renders_it(tmp_path):
    """Its header is that command, once, and copied back it renders the same file; the script's arguments stay
    the script's."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    result = harness("render", "train.py", "--nnodes", "2", "--target", "slurm", "--", "--steps", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    command = re.search(r"^# Rendered by `(.*)` \(harness ", result.stdout, re.MULTILINE)
    assert command is not None and command.group(1) == "harness render --nnodes=2 --target=slurm train.py -- --steps 3"
    again = harness(*shlex.split(command.group(1))[1:], cwd=tmp_path)
    assert again.stdout == result.stdout


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


def test_launch_submits_a_script_whose_batch_step_runs_the_controller(write_yaml, tmp_path):
    spec = load_job(sum_job(write_yaml, extra=", spares: 1"))
    script = controller_script(spec, "job.yaml", tmp_path / "my run", "/opt/venv/bin/python")
    options = re.findall(r"^#SBATCH (.*)$", script, re.M)
    assert options[:3] == ["--job-name=sum", "--nodes=3", "--ntasks-per-node=1"], "nnodes + slurm.spares"
    assert f"--output={tmp_path}/my run/slurm-%j.log" in options
    assert f"run='{tmp_path}/my run'\n" in script
    assert '/opt/venv/bin/python -m harness.cli batch-step "$run" &\n' in script
    assert "trap on_warning USR1" in script and 'scancel --signal=USR1 "$SLURM_JOB_ID"' in script
    assert not re.search(r"^(srun|torchrun|exec) ", script, re.M), "the controller starts the nodes"
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert not [option for option in options if option.startswith("--exclude")]
    own = spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"extra": ["--exclusive", "--exclude=n7"]})})
    kept_out = re.findall(r"^#SBATCH (--excl.*)$", controller_script(own, "j.yaml", tmp_path, "py", ["n2", "n3"]), re.M)
    assert kept_out == ["--exclusive", "--exclude=n7,n2,n3"], "the nodes kept out join the job's own --exclude"


def test_the_batch_script_names_a_run_directory_or_a_harness_the_node_cannot_see(write_yaml, tmp_path):
    """What the batch step checks before the controller starts; `harness launch` shows its line, exit 1."""
    spec = load_job(sum_job(write_yaml))
    unseen = subprocess.run(["bash", "-c", controller_script(spec, "job.yaml", tmp_path / "gone", sys.executable)],
                            capture_output=True, text=True, timeout=30)
    assert unseen.returncode == 1 and re.fullmatch(
        rf"harness: the run directory {tmp_path}/gone is not visible on \S+: launch with a --runs-dir on a file "
        r"system that this machine and the nodes share\n", unseen.stderr), unseen.stderr
    (tmp_path / "job.json").write_text(job_json(spec))
    elsewhere = subprocess.run(["bash", "-c", controller_script(spec, "job.yaml", tmp_path, "/no/venv/bin/python")],
                               capture_output=True, text=True, timeout=30)
    assert elsewhere.returncode == 1 and elsewhere.stderr.startswith(
        "harness: /no/venv/bin/python, the Python of the harness that submitted the job, is not on "), elsewhere.stderr


def test_the_batch_step_runs_the_spec_the_launch_made(write_yaml, tmp_path):
    """Every flag applied (here the time and the stall); a harness of another version is named."""
    spec = load_job(sum_job(write_yaml))
    spec = spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"time": "00:05:00"}),
                                   "health": spec.health.model_copy(update={"stall": 9})})
    run = RunDir(tmp_path)
    run.job_file.write_text(job_json(spec))
    again = read_job(run.job_file)
    assert (again.slurm.time, again.health.stall, again.nnodes, again.entrypoint) == \
        ("00:05:00", 9, 2, spec.entrypoint)
    run.job_file.write_text(job_json(spec).replace(f'"{__version__}"', '"0.0.1"'))
    with pytest.raises(HarnessError, match=r"the job was submitted by harness 0.0.1, and \S+ here is harness "):
        read_job(run.job_file)


def test_an_attempt_the_end_of_an_allocation_cut_short_is_recorded_so(tmp_path):
    run = RunDir(tmp_path)
    run.write_state(RunState(run_id="r", name="r", mode="slurm", status=RunStatus.RUNNING, started_at=0.0, nnodes=2,
                             world_size=2, controller=ControllerId(1, None, "n1"), hosts=["n1", "n2"]))
    run.plan_json(0).write_text(json.dumps({"nodes": [{"host": "n1"}, {"host": "n2"}], "nnodes": 2,
                                            "world_size": 2}))
    [lost] = earlier_attempts(run, requeued=1)
    assert (lost.attempt, lost.hosts, lost.status, lost.kind) == (0, ["n1", "n2"], RunStatus.FAILED, FailureKind.INFRA)
    assert lost.ended_by == "the allocation ended while it ran (Slurm requeued the job: restart 1)"
    run.write_attempts([lost])
    assert earlier_attempts(run, requeued=2) == [lost], "a recorded attempt is taken as recorded"
    # The controller ended the run (Slurm's SIGTERM of a requeue: interrupted), and the job runs again.
    run.write_attempts([replace(lost, status=RunStatus.INTERRUPTED, ended_by=None)])
    run.write_state(replace(run.read_state(), status=RunStatus.INTERRUPTED))
    [requeued] = earlier_attempts(run, requeued=2)
    assert (requeued.status, requeued.ended_by) == (RunStatus.FAILED, "the allocation ended while it ran (Slurm "
                                                                      "requeued the job: restart 2)")


def test_scontrol_and_srun_answers_are_read():
    job = parse_job("JobId=7 JobName=x JobState=PENDING Reason=PartitionNodeLimit Dependency=(null) Restarts=2 "
                    "NodeList=(null) ExitCode=0:0")
    assert (job.job_id, job.state, job.restarts, job.finished) == (7, "PENDING", 2, False)
    assert job.never_starts == "it asks for more nodes than the partition allows or has"
    assert parse_job("JobId=8 JobState=PENDING Reason=Resources").never_starts is None
    with pytest.raises(HarnessError, match="cannot read scontrol's answer"):
        parse_job("slurm_load_jobs error: Invalid job id specified")


@pytest.mark.parametrize(("flags", "message"), [
    (["--time", "2h"], "--time: expected a Slurm time limit"),
    (["--target", "slurm", "--partition", "a b"], "--partition: expected a Slurm name"),
    (["--partition", "gpu"], "--partition is for --target slurm"),
])
def test_bad_launch_flags_are_named(write_yaml, flags, message):
    result = harness("launch", sum_job(write_yaml), "--target", "slurm", *flags) if "--target" not in flags and \
        flags[0] == "--time" else harness("launch", sum_job(write_yaml), *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_an_argument_that_is_the_node_commands_terminator_cannot_end_it_early(write_yaml, tmp_path):
    """The node command is read from a quoted here-document: an argument (or any value in it) holding its usual
    terminator on a line of its own would end it there and run the argument's next line in the batch step."""
    planted = tmp_path / "planted"
    value = f"a\nEND_OF_NODE_COMMAND\ntouch {planted}\nb"
    spec = load_job(sum_job(write_yaml))
    spec = spec.model_copy(update={"entrypoint": spec.entrypoint.model_copy(update={"args": ["--note", value]})})
    script = batch_script(spec, "job.yaml")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    start = script.index("read -r -d '' NODE_COMMAND")
    end = script.index("\nEND_OF_NODE_COMMAND_\n", start) + len("\nEND_OF_NODE_COMMAND_\n")
    shown = subprocess.run(["bash", "-c", script[start:end] + 'printf %s "$NODE_COMMAND"'], capture_output=True,
                           text=True, check=True).stdout
    assert not planted.exists(), "a line of the argument ran in the batch step"
    argv = shlex.split(shown[shown.index("\nexec ") + 6:].replace("\\\n", " "))
    assert argv[-2:] == ["--note", value], argv
