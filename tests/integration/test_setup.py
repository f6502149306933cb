"""The job's `setup:` commands through `harness launch`, for real: once per working directory on
simulated nodes and on SSH hosts, and a failed data preparation (the script itself: tests/unit/test_setup_script.py).
The jobs run on the stand-in torch (ddp_job(standin=True)): the setup runs before torchrun, and torch's own behaviour
is not what is tested."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from harness.preflight.runner import run_preflight
from harness.preflight.table import Report
from harness.spec.inventory import load_inventory
from harness.spec.job import load_job
from testbed.cluster import Cluster

from conftest import assert_nothing_left, ddp_job

MARK = ("import os, sys; open('setup-ran', 'a').write(os.environ.get('NODE_RANK', '-') + ' ' + sys.executable + ' ' + "
        "os.readlink('/proc/self/ns/net') + chr(10))")
DATA = "data_paths: [data/answer]\n"
COMMANDS = f'setup:\n  - python -c "{MARK}"\n  - mkdir -p data && echo 42 > data/answer\n'
SETUP = DATA + COMMANDS


def test_simulated_nodes_share_the_launch_directory_so_the_setup_runs_once(write_yaml, launch, tmp_path):
    """The setup runs in this machine's network (a download works there), not the ranks' own (private_net.py)."""
    job = ddp_job(write_yaml, standin=True, STEPS="4")
    job.write_text(job.read_text() + SETUP)
    run = launch(job, cwd=tmp_path)
    assert run.finish() == 0, run.output
    ran = (tmp_path / "setup-ran").read_text().splitlines()
    assert len(ran) == 1 and ran[0].split()[1] in (sys.executable, f"{Path(sys.executable).parent}/python"), ran
    assert ran[0].split()[2] == os.readlink("/proc/self/ns/net"), ran
    assert run.output.count("harness setup: running 2 command(s)") == 1, run.output
    assert run.output.count("harness setup: done before") == 1, run.output
    assert (tmp_path / "data/answer").read_text() == "42\n"
    plan = json.loads((run.runs_dir / run.run_id / "plan.json").read_text())
    assert all("\nmkdir -p .harness && (" in node["setup"] for node in plan["nodes"]), plan["nodes"][0]["setup"]
    assert_nothing_left(run.run_id)


def test_offline_data_preparation_fails_the_launch_saying_what_to_do(write_yaml, launch, tmp_path):
    """jobs/cifar.yaml's setup, `harness prepare`, without network: the node's own `harness` (the job's
    Python first on PATH) says what it tried; nothing trains and nothing is left running. The torch that `harness
    prepare` imports (harness.payload.data's) is the stand-in's here too. The job shares this machine's network
    (simulated.network: host), and the launch says its store is then open to the machine's users."""
    job = ddp_job(write_yaml, standin=True)
    mirror = (tmp_path / "offline" / "cifar-10-python.tar.gz").as_uri()
    job.write_text(job.read_text() + f"setup: [harness prepare --data-dir data/cifar10 --url {mirror}]\n"
                                      f"simulated: {{network: host}}\n")
    run = launch(job, cwd=tmp_path)
    assert run.finish() == 1, run.output
    assert run.output.count("harness: the job's rendezvous store is open to every user of this machine "
                            "(simulated.network is host): torch's store has no authentication") == 1, run.output
    failure = run.summary()["first_failure"]
    assert failure["exit_code"] == 1, failure
    assert f"error: could not download {mirror}" in failure["last_lines"][-2], failure
    assert "or name a mirror with --url, and run prepare again" in failure["last_lines"][-2], failure
    assert "harness setup failed: exit 1; torchrun was not started here" in failure["last_lines"][-1]
    assert (failure["kind"], failure["evidence"]) == ("program", "the job's setup failed, exit code 1; torchrun was "
                                                                 "not started"), failure
    assert "[rank" not in run.output
    assert_nothing_left(run.run_id)


def test_ssh_hosts_with_workdirs_of_their_own_each_run_the_setup(cluster2: Cluster, write_yaml, launch, tmp_path):
    """Preflight (the launch's own, fast: no torch import on the hosts) fails a missing data path, and only warns of
    it once the setup will create it; each host's setup then runs in its own workdir."""
    workdirs = {h.name: tmp_path / h.name for h in cluster2.hosts}
    for path in workdirs.values():
        path.mkdir()
    hosts = cluster2.write_inventory(tmp_path / "hosts.yaml",
                                     overrides={name: {"workdir": str(path)} for name, path in workdirs.items()})
    job = ddp_job(write_yaml, standin=True, STEPS="4")
    job.write_text(job.read_text() + DATA)
    checked = run_preflight(load_inventory(hosts), load_job(job), known_hosts=cluster2.known_hosts, fast=True)
    assert not checked.ok and data_rows(checked) == {("fail", "data/answer is missing in")}, checked.render_table()
    job.write_text(job.read_text() + COMMANDS)
    checked = run_preflight(load_inventory(hosts), load_job(job), known_hosts=cluster2.known_hosts, fast=True)
    assert checked.ok, checked.render_table()
    assert data_rows(checked) == {("warn", "data/answer is missing in")}, "setup will create it"
    run = launch(job, "--hosts", str(hosts), "--known-hosts", str(cluster2.known_hosts))
    assert run.finish() == 0, run.output
    assert [(workdirs[h.name] / "setup-ran").read_text().split()[0] for h in cluster2.hosts] == ["0", "1"]
    assert run.output.count("harness setup: running 2 command(s)") == 2, run.output
    assert_nothing_left(run.run_id)


def data_rows(report: Report) -> set[tuple[str, str]]:
    rows = [check for check in report.checks if check.name == "data"]
    assert len(rows) == 2, rows
    return {(check.status.value, check.reason.split(" /")[0]) for check in rows}
