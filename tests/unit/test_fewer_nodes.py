"""Runs that go on with fewer nodes, the rules: restarts.min_nnodes in the spec, spares before fewer
nodes, the plan of a smaller attempt on every supervised target, and what the records and the report
say of it (real runs: test_recovery.py, test_slurm.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from harness.control.summary_text import report
from harness.control.terminal import Terminal
from harness.errors import SpecError
from harness.plan.planner import NoSpareHosts, job_hosts
from harness.record.rundir import RunDir
from harness.record.schema import Attempt, FailureKind, RunStatus, RunSummary
from harness.spec.inventory import load_inventory
from harness.spec.job import load_job
from harness.targets.local.backend import LocalBackend
from harness.targets.ssh.backend import SSHBackend

from conftest import harness


def hosts(count: int) -> str:
    return "hosts:\n" + "".join(f"  - {{name: h{i}, address: 10.0.0.{i}}}\n" for i in range(1, count + 1))


def job(write_yaml, nnodes: int = 3, restarts: str = "{max: 2, min_nnodes: 2}", extra: str = ""):
    return load_job(write_yaml(f"name: a\nnnodes: {nnodes}\nbackend: gloo\nentrypoint: {{module: m}}\n"
                               f"restarts: {restarts}\n{extra}"))


@pytest.mark.parametrize("restarts,expected", [
    ("{min_nnodes: 4}", "job.yaml:5:12: restarts.min_nnodes: expected at most nnodes (3): a run never grows past "
                        "nnodes, it shrinks to no fewer than min_nnodes, got 4"),
    ("{min_nnodes: 0}", "restarts.min_nnodes: Input should be greater than or equal to 1"),
    ("{min_nnodes: '2'}", "restarts.min_nnodes: Input should be a valid integer"),
    ("{min_nnodes: 02}", "restarts.min_nnodes: 02 has a leading zero"),
])
def test_a_bad_min_nnodes_is_located(write_yaml, restarts, expected):
    with pytest.raises(SpecError) as caught:
        job(write_yaml, restarts=restarts)
    assert expected in str(caught.value), caught.value


def test_unset_min_nnodes_means_the_run_never_shrinks(write_yaml):
    spec = job(write_yaml, restarts="{max: 1}")
    assert (spec.restarts.min_nnodes, spec.fewest_nnodes) == (None, 3)
    assert job(write_yaml, restarts="{min_nnodes: 3}").fewest_nnodes == 3


def test_spares_come_first_then_the_job_goes_on_with_fewer_hosts(write_yaml):
    spec, inventory = job(write_yaml), load_inventory(write_yaml(hosts(4), "hosts.yaml"))
    assert [h.name for h in job_hosts(spec, inventory)] == ["h1", "h2", "h3"]
    assert [h.name for h in job_hosts(spec, inventory, frozenset({"h2"}))] == ["h1", "h3", "h4"]  # the spare
    assert [h.name for h in job_hosts(spec, inventory, frozenset({"h2", "h3"}))] == ["h1", "h4"]  # fewer
    assert [h.name for h in job_hosts(spec, inventory, frozenset({"h1", "h3"}))] == ["h2", "h4"]  # a new master
    with pytest.raises(NoSpareHosts) as caught:
        job_hosts(spec, inventory, frozenset({"h1", "h2", "h3"}))
    assert str(caught.value) == (
        f"host(s) down: h1, h2, h3, and no spare left: the job needs nnodes=3 hosts, at least "
        f"restarts.min_nnodes=2, 1 of the inventory's 4 is left, not known to be down (h4); add hosts to "
        f"{inventory.path} or lower nnodes, or lower restarts.min_nnodes")


def test_without_min_nnodes_no_spare_left_says_how_to_go_on_with_fewer(write_yaml):
    spec, inventory = job(write_yaml, restarts="{max: 1}"), load_inventory(write_yaml(hosts(4), "hosts.yaml"))
    with pytest.raises(NoSpareHosts, match=r"the job needs nnodes=3 hosts, 2 of the inventory's 4 are left, not "
                                           r"known to be down \(h1, h4\); add hosts to \S+ or lower nnodes, or set "
                                           r"restarts.min_nnodes to go on with fewer$"):
        job_hosts(spec, inventory, frozenset({"h2", "h3"}))


def test_a_smaller_plan_over_ssh_renumbers_the_ranks_and_moves_the_master(write_yaml):
    spec = job(write_yaml, extra="nproc_per_node: 2\n")
    backend = SSHBackend(load_inventory(write_yaml(hosts(3), "hosts.yaml")))
    plan = backend.plan(spec, "r", down=frozenset({"h1"}))
    assert (plan.nnodes, plan.world_size, plan.master_addr) == (2, 4, "10.0.0.2")
    assert [(n.host, n.node_rank, list(n.ranks)) for n in plan.nodes] == [("h2", 0, [0, 1]), ("h3", 1, [2, 3])]
    for node in plan.nodes:
        assert (node.env["NNODES"], node.env["MASTER_ADDR"], node.env["NODE_RANK"]) == \
            ("2", "10.0.0.2", str(node.node_rank))
        assert "--nnodes=2" in node.argv and f"--node-rank={node.node_rank}" in node.argv
    with pytest.raises(NoSpareHosts):
        backend.plan(spec, "r", down=frozenset({"h1", "h2"}))


def test_simulated_nodes_are_named_and_a_lost_one_is_left_out(write_yaml):
    """No spare on one machine: a lost simulated node's place stays empty, as restarts.min_nnodes allows."""
    backend = LocalBackend()
    whole = backend.plan(job(write_yaml), "r")
    assert [n.host for n in whole.nodes] == ["sim0", "sim1", "sim2"]
    fewer = backend.plan(job(write_yaml), "r", attempt=1, down=frozenset({"sim1"}))
    assert [(n.host, n.node_rank) for n in fewer.nodes] == [("sim0", 0), ("sim2", 1)]
    assert fewer.nnodes == 2 and {n.env["NNODES"] for n in fewer.nodes} == {"2"}
    with pytest.raises(NoSpareHosts) as caught:
        backend.plan(job(write_yaml, nnodes=2, restarts="{max: 1}"), "r", down=frozenset({"sim1"}))
    assert str(caught.value) == ("simulated node(s) down: sim1, and no spare left: the job needs nnodes=2 simulated "
                                 "nodes, 1 of the job's 2 is left, not known to be down (sim0); set "
                                 "restarts.min_nnodes to go on with fewer")


