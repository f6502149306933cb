"""Container jobs for real: podman on every namespace host, the image docker/Dockerfile builds
(podman_config.image_store), torchrun and gloo inside it.

Each host's podman sees the build's image store read-only (testbed/podman_config.py says why podman),
so a host "without the image" is one whose storage.conf drops that store.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import podman_config
from testbed.cluster import Cluster, missing_support, namespace_cluster
from testbed.podman_config import IMAGE, image_store

from conftest import (
    REPO,
    SCRIPT,
    SECRET_NAME,
    STOP_GRACE,
    Streamed,
    assert_nothing_left,
    assert_secret_kept,
    free_port,
    harness,
    stragglers_s,
    with_secret,
    worker_pid,
)


@pytest.fixture(scope="module")
def podman_cluster() -> Iterator[Cluster]:
    """Two hosts with podman and the image, and a workdir the image's uid 10001 may write to, holding the job's
    script and testbed/standin (the workdir is all a container mounts: standin_env)."""
    if reason := missing_support():
        pytest.skip(reason)
    for tool in ("podman", "buildah", "debootstrap", "nsenter"):
        assert shutil.which(tool), f"{tool} is missing: `make test` installs it (TEST_APT_PACKAGES)"
    store = image_store()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"harness-containers-{os.getpid()}"
    workdir.mkdir(mode=0o777)
    workdir.chmod(0o777)
    shutil.copy(SCRIPT, workdir / SCRIPT.name)
    shutil.copytree(REPO / "testbed" / "standin", workdir / "testbed" / "standin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "testbed" / "__init__.py", workdir / "testbed")
    try:
        with namespace_cluster(2, workdir=workdir, image_store=store) as cluster:
            yield cluster
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def standin_env(cluster: Cluster) -> dict[str, str]:
    """conftest.STANDIN_ENV as the containers see it: the stand-in torch from the workdir's copy of testbed/standin,
    the image's own harness beside it (the image is built from this checkout)."""
    return {"PYTHONPATH": f"{cluster.workdir / 'testbed' / 'standin' / 'shim'}:{cluster.workdir}"}


def container_job(path: Path, extra: str = "", **env: str) -> Path:
    """tests/scripts/ddp_sum.py on 2 nodes, inside the image with podman; env tunes its pace and failures."""
    lines = "".join(f"  {key}: '{value}'\n" for key, value in env.items())
    path.write_text(
        f"name: ddp-sum\nnnodes: 2\nbackend: gloo\nmaster_port: {free_port()}\n"
        f"entrypoint:\n  script: {SCRIPT.name}\n"
        f"image: {IMAGE}\ncontainer:\n  engine: podman\ntimeouts:\n  stop_grace: {STOP_GRACE:g}\n"
        + (f"env:\n{lines}" if lines else "") + extra
    )
    return path


def hosts_args(cluster: Cluster, tmp_path: Path) -> list[str]:
    return ["--hosts", str(cluster.write_inventory(tmp_path / "hosts.yaml")), "--known-hosts", str(cluster.known_hosts)]


def containers(cluster: Cluster, host: str) -> list[str]:
    """Every container the host's engine knows, running or not."""
    return cluster.podman(host, "ps", "--all", "--format", "{{.Names}}").stdout.split()


def assert_no_container(cluster: Cluster, within: float = 10.0) -> None:
    """The engines' own lists are empty on every host (`--rm` removes a container as it ends, asynchronously)."""
    deadline = time.monotonic() + within
    left = {h.name: containers(cluster, h.name) for h in cluster.hosts}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {h.name: containers(cluster, h.name) for h in cluster.hosts}
    assert not any(left.values()), f"containers left: {left}"


def assert_all_gone(cluster: Cluster, run_id: str) -> None:
    assert_nothing_left(run_id, within=STOP_GRACE + 5)
    assert_no_container(cluster)
    cluster.assert_only_sshd_left(within=10)


@contextlib.contextmanager
def without_image(cluster: Cluster, host: str) -> Iterator[None]:
    """The host's podman loses the image store for the block: the image is not on that host."""
    storage = Path("/etc/netns") / cluster.host(host).netns / "containers" / "storage.conf"
    original = storage.read_text()
    assert cluster.podman_dir is not None
    storage.write_text(podman_config.storage_conf(cluster.podman_dir / host, None))
    try:
        yield
    finally:
        storage.write_text(original)


