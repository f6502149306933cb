"""Planning and rendering are pure: golden plans, one master for all, hostile arguments intact."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.plan.planner import NodePlan, job_hosts, plan_hosts, plan_local
from harness.plan.render import render_json, render_text
from harness.plan.shell import shell_command, standby_command, standby_order, why_cold
from harness.spec.inventory import load_inventory
from harness.spec.job import load_job
from harness.targets.agent_link import STANDBY
from harness.targets.ssh.backend import SSHBackend

from conftest import free_port, harness

GOLDEN = Path(__file__).parents[1] / "golden"
JOB = """
name: golden
nnodes: {nnodes}
nproc_per_node: {nproc}
backend: gloo
master_port: 29400
rdzv: {rdzv}
entrypoint:
  script: train.py
  args: [--epochs, 2, "--note=a b"]
env:
  NCCL_DEBUG: WARN
"""
HOSTS = """
defaults: {user: ml, python: /opt/venv/bin/python, workdir: /srv/job, gpus: 2}
hosts:
  - {name: n1, address: 10.9.0.1}
  - {name: n2, address: 10.9.0.2}
  - {name: n3, address: 10.9.0.3}
  - {name: n4, address: 10.9.0.4, interface: ib0}
"""
CASES = {
    "local-1": dict(nnodes=1, nproc=2, rdzv="static", hosts=False),
    "local-2": dict(nnodes=2, nproc=1, rdzv="static", hosts=False),
    "hosts-4": dict(nnodes=4, nproc="auto", rdzv="static", hosts=True,
                    extra="setup: [python -m prep --out 'data/x y']\ndata_paths: [data/x y]\n"),
    "hosts-2-c10d": dict(nnodes=2, nproc=1, rdzv="c10d", hosts=True),
}


def make_plan(write_yaml, case: dict):
    spec = load_job(write_yaml(JOB.format(**case) + case.get("extra", "")))
    if case["hosts"]:
        return plan_hosts(spec, job_hosts(spec, load_inventory(write_yaml(HOSTS, "hosts.yaml"))), run_id="golden-run",
                          master_ip="10.9.0.1", interfaces={"n2": "eth1", "n4": "eth9"})
    return plan_local(spec, run_id="golden-run", python="python3")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plan(write_yaml, name):
    """UPDATE_GOLDEN=1 rewrites the files; review the diff before committing it."""
    rendered = render_json(make_plan(write_yaml, CASES[name]))
    golden = GOLDEN / f"{name}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert rendered == golden.read_text()


@pytest.mark.parametrize("name", sorted(CASES))
def test_nodes_share_one_master_and_ranks_are_dense(write_yaml, name):
    plan = make_plan(write_yaml, CASES[name])
    assert [n.node_rank for n in plan.nodes] == list(range(plan.nnodes))
    assert {n.env["MASTER_ADDR"] for n in plan.nodes} == {plan.master_addr}
    assert {n.env["MASTER_PORT"] for n in plan.nodes} == {"29400"}
    assert {n.env["NNODES"] for n in plan.nodes} == {str(plan.nnodes)}
    assert all(n.env["NODE_RANK"] == str(n.node_rank) for n in plan.nodes)
    # torchrun's default for its --node-rank, except under c10d, where it ignores one and warns of it in the stream
    assert all(n.env.get("PET_NODE_RANK") == (n.env["NODE_RANK"] if "--rdzv-backend=c10d" not in n.argv else None)
               for n in plan.nodes)
    assert sorted(r for n in plan.nodes for r in n.ranks) == list(range(plan.world_size))
    # By environment: torchrun 2.2 to 2.11 lack the --log-line-prefix-template flag, and read a space in
    # its value as the start of the script.
    assert all(n.env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]: " and "--tee=3" in n.argv
               for n in plan.nodes)


def test_auto_nproc_uses_the_hosts_gpus(write_yaml):
    plan = make_plan(write_yaml, CASES["hosts-4"])
    assert plan.nproc_per_node == 2 and plan.world_size == 8


def test_auto_nproc_is_one_without_gpus(write_yaml):
    spec = load_job(write_yaml(JOB.format(nnodes=1, nproc="auto", rdzv="static")))
    assert plan_local(spec, run_id="r", python="python3").nproc_per_node == 1


def _local_spec(write_yaml, *, nnodes: int, nproc: str = "auto", backend: str = "nccl"):
    text = JOB.format(nnodes=nnodes, nproc=nproc, rdzv="static").replace("backend: gloo", f"backend: {backend}")
    return load_job(write_yaml(text))


def _visible(plan) -> list[str | None]:
    return [node.env.get("CUDA_VISIBLE_DEVICES") for node in plan.nodes]


@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_simulated_nodes_split_the_machines_gpus(write_yaml, backend):
    """8 GPUs, 2 nodes: `auto` is each node's share, and each node sees only its own devices."""
    gpus = [str(i) for i in range(8)]
    plan = plan_local(_local_spec(write_yaml, nnodes=2, backend=backend), run_id="r", python="python3", gpu_ids=gpus)
    assert plan.nproc_per_node == 4 and _visible(plan) == ["0,1,2,3", "4,5,6,7"]
    one_each = plan_local(_local_spec(write_yaml, nnodes=2, nproc="1"), run_id="r", python="python3", gpu_ids=gpus)
    assert one_each.nproc_per_node == 1 and _visible(one_each) == ["0", "1"]