def _attempt(number: int, hosts: list[str], status: RunStatus, down: list[str] = ()) -> Attempt:
    return Attempt(attempt=number, hosts=hosts, status=status, started_at=0.0, ended_at=1.0, nodes=[], failures=[],
                   kind=FailureKind.INFRA if down else None, down=list(down), preflight_s=0.0, nnodes=len(hosts),
                   world_size=len(hosts) * 2)


def test_the_report_names_each_attempts_size_when_the_run_went_on_with_fewer(tmp_path: Path):
    attempts = [_attempt(0, ["h1", "h2", "h3"], RunStatus.FAILED, down=["h2"]),
                _attempt(1, ["h1", "h3"], RunStatus.SUCCEEDED)]
    summary = RunSummary(run_id="r", name="a", status=RunStatus.SUCCEEDED, exit_code=0, started_at=0.0, ended_at=9.0,
                         duration_s=9.0, nodes=[], first_failure=None, attempts=attempts)
    assert summary.world_sizes == [6, 4]
    out = io.StringIO()
    terminal = Terminal(out)
    report(terminal, summary, RunDir(tmp_path))
    terminal.close()
    assert out.getvalue().splitlines() == [
        "harness: attempt 0 on h1, h2, h3 (3 node(s), world size 6): failed",
        "harness: attempt 1 on h1, h3 (2 node(s), world size 4): succeeded",
        f"harness: run r succeeded in 9.0 s, world size 6 -> 4; logs in {tmp_path}/",
    ]
    same = RunSummary(run_id="r", name="a", status=RunStatus.SUCCEEDED, exit_code=0, started_at=0.0, ended_at=9.0,
                      duration_s=9.0, nodes=[], first_failure=None, attempts=[attempts[1], attempts[1]])
    out = io.StringIO()
    terminal = Terminal(out)
    report(terminal, same, RunDir(tmp_path))
    terminal.close()
    assert "world size" not in out.getvalue()


def test_a_record_without_attempt_sizes_still_reads(tmp_path: Path):
    """Records written before attempts had nnodes and world_size."""
    attempt = {k: v for k, v in json.loads(json.dumps(_attempt(0, ["h1"], RunStatus.SUCCEEDED).__dict__,
                                                      default=str)).items() if k not in ("nnodes", "world_size")}
    summary = {"run_id": "r", "name": "a", "status": "succeeded", "exit_code": 0, "started_at": 0.0, "ended_at": 1.0,
               "duration_s": 1.0, "nodes": [], "first_failure": None, "attempts": [attempt]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    read = RunDir(tmp_path).read_summary()
    assert read is not None and read.attempts[0].world_size is None and read.world_sizes == []


@pytest.mark.parametrize("flags,restarter", [(["--target", "slurm"], "this script's job Slurm requeues on nnodes "
                                                                    "nodes it allocates afresh (`harness launch "
                                                                    "--target slurm` goes on with fewer)"),
                                             (["--target", "k8s", "--unsupervised"], "unsupervised, Kubernetes "
                                                                                     "(--flavor jobset) recreates all "
                                                                                     "nnodes pods")])
def test_a_scheduler_target_says_min_nnodes_does_not_apply_there(write_yaml, flags, restarter):
    path = write_yaml("name: a\nnnodes: 3\nbackend: gloo\nentrypoint: {module: m}\nimage: registry/x:1\n"
                      "restarts: {max: 1, min_nnodes: 2}\n")
    rendered = harness("render", str(path), *flags)
    assert rendered.returncode == 0, rendered.stderr
    assert f"harness render: restarts.min_nnodes (2) is for nodes the harness supervises (simulated, --hosts, " \
           f"Slurm's nodes under `harness launch`, supervised pods); {restarter}\n" in rendered.stderr
    supervised = harness("render", str(path), "--target", "k8s")
    assert supervised.returncode == 0 and "min_nnodes" not in supervised.stderr, supervised.stderr
    plain = harness("render", str(write_yaml("name: a\nnnodes: 3\nentrypoint: {module: m}\nimage: registry/x:1\n")),
                    *flags)
    assert plain.returncode == 0 and "min_nnodes" not in plain.stderr, plain.stderr
