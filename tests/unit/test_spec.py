"""Job spec validation: every bad input is located (file:line:col + key path) and exits 2."""

from __future__ import annotations

import re

import pytest
import yaml

from harness.errors import SpecError
from harness.spec.job import Health, Restarts, load_job

from conftest import REPO, harness

GOOD = """
name: demo
nnodes: 2
entrypoint:
  module: harness.payload.train
  args: [--epochs, 3, --lr, 0.1]
"""


def problems(path) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_job(path)
    return [str(p) for p in info.value.problems]


def test_minimal_spec_gets_documented_defaults(write_yaml):
    spec = load_job(write_yaml(GOOD))
    assert (spec.nproc_per_node, spec.backend, spec.master_port, spec.rdzv, spec.restarts) == (1, "auto", "auto", "static", Restarts(max=0, on="infra", backoff=5))
    assert spec.entrypoint.args == ["--epochs", "3", "--lr", "0.1"]


def test_shipped_jobs_are_valid():
    for path in sorted((REPO / "jobs").glob("*.yaml")):
        load_job(path)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: demo\nnnodes: 2\nentrypoint: {module: m}\nnprocs_per_node: 2\n",
         "job.yaml:4:1: nprocs_per_node: unknown key 'nprocs_per_node' (did you mean 'nproc_per_node'?)"),
        ("name: Demo_Job\nnnodes: 1\nentrypoint: {module: m}\n", "job.yaml:1:1: name: expected a DNS-1123 label"),
        ("name: demo\nnnodes: 0\nentrypoint: {module: m}\n", "job.yaml:2:1: nnodes: expected an integer from 1 to 4096, got 0"),
        ("name: demo\nnnodes: 1\nnproc_per_node: many\nentrypoint: {module: m}\n",
         "job.yaml:3:1: nproc_per_node: expected an integer from 1 to 1024, or 'auto'"),
        ("name: demo\nnnodes: 1\nbackend: mpi\nentrypoint: {module: m}\n", "job.yaml:3:1: backend: Input should be 'auto', 'nccl' or 'gloo'"),
        ("name: demo\nnnodes: 1\nmaster_port: 80\nentrypoint: {module: m}\n",
         "job.yaml:3:1: master_port: expected a port from 1024 to 65535, or auto (a free port picked on the master "
         "host at launch), got 80"),
        ("name: demo\nnnodes: 1\nrdzv: etcd\nentrypoint: {module: m}\n", "job.yaml:3:1: rdzv: Input should be 'static' or 'c10d'"),
        ("name: demo\nnnodes: 1\nnetwork: {interface: eth 1}\nentrypoint: {module: m}\n",
         "job.yaml:3:11: network.interface: expected a network interface name such as eth1 or ib0 (at most 15 "
         "letters, digits, '_', '.', ':' or '-'), got 'eth 1'"),
        ("name: demo\nnnodes: 1\nnetwork: {iface: eth1}\nentrypoint: {module: m}\n",
         "job.yaml:3:11: network.iface: unknown key 'iface'"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m, script: t.py}\n",
         "job.yaml:3:1: entrypoint: set exactly one of 'module'"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m, local_rank_arg: local_rank}\n",
         "job.yaml:3:25: entrypoint.local_rank_arg: expected a command-line option such as --local_rank "
         "or --local-rank, got 'local_rank'"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nsimulated: {workdir: nodes}\n",
         "job.yaml:4:13: simulated.workdir: expected a directory with {node_rank} in it (one per node) and no other "
         "{...}, got 'nodes'"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nsimulated: {workdir: '/abs/{node_rank}'}\n",
         "job.yaml:4:13: simulated.workdir: expected a relative directory such as nodes/node{node_rank}"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nsetup: [make data, 3]\n",
         "job.yaml:4:20: setup[1]: expected a shell command such as 'harness prepare --data-dir data/cifar10', got 3"),
        ("name: demo\nnnodes: 1\nentrypoint: {args: [a]}\n", "job.yaml:3:1: entrypoint: set exactly one of 'module'"),
        ("name: demo\nnnodes: 1\nentrypoint:\n  module: m\n  args: [--x, true]\n",
         "job.yaml:5:15: entrypoint.args[1]: expected a string or number, got true; quote it"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nenv:\n  MASTER_ADDR: 10.0.0.1\n",
         "job.yaml:5:3: env.MASTER_ADDR: MASTER_ADDR is set by the harness/torchrun for every node and cannot be overridden"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nenv:\n  PET_NNODES: '3'\n",
         "job.yaml:5:3: env.PET_NNODES: PET_NNODES is set by the harness/torchrun"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nenv:\n  WORLD_SIZE: '3'\n", "env.WORLD_SIZE: WORLD_SIZE is set by the harness"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nenv:\n  OMP_NUM_THREADS: 4\n",
         "job.yaml:5:3: env.OMP_NUM_THREADS: expected a string, got 4; quote it if you mean the text: '4'"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nresources: {memory: 16GB}\n",
         "job.yaml:4:13: resources.memory: expected a Kubernetes quantity from 1Mi to 1Pi bytes, such as 16Gi or 512Mi, "
         "got '16GB'"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nresources: {gpus: -1}\n",
         "resources.gpus: Input should be greater than or equal to 0"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nimage: 'Not An Image'\n", "job.yaml:4:1: image: expected an image reference"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\ntimeouts: {stop_grace: 30}\n",
         "timeouts.stop_grace: Input should be less than or equal to 4"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nrestarts: {max: -1}\n", "restarts.max: Input should be greater than or equal to 0"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nhealth: {metrics_address: everywhere}\n",
         "job.yaml:4:10: health.metrics_address: expected an IP address of this machine (127.0.0.1, 0.0.0.0 for every "
         "interface, ::1), got 'everywhere'"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nrestarts: {max: 1, standby: true}\n",
         "job.yaml:4:20: restarts.standby: expected the seconds into an attempt at which its standbys start (60), or "
         "false for none, got true"),
        ("name: demo\nnnodes: 1\nentrypoint: {module: m}\nrestarts: {max: 1, standby: -1}\n",
         "restarts.standby: expected from 0 to 86400 seconds, or false for none, got -1"),
        ("name: demo\nnnodes: 1\nentrypoint: {script: t.py}\nfiles: [model.py, /etc/passwd]\n",
         "job.yaml:4:19: files[1]: '/etc/passwd' must be relative to the directory `harness render` runs in, without "
         "'..': the pods get it under the same relative path"),
        ("name: demo\nnnodes: 1\nentrypoint: {script: t.py}\nfiles: [lib/../../secrets]\n",
         "job.yaml:4:9: files[0]: 'lib/../../secrets' must be relative"),
        ("name: demo\nnnodes: 1\nentrypoint: {script: t.py}\nfiles: ['']\n",
         "job.yaml:4:9: files[0]: expected a relative path such as model.py or configs/, got ''"),
        ("name: demo\nnnodes: 1\nentrypoint: {script: t.py}\nfiles: [\"a\\0b\"]\n", "job.yaml:4:9: files[0]: contains a NUL byte"),
        ("name: demo\nnnodes: 1\nentrypoint: {script: t.py}\nfiles: model.py\n",
         "job.yaml:4:1: files: Input should be a valid list"),
        ("name: demo\nentrypoint: {module: m}\n", "job.yaml:1:1: nnodes: required key is missing"),
        ("name: demo\nnnodes: 1\nnnodes: 2\nentrypoint: {module: m}\n", "job.yaml:3:1: nnodes: duplicate key 'nnodes'"),
        ("name: demo\nnnodes: [1\n", "job.yaml:3:1: invalid YAML"),
        ("- just\n- a list\n", "job.yaml:1:1: expected a mapping of keys"),
        ("", "job.yaml: the file is empty; expected a mapping"),
    ],
)
def test_bad_spec_is_located_and_explained(write_yaml, text, expected):
    found = problems(write_yaml(text))
    assert any(expected in p for p in found), found