def test_the_split_follows_the_devices_this_machine_shows(write_yaml):
    """CUDA_VISIBLE_DEVICES=GPU-a,GPU-b for the launch: node k gets the k-th of those, not device k."""
    plan = plan_local(_local_spec(write_yaml, nnodes=2), run_id="r", python="python3", gpu_ids=["GPU-a", "GPU-b"])
    assert _visible(plan) == ["GPU-a", "GPU-b"]


def test_a_jobs_own_cuda_visible_devices_wins(write_yaml):
    spec = _local_spec(write_yaml, nnodes=2, nproc="1")
    spec = spec.model_copy(update={"env": {"CUDA_VISIBLE_DEVICES": "3"}})
    assert _visible(plan_local(spec, run_id="r", python="python3", gpu_ids=["0", "1"])) == ["3", "3"]


@pytest.mark.parametrize("nnodes, nproc, gpus, message", [
    (2, "auto", 1, "2 simulated nodes x 1 GPU rank(s) need 2 GPUs and this machine has 1; one GPU cannot host "
                   "two NCCL ranks"),
    (2, "2", 3, "2 simulated nodes x 2 GPU rank(s) need 4 GPUs and this machine has 3"),
    (1, "1", 0, "backend nccl needs CUDA GPUs and this machine has none: set `backend: gloo`"),
])
def test_a_gpu_job_this_machine_cannot_host_is_refused_at_plan_time(write_yaml, nnodes, nproc, gpus, message):
    spec = _local_spec(write_yaml, nnodes=nnodes, nproc=nproc)
    with pytest.raises(UsageError, match=re.escape(message)):
        plan_local(spec, run_id="r", python="python3", gpu_ids=[str(i) for i in range(gpus)])


def test_gloo_jobs_run_anywhere(write_yaml):
    """No GPUs: one CPU worker per node and no device split; more ranks than GPUs: gloo may share them."""
    cpu = plan_local(_local_spec(write_yaml, nnodes=2, backend="gloo"), run_id="r", python="python3")
    assert cpu.nproc_per_node == 1 and _visible(cpu) == [None, None]
    shared = plan_local(_local_spec(write_yaml, nnodes=2, nproc="2", backend="gloo"), run_id="r", python="python3",
                        gpu_ids=["0"])
    assert shared.nproc_per_node == 2 and _visible(shared) == [None, None]


def test_auto_nproc_with_unknown_gpus_is_an_error(write_yaml):
    spec = load_job(write_yaml(JOB.format(nnodes=1, nproc="auto", rdzv="static")))
    inventory = load_inventory(write_yaml("hosts:\n  - {name: a, address: 10.0.0.1}\n", "h.yaml"))
    with pytest.raises(UsageError, match="GPU count of a is unknown"):
        plan_hosts(spec, job_hosts(spec, inventory), run_id="r", master_ip="10.0.0.1")


def test_master_must_be_an_ip(write_yaml):
    spec = load_job(write_yaml(JOB.format(nnodes=1, nproc=1, rdzv="static")))
    inventory = load_inventory(write_yaml(HOSTS, "hosts.yaml"))
    with pytest.raises(UsageError, match="must be an IP address"):
        plan_hosts(spec, job_hosts(spec, inventory), run_id="r", master_ip="gpu-01.example")