def test_two_hosts_train_inside_the_image(podman_cluster, launch, tmp_path):
    """The job's setup runs in the image too (its python), once in the workdir the hosts share. A secret of the
    launching environment reaches the ranks in the containers through the engine's environment (--env NAME)."""
    setup = f"setup:\n  - python -c \"import sys; print(sys.executable, '{tmp_path}')\"\n"
    job, secret = with_secret(container_job(tmp_path / "job.yaml", setup, STEPS="10"))
    run = launch(job, *hosts_args(podman_cluster, tmp_path), env=os.environ | {SECRET_NAME: secret})
    assert run.finish(timeout=180) == 0, run.output
    assert_secret_kept(secret, run.output, 2, run.runs_dir)
    assert len(re.findall(rf"^\[node\d\] /opt/venv/bin/python {re.escape(str(tmp_path))}$", run.output, re.M)) == 1, \
        run.output
    assert run.output.count("harness setup: done before") == 1, run.output
    assert run.output.count("harness: h1, h2 started cold (torchrun, then its workers, each importing torch): it runs "
                            "in a container, whose engine starts its torchrun") == 1, run.output
    assert re.search(r"\[node0\] \[rank0\]: rank 0/2 up on h1;", run.output), run.output
    assert re.search(r"\[node1\] \[rank1\]: rank 1/2 up on h2;", run.output), run.output
    weights = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", run.output)
    assert sorted(r for r, _ in weights) == ["0", "1"] and len({w for _, w in weights}) == 1
    plan = json.loads((run.runs_dir / run.run_id / "plan.json").read_text())
    for node in plan["nodes"]:
        assert node["argv"][:4] == ["podman", "run", "--rm", "--init"]
        assert f"--name=harness-{run.run_id}-node{node['node_rank']}" in node["argv"]
        assert f"--env={SECRET_NAME}" in node["argv"]
    assert run.summary()["status"] == "succeeded"
    assert_all_gone(podman_cluster, run.run_id)


def test_harness_stop_removes_every_container(podman_cluster, launch, tmp_path):
    """`harness stop` (the stop path Ctrl-C shares) ends the run, whose containers the hosts' engines listed, and
    leaves no container. On the stand-in torch (standin_env): the stop is the harness's and the engine's, not
    torch's; test_a_rank_failure_stops_the_other_hosts_container shows real workers in the image's interpreter."""
    run = launch(container_job(tmp_path / "job.yaml", STEPS="100000", STEP_SECONDS="0.05",
                               **standin_env(podman_cluster)), *hosts_args(podman_cluster, tmp_path))
    run.wait_for(r"\[rank0\]: step 5 ")
    for rank, host in ((0, "h1"), (1, "h2")):
        assert containers(podman_cluster, host) == [f"harness-{run.run_id}-node{rank}"]
    stopped = harness("stop", run.run_id, "--runs-dir", str(run.runs_dir))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert run.finish(timeout=60) == 130, run.output
    assert run.summary()["status"] == "stopped"
    assert_all_gone(podman_cluster, run.run_id)


def test_a_rank_failure_stops_the_other_hosts_container(podman_cluster, launch, tmp_path):
    """The workers' interpreter is the image's /opt/venv python, in a container the engine lists; rank 1 SIGKILLed:
    the run fails at once with that rank's exit, and the other host's container is stopped, not left to run."""
    run = launch(container_job(tmp_path / "job.yaml", STEPS="100000", STEP_SECONDS="0.05", HANG_AT_STEP="150"),
                 *hosts_args(podman_cluster, tmp_path))
    run.wait_for(r"\[rank0\]: step 5 ")
    assert not Path("/opt/venv").exists()
    for rank, host in ((0, "h1"), (1, "h2")):
        assert Path(f"/proc/{worker_pid(run.run_id, rank)}/root/opt/venv/bin/python").exists()
        assert containers(podman_cluster, host) == [f"harness-{run.run_id}-node{rank}"]
    os.kill(worker_pid(run.run_id, 1), signal.SIGKILL)
    assert run.finish(timeout=60) == 1, run.output
    summary = run.summary()
    failure = summary["first_failure"]
    assert (failure["host"], failure["node_rank"], failure["rank"], failure["rank_exit_code"]) == ("h2", 1, 1, -9)
    assert stragglers_s(summary) < 10.0, summary  # guard: "within seconds", with the container's stop; not left to run
    assert_all_gone(podman_cluster, run.run_id)


def test_a_killed_controllers_containers_run_on_and_attach_over_ssh_takes_them_back(podman_cluster, launch, tmp_path):
    """SIGKILL of the controller: each host's agent holds its node, its container training on, until `harness
    attach` logs in to each host again and takes the run back through the agent's control socket; the run ends
    as if nothing had happened, every container removed. On the stand-in torch (standin_env): what holds the node is
    the harness's agent and the engine, not torch."""
    run = launch(container_job(tmp_path / "job.yaml", STEPS="200", STEP_SECONDS="0.05", **standin_env(podman_cluster)),
                 *hosts_args(podman_cluster, tmp_path))
    run.wait_for(r"\[rank0\]: step 5 ")
    run_id = run.run_id
    run.kill_group()
    runs = ["--runs-dir", str(tmp_path / "runs")]
    status = harness("status", run_id, *runs).stdout
    assert status.startswith(f"run {run_id}: running, unwatched for "), status
    attached = Streamed([sys.executable, "-m", "harness.cli", "attach", run_id, *runs])
    try:
        assert attached.finish(timeout=120) == 0, attached.output
    finally:
        attached.kill_group()
    assert f"harness: run {run_id}: taking back 2 node(s) x 1 process(es) on h1, h2" in attached.output
    assert f"harness: run {run_id} succeeded" in attached.output, attached.output
    steps = re.findall(r"\[node0\] \[rank0\]: step (\d+) ", harness("logs", run_id, *runs).stdout)
    assert steps == [str(step) for step in range(0, 200, 5)], steps  # every one, once
    assert_all_gone(podman_cluster, run_id)