def test_a_misspelt_required_key_is_said_first_and_alone(write_yaml):
    """`nnode:` is the problem; `nnodes` missing is what follows from it, not a second one to fix."""
    found = problems(write_yaml("name: demo\nnnode: 2\nentrypoint: {module: m}\nbackend: mpi\n"))
    assert "job.yaml:2:1: nnode: unknown key 'nnode' (did you mean 'nnodes'?)" in found[0], found
    assert len(found) == 2 and not any("required key is missing" in problem for problem in found), found


def test_every_problem_is_reported_at_once(write_yaml):
    found = problems(write_yaml("name: BAD\nnnodes: 0\nentrypoint: {module: m}\ntypo: 1\n"))
    assert len(found) == 3, found


def test_cli_exits_2_with_the_location_on_stderr(write_yaml):
    path = write_yaml("name: demo\nnnodes: 1\nentrypoint: {module: m}\nenv:\n  RANK: '0'\n")
    result = harness("render", str(path))
    assert result.returncode == 2
    assert f"{path}:5:3: env.RANK: RANK is set by the harness" in result.stderr
    assert result.stdout == ""


def test_missing_file_exits_2():
    result = harness("render", "jobs/does-not-exist.yaml")
    assert result.returncode == 2
    assert "jobs/does-not-exist.yaml: file not found" in result.stderr


def test_the_health_section_docs_health_md_shows_is_the_default() -> None:
    """docs/health.md says its `health:` block holds the defaults (the progress patterns, spec/progress.py, it
    describes in words)."""
    block = re.search(r"## The `health:` section\n+```yaml\n(.*?)```", (REPO / "docs" / "health.md").read_text(), re.S)
    assert block, "docs/health.md's health: block"
    assert Health.model_validate(yaml.safe_load(block.group(1))["health"]) == Health()
