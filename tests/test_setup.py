"""The job's `setup:` commands: run by /bin/sh before torchrun, once per working directory, for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.plan.setup_script import setup_id, setup_script, with_setup

from cluster import Cluster
from conftest import assert_nothing_left, ddp_job, harness

MARK = "import os, sys; open('setup-ran', 'a').write(os.environ.get('NODE_RANK', '-') + ' ' + sys.executable + chr(10))"
DATA = "data_paths: [data/answer]\n"
COMMANDS = f'setup:\n  - python -c "{MARK}"\n  - mkdir -p data && echo 42 > data/answer\n'
SETUP = DATA + COMMANDS


def started(script: str | None, workdir: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(with_setup(argv or ["echo", "torchrun"], script), cwd=workdir, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_nodes_sharing_a_workdir_run_the_setup_once_and_every_one_then_starts(tmp_path):
    script = setup_script(["echo run >> count; sleep 1", "mkdir -p data/x"], ["data/x"])
    nodes = [started(script, tmp_path, "echo", f"torchrun {n}") for n in range(3)]
    outputs = [p.communicate(timeout=60)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0, 0], outputs
    assert (tmp_path / "count").read_text() == "run\n"
    assert [f"torchrun {n}" in out for n, out in enumerate(outputs)] == [True] * 3
    assert sum("harness setup: running 2 command(s)" in out for out in outputs) == 1, outputs
    assert sum("harness setup: done before" in out for out in outputs) == 2, outputs
    again = started(script, tmp_path).communicate(timeout=60)[0]
    assert "done before" in again and (tmp_path / "count").read_text() == "run\n"
    edited = setup_script(["echo edited >> count"])
    assert started(edited, tmp_path).wait(timeout=60) == 0
    assert (tmp_path / "count").read_text() == "run\nedited\n", "edited commands run again"


def test_a_failed_setup_starts_nothing_and_runs_again_next_time(tmp_path):
    script = setup_script(["echo fetching; test -e ready || exit 4", "echo second >> count"])
    node = started(script, tmp_path)
    out = node.communicate(timeout=60)[0]
    log = tmp_path / ".harness" / f"setup-{setup_id(['echo fetching; test -e ready || exit 4', 'echo second >> count'])}.log"
    assert node.returncode == 4, out
    assert f"harness setup failed: exit 4; torchrun was not started here. Its log: {log}" in out
    assert "torchrun\n" not in out and not (tmp_path / "count").exists(), "a failed command stops the rest"
    assert log.read_text() == "fetching\n"
    (tmp_path / "ready").touch()
    assert started(script, tmp_path).communicate(timeout=60)[0].endswith("torchrun\n")
    assert (tmp_path / "count").read_text() == "second\n"


def test_setup_must_leave_the_data_paths_it_was_meant_to_create(tmp_path):
    node = started(setup_script(["mkdir -p data"], ["data", "data/cifar 10"]), tmp_path)
    out = node.communicate(timeout=60)[0]
    assert node.returncode == 1
    assert f"the commands succeeded but data path data/cifar 10 is still missing in {tmp_path}" in out
    assert not list((tmp_path / ".harness").glob("*.done")), "not done: the next launch tries again"


def test_commands_find_the_jobs_python_first_on_path(tmp_path):
    script = setup_script(['python -c "import sys; print(sys.executable)"'])
    out = started(script, tmp_path, sys.executable, "-c", "print('the node')").communicate(timeout=60)[0]
    assert f"{sys.executable}\nthe node\n" in out or f"{Path(sys.executable).parent}/python\nthe node\n" in out, out


def test_simulated_nodes_share_the_launch_directory_so_the_setup_runs_once(write_yaml, launch, tmp_path):
    job = ddp_job(write_yaml, STEPS="4")
    job.write_text(job.read_text() + SETUP)
    run = launch(job, cwd=tmp_path)
    assert run.finish() == 0, run.output
    ran = (tmp_path / "setup-ran").read_text().splitlines()
    assert len(ran) == 1 and ran[0].split()[1] in (sys.executable, f"{Path(sys.executable).parent}/python"), ran
    assert run.output.count("harness setup: running 2 command(s)") == 1, run.output
    assert run.output.count("harness setup: done before") == 1, run.output
    assert (tmp_path / "data/answer").read_text() == "42\n"
    plan = (run.runs_dir / run.run_id / "plan.json").read_text()
    assert '"setup": "mkdir -p .harness' in plan
    assert_nothing_left(run.run_id)


def test_offline_data_preparation_fails_the_launch_saying_what_to_do(write_yaml, launch, tmp_path):
    """jobs/cifar.yaml's setup, `harness prepare`, without network: the node's own `harness` (the job's
    Python first on PATH) says what it tried; nothing trains and nothing is left running."""
    job = ddp_job(write_yaml)
    mirror = (tmp_path / "offline" / "cifar-10-python.tar.gz").as_uri()
    job.write_text(job.read_text() + f"setup: [harness prepare --data-dir data/cifar10 --url {mirror}]\n")
    run = launch(job, cwd=tmp_path)
    assert run.finish() == 1, run.output
    failure = run.summary()["first_failure"]
    assert failure["exit_code"] == 2, failure
    assert f"error: could not download {mirror}" in failure["last_lines"][-2], failure
    assert "or name a mirror with --url, and run prepare again" in failure["last_lines"][-2], failure
    assert "harness setup failed: exit 2; torchrun was not started here" in failure["last_lines"][-1]
    assert (failure["kind"], failure["evidence"]) == ("program", "the job's setup failed, exit code 2; torchrun was "
                                                                 "not started"), failure
    assert "[rank" not in run.output
    assert_nothing_left(run.run_id)


def test_ssh_hosts_with_workdirs_of_their_own_each_run_the_setup(cluster2: Cluster, write_yaml, launch, tmp_path):
    workdirs = {h.name: tmp_path / h.name for h in cluster2.hosts}
    for path in workdirs.values():
        path.mkdir()
    hosts = cluster2.write_inventory(tmp_path / "hosts.yaml",
                                     overrides={name: {"workdir": str(path)} for name, path in workdirs.items()})
    job = ddp_job(write_yaml, STEPS="4")
    job.write_text(job.read_text() + DATA)
    ssh = ["--known-hosts", str(cluster2.known_hosts)]
    checked = harness("preflight", str(hosts), "--job", str(job), "--json", *ssh)
    assert checked.returncode == 1 and data_rows(checked.stdout) == {("fail", "data/answer is missing in")}
    job.write_text(job.read_text() + COMMANDS)
    checked = harness("preflight", str(hosts), "--job", str(job), "--json", *ssh)
    assert checked.returncode == 0, checked.stdout
    assert data_rows(checked.stdout) == {("warn", "data/answer is missing in")}, "setup will create it"
    run = launch(job, "--hosts", str(hosts), *ssh)
    assert run.finish() == 0, run.output
    assert [(workdirs[h.name] / "setup-ran").read_text().split()[0] for h in cluster2.hosts] == ["0", "1"]
    assert run.output.count("harness setup: running 2 command(s)") == 2, run.output
    assert_nothing_left(run.run_id)


def data_rows(report: str) -> set[tuple[str, str]]:
    rows = [row for row in json.loads(report)["checks"] if row["check"] == "data"]
    assert len(rows) == 2, rows
    return {(row["status"], row["reason"].split(" /")[0]) for row in rows}