HOSTILE = ["a b", "it's", '"quoted"', "$(touch /tmp/pwned)", "`id`", "x;y", "*", "back\\slash", "new\nline", "", "--flag=$HOME"]


def test_shell_form_delivers_hostile_arguments_intact(tmp_path):
    """Run the rendered shell line in a real shell: argv and env must arrive byte for byte."""
    printer = "import json, os, sys; print(json.dumps([sys.argv[1:], os.environ['WEIRD'], os.getcwd()]))"
    node = NodePlan(host="h", address="127.0.0.1", node_rank=0, nproc=1,
                    argv=(sys.executable, "-c", printer, *HOSTILE), env={"WEIRD": "v a l'$x"}, workdir=str(tmp_path))
    out = subprocess.run(["/bin/sh", "-c", shell_command(node)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [HOSTILE, "v a l'$x", str(tmp_path)]


def test_a_standby_becomes_exactly_the_node_it_is_told(tmp_path):
    """A standby (torchrun and a warm worker imported, waiting; harness.node.standby installed as its agent does)
    given its node's order runs that node's worker with the node's arguments, environment and directory byte for
    byte, the script as Python runs one; warm where only what torch reads late changed, afresh where more did
    (a key only the standby had). Real torchrun, in a real shell."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    (agent_dir / "standby.py").write_text(STANDBY)
    script = tmp_path / "show.py"
    script.write_text("import json, os, sys\nprint(json.dumps([sys.argv, os.environ.get('WEIRD'), "
                      "os.environ.get('ONLY_STANDBY'), os.environ['NODE_RANK'], os.getcwd(), sys.path[0], __name__, "
                      "'torch' in sys.modules]))\nsys.exit(3 if os.environ['WEIRD'] == 'fail' else 0)\n")

    def node(env: dict[str, str]) -> NodePlan:
        return NodePlan(host="h", address="127.0.0.1", node_rank=0, nproc=1, workdir=str(tmp_path), env=env,
                        argv=(sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=1",
                              "--master-addr=127.0.0.1", f"--master-port={free_port()}", "--max-restarts=0",
                              str(script), *HOSTILE))

    def start(standby_env: dict[str, str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
        """A standby started with standby_env, told to be the node with env (three at once: two cores)."""
        standby, told = (node({**e, "HARNESS_AGENT_DIR": str(agent_dir)}) for e in (standby_env, env))
        return subprocess.Popen(["/bin/sh", "-c", standby_command(standby)], stdin=subprocess.PIPE, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE), standby_order(standby, told) + "\n"

    told = {"NODE_RANK": "0", "WEIRD": "v a l'$x"}
    assert why_cold(node(told)) == "" and "container" in why_cold(replace(node(told), cleanup=("docker", "rm", "x")))
    started = [start({"NODE_RANK": "7", "WEIRD": "v a l'$x"}, told),
               start({"NODE_RANK": "7", "WEIRD": "v a l'$x", "ONLY_STANDBY": "1"}, told),
               start({"NODE_RANK": "7", "WEIRD": "fail"}, {**told, "WEIRD": "fail"})]
    (warm, _), (cold, _), (_, failed) = [process.communicate(order, timeout=120) for process, order in started]
    assert [process.returncode for process, _ in started] == [0, 0, 1], failed
    assert json.loads(warm.splitlines()[-1]) == [[str(script), *HOSTILE], "v a l'$x", None, "0", str(tmp_path),
                                                 str(tmp_path), "__main__", True]
    assert json.loads(cold.splitlines()[-1])[2:] == [None, "0", str(tmp_path), str(tmp_path), "__main__", False]
    assert "ChildFailedError" in failed and "exitcode  : 3" in failed, failed


def test_render_cli_json_shape(write_yaml):
    job = write_yaml(JOB.format(nnodes=2, nproc=1, rdzv="static"))
    result = harness("render", str(job), "--format", "json")
    assert result.returncode == 0, result.stderr
    nodes = json.loads(result.stdout)["nodes"]
    assert [sorted({"host", "node_rank", "argv", "env"} - set(n)) for n in nodes] == [[], []]
    assert [n["node_rank"] for n in nodes] == [0, 1]


def test_render_cli_text_shows_each_node(write_yaml):
    hosts = write_yaml(HOSTS, "hosts.yaml")
    result = harness("render", str(write_yaml(JOB.format(nnodes=2, nproc=1, rdzv="static"))), "--hosts", str(hosts))
    assert result.returncode == 0, result.stderr
    assert "# node1 on n2 (10.9.0.2): node_rank 1, global ranks 1" in result.stdout
    assert "cd -- /srv/job && exec env" in result.stdout and "'--note=a b'" in result.stdout


def test_render_text_and_json_agree(write_yaml):
    plan = make_plan(write_yaml, CASES["local-2"])
    text = render_text(plan)
    assert all(shell_command(node) in text for node in plan.nodes)


def test_container_jobs_run_torchrun_in_the_image(write_yaml):
    text = JOB.format(nnodes=2, nproc=1, rdzv="static") + "image: registry.example/harness:0.1.0\ncontainer: true\n"
    spec = load_job(write_yaml(text))
    plan = SSHBackend(load_inventory(write_yaml(HOSTS, "hosts.yaml"))).plan(spec, "golden-run")
    node = plan.nodes[1]
    image_at = node.argv.index("registry.example/harness:0.1.0")
    assert node.argv[:3] == ("docker", "run", "--rm") and "--network=host" in node.argv
    assert "--name=harness-golden-run-node1" in node.argv and "--gpus=all" in node.argv
    assert "--entrypoint=python" in node.argv and node.argv[image_at + 1:image_at + 3] == ("-m", "torch.distributed.run")
    assert "--env=NODE_RANK" in node.argv and "--env=MASTER_ADDR" in node.argv  # their values: the line's env
    assert " NODE_RANK=1 " in shell_command(node) and " MASTER_ADDR=10.9.0.1 " in shell_command(node)
    assert node.cleanup == ("docker", "rm", "--force", "harness-golden-run-node1")
    assert "# after a forced stop: docker rm --force harness-golden-run-node1" in render_text(plan)


def test_podman_runs_the_same_plan_with_its_own_gpu_flag(write_yaml):
    """Only the engine's name and its GPU flag differ; a host without GPUs gets no GPU flag at all."""
    text = JOB.format(nnodes=2, nproc=1, rdzv="static") + "image: r.example/h:1\ncontainer: {engine: podman}\n"
    plan = SSHBackend(load_inventory(write_yaml(HOSTS, "hosts.yaml"))).plan(load_job(write_yaml(text)), "golden-run")
    node = plan.nodes[1]
    assert node.argv[:3] == ("podman", "run", "--rm") and "--device=nvidia.com/gpu=all" in node.argv
    assert "--gpus=all" not in node.argv and "--ulimit=memlock=-1" in node.argv
    assert node.cleanup == ("podman", "rm", "--force", "harness-golden-run-node1")
    cpu_hosts = write_yaml(HOSTS.replace("gpus: 2", "gpus: 0"), "cpu.yaml")
    cpu_node = SSHBackend(load_inventory(cpu_hosts)).plan(load_job(write_yaml(text)), "golden-run").nodes[1]
    assert not [a for a in cpu_node.argv if a.startswith(("--device", "--gpus", "--ulimit"))]


@pytest.mark.parametrize("value, message", [
    ("{engine: lxc}", "container.engine: Input should be 'docker' or 'podman'"),
    ("sometimes", "container: expected true, false or a mapping such as {engine: podman}, got 'sometimes'"),
    ("{engine: podman, gpus: 1}", "container.gpus: unknown key 'gpus'; expected one of: engine"),
])
def test_bad_container_settings_name_the_key(write_yaml, value, message):
    text = JOB.format(nnodes=1, nproc=1, rdzv="static") + f"image: r/h:1\ncontainer: {value}\n"
    result = harness("render", str(write_yaml(text)))
    assert result.returncode == 2 and "job.yaml:13:" in result.stderr and message in result.stderr, result.stderr


def test_container_false_is_no_container(write_yaml):
    text = JOB.format(nnodes=1, nproc=1, rdzv="static") + "container: false\n"
    assert load_job(write_yaml(text)).container is None


def test_container_needs_an_image_and_hosts(write_yaml):
    from harness.errors import SpecError

    with pytest.raises(SpecError, match="container: true runs every node in `image:`"):
        load_job(write_yaml(JOB.format(nnodes=1, nproc=1, rdzv="static") + "container: true\n"))
    spec = load_job(write_yaml(JOB.format(nnodes=1, nproc=1, rdzv="static") + "image: r/h:1\ncontainer: true\n"))
    with pytest.raises(UsageError, match="over SSH"):
        plan_local(spec, run_id="r", python="python3")