def test_an_image_missing_on_one_host_fails_preflight_before_anything_starts(podman_cluster, launch, tmp_path):
    job = container_job(tmp_path / "job.yaml")
    with without_image(podman_cluster, "h2"):
        run = launch(job, *hosts_args(podman_cluster, tmp_path))
        assert run.finish(timeout=120) == 1, run.output
        checked = harness("preflight", str(podman_cluster.write_inventory(tmp_path / "hosts.yaml")), "--job", str(job),
                          "--known-hosts", str(podman_cluster.known_hosts), timeout=180)
    assert run.output.startswith("harness: error: preflight failed, nothing was started"), run.output
    assert re.search(rf"h2\s+image\s+FAIL\s+{re.escape(IMAGE)} is not on h2", run.output), run.output
    assert not (tmp_path / "runs").exists()
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert re.search(rf"h2\s+image\s+FAIL\s+{re.escape(IMAGE)} is not on h2", checked.stdout), checked.stdout
    assert f"podman pull {IMAGE}" in checked.stdout
    assert re.search(rf"h1\s+image\s+PASS\s+{re.escape(IMAGE)} is image [0-9a-f]{{12}}", checked.stdout)
    assert_no_container(podman_cluster)
    podman_cluster.assert_only_sshd_left()


def test_preflight_reads_the_versions_inside_the_image(podman_cluster, tmp_path):
    """The fingerprint is the image's (its /opt/venv python, its torch), not the host's, and the same on both."""
    job = container_job(tmp_path / "job.yaml")
    checked = harness("preflight", str(podman_cluster.write_inventory(tmp_path / "hosts.yaml")), "--job", str(job),
                      "--known-hosts", str(podman_cluster.known_hosts), "--json", timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads(checked.stdout)
    rows = {(c["host"], c["check"]): c for c in report["checks"]}
    for host in ("h1", "h2"):
        assert rows[(host, "engine")]["reason"].startswith("podman 4.")
        assert rows[(host, "image")]["status"] == "pass"
        assert report["facts"][host]["python_executable"] == "/opt/venv/bin/python"
        # ...but stacks on the host: the node agent, and so py-spy, runs there, outside the container
        assert report["facts"][host]["stacks"]["python"] == podman_cluster.python
        assert rows[(host, "stacks")]["status"] == "pass", rows[(host, "stacks")]
    labels = json.loads(podman_cluster.podman("h1", "image", "inspect", IMAGE).stdout)[0]["Labels"]
    assert report["facts"]["h1"]["torch"].split("+")[0] == labels["harness.torch"]
    assert report["facts"]["h1"]["cuda"] == labels["harness.cuda"]
    assert report["fingerprint"]["mismatched"] == []
    assert_no_container(podman_cluster)


def test_a_different_image_under_the_same_name_fails_preflight(podman_cluster, tmp_path):
    """h2 has its own image tagged like the job's (a tag pulled at another time): the ids differ."""
    base = next(line for line in podman_cluster.podman("h2", "images", "--format", "{{.Repository}}:{{.Tag}}")
                .stdout.split() if line.startswith("localhost/harness-image-test-base:"))
    podman_cluster.podman("h2", "create", "--name", "retagged", base, "true")
    try:
        podman_cluster.podman("h2", "commit", "--quiet", "retagged", IMAGE)
        checked = harness("preflight", str(podman_cluster.write_inventory(tmp_path / "hosts.yaml")), "--job",
                          str(container_job(tmp_path / "job.yaml")), "--known-hosts", str(podman_cluster.known_hosts),
                          timeout=180)
    finally:
        podman_cluster.podman("h2", "rm", "--force", "retagged")
        podman_cluster.podman("h2", "rmi", "--force", IMAGE)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert re.search(rf"h2\s+image\s+FAIL\s+{re.escape(IMAGE)} is image [0-9a-f]{{12}} on h2 but [0-9a-f]{{12}} on h1",
                     checked.stdout), checked.stdout
    assert "name it by digest" in checked.stdout
    assert re.search(r"h1\s+image\s+PASS", checked.stdout), checked.stdout
    assert podman_cluster.podman("h2", "image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    assert_no_container(podman_cluster)
