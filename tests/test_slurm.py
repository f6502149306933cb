"""The Slurm batch script: rendered from the spec (pure), and run by plain sbatch on a real cluster."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import SpecError
from harness.slurm import batch_script
from harness.spec import load_job

from conftest import REPO, SCRIPT, free_port, harness
from slurm_cluster import SlurmCluster

JOB = """
name: sum
nnodes: 2
backend: gloo
master_port: {port}
entrypoint:
  script: {script}
  args: [--tag, "two words", "it's", "$HOME", "${{local_rank}}", "a\\"b"]
env:
{env}
resources: {{cpu: "1", memory: 1536Mi}}
slurm: {{python: {python}, workdir: {workdir}, time: "00:10:00"{extra}}}
"""


def sum_job(write_yaml, extra: str = "", **env: str) -> str:
    lines = "".join(f"  {k}: '{v}'\n" for k, v in env.items()) or "  {}\n"
    text = JOB.format(port=free_port(), script=SCRIPT, env=lines.rstrip("\n"), python=sys.executable, workdir=REPO,
                      extra=extra)
    return str(write_yaml(text.replace("env:\n  {}", "env: {}")))


def test_the_script_asks_for_the_allocation_the_spec_describes(write_yaml):
    job = sum_job(write_yaml, extra=', partition: debug, account: ml-team, qos: high, constraint: "a100&ib", '
                                    'extra: [--exclusive, "--mail-type=END"]')
    script = batch_script(load_job(job), "job.yaml")
    options = re.findall(r"^#SBATCH (.*)$", script, re.M)
    assert options == ["--job-name=sum", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1536M",
                       "--partition=debug", "--account=ml-team", "--qos=high", "--time=00:10:00",
                       "--constraint=a100&ib", f"--chdir={REPO}", "--exclusive", "--mail-type=END"]
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


# --- on a real Slurm cluster (tests/slurm_cluster.py) ------------------------------------------------

def submit(cluster: SlurmCluster, script: str, tmp_path: Path) -> int:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    return cluster.sbatch(f"--output={tmp_path}/slurm-%j.out", str(path))


def ended(cluster: SlurmCluster, job_id: int, timeout: float = 240) -> dict[str, str]:
    """The job's fields from `scontrol show job` once it has ended."""
    cluster.wait_job(job_id, timeout=timeout)
    shown = cluster.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
    return dict(word.split("=", 1) for word in shown.split() if "=" in word)


def test_plain_sbatch_runs_the_rendered_script_as_a_two_node_gloo_job(slurm_cluster, write_yaml, tmp_path):
    job_id = submit(slurm_cluster, batch_script(load_job(sum_job(write_yaml, STEPS="10")), "job.yaml"), tmp_path)
    fields = ended(slurm_cluster, job_id)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    args = "['--tag', 'two words', \"it's\", '$HOME', '${local_rank}', 'a\"b']"
    assert f"[node0] [rank0]: rank 0/2 up on n1; args={args}" in output, output
    assert f"[node1] [rank1]: rank 1/2 up on n2; args={args}" in output, output
    weights = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", output)
    assert sorted(r for r, _ in weights) == ["0", "1"] and len({w for _, w in weights}) == 1
    slurm_cluster.assert_no_job_processes()


def test_a_failing_rank_ends_the_whole_job_within_seconds(slurm_cluster, write_yaml, tmp_path):
    job = sum_job(write_yaml, STEPS="100000", STEP_SECONDS="0.05", FAIL_RANK="1", FAIL_AT_STEP="20",
                  HANG_AT_STEP="20")
    job_id = submit(slurm_cluster, batch_script(load_job(job), "job.yaml"), tmp_path)
    fields = ended(slurm_cluster, job_id, timeout=180)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert fields["JobState"] == "FAILED", output
    hours, minutes, seconds = (int(part) for part in fields["RunTime"].split(":"))
    assert hours * 3600 + minutes * 60 + seconds < 90, "rank 0 hangs for an hour unless srun ends it"
    assert "rank 1 failing on purpose at step 20" in output
    assert re.search(rf"harness: job {job_id} failed: srun exited \d+", output), output
    slurm_cluster.assert_no_job_processes()
