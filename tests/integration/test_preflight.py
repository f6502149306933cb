"""harness preflight on the namespace cluster: healthy clusters pass, each broken thing fails by name."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.preflight.collective import collective_checks
from harness.preflight.remote import TORCH_TIMEOUT_FACTOR
from harness.preflight.runner import run_preflight
from harness.preflight.table import Check, Report, Status
from harness.preflight.verb import preflight_command
from harness.spec.inventory import load_inventory
from harness.spec.job import load_job
from harness.targets.ssh.transport import connect
from testbed.cluster import Cluster

OLD_TORCH = "2.13.0"


def _job(tmp_path: Path, nnodes: int) -> Path:
    lines = [f"name: pf{nnodes}", f"nnodes: {nnodes}", "backend: gloo", "master_port: 29500",
             "entrypoint:", "  module: harness.node.allreduce"]
    path = tmp_path / "job.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _preflight(cluster: Cluster, tmp_path: Path, *, job: bool = True, inventory: dict | None = None,
               **kwargs: object) -> Report:
    hosts = cluster.write_inventory(tmp_path / "hosts.yaml", **(inventory or {}))
    spec = load_job(_job(tmp_path, cluster.size)) if job else None
    kwargs.setdefault("known_hosts", cluster.known_hosts)
    return run_preflight(load_inventory(hosts), spec, **kwargs)


def _row(report: Report, host: str, check: str) -> Check:
    return next(c for c in report.checks if c.host == host and c.name == check)


def test_healthy_two_hosts_full_with_collective_and_json(cluster2: Cluster, tmp_path: Path) -> None:
    report = _preflight(cluster2, tmp_path, collective=True)
    assert report.ok, report.render_table()
    names = ["ssh", "fingerprint", "gpus", "shm", "disk", "stacks", "resolve", "interface", "master_port", "store",
             "data_plane", "defaults", "collective"]
    assert [c.name for c in report.checks if c.host == "h1"] == names
    assert {c.status for c in report.checks} <= {Status.PASS, Status.SKIP}, report.render_table()
    assert _row(report, "h2", "gpus").reason == "the job runs on CPU (backend gloo, resources.gpus 0); 0 GPUs found"
    assert re.fullmatch(r"all_reduce of 8 MiB over 2 ranks \(gloo\) verified: busbw [\d.]+ GB/s, algbw [\d.]+ GB/s, "
                        r"[\d.]+ ms", _row(report, "h1", "collective").reason)
    master = cluster2.host("h1").address
    assert _row(report, "h2", "master_port").reason.startswith(f"h2 -> h1 {master}:29500 connected")
    # The job's store, kept as the launch's agent keeps it (root on h1), is refused to another user of h1 and not to
    # this machine, which is not a job host: said plainly. No rule is left behind.
    assert _row(report, "h1", "store").reason == (f"port 29500: another user of h1 (nobody) was refused, as the job's "
                                                  f"agent keeps its store from them; any machine that reaches "
                                                  f"{master}:29500 reaches it (this one did)")
    rules = subprocess.run(cluster2.login("h1", ["iptables", "-S", "OUTPUT"]), capture_output=True, text=True)
    assert rules.returncode == 0 and "harness-store" not in rules.stdout, rules.stdout
    data = json.loads(json.dumps(report.to_json()))
    assert set(data) == {"ok", "seconds", "job", "hosts", "checks", "fingerprint", "interfaces", "facts", "notes",
                         "failures"}
    assert data["interfaces"] == {"h1": "eth0", "h2": "eth0"}
    assert data["ok"] is True and data["failures"] == []
    assert data["job"] == {"name": "pf2", "backend": "gloo", "nnodes": 2, "master_port": 29500}
    assert data["hosts"] == [{"name": h.name, "address": h.address, "master": h.name == "h1"} for h in cluster2.hosts]
    assert set(data["checks"][0]) == {"host", "check", "status", "reason", "fix", "details"}
    assert {c["status"] for c in data["checks"]} == {"pass", "skip"}
    assert data["fingerprint"]["mismatched"] == []
    assert data["fingerprint"]["hosts"]["h1"] == data["fingerprint"]["hosts"]["h2"]
    assert data["facts"]["h2"]["hostname"] == "h2" and data["facts"]["h2"]["torch"] == torch.__version__
    assert data["facts"]["h1"]["payload"]["path"].endswith("harness/node/allreduce.py")
    assert data["notes"] == []
    table = report.render_table()
    assert table.splitlines()[1].split() == ["HOST", "CHECK", "STATUS", "DETAIL"]
    assert table.splitlines()[-1].startswith("PASSED: 25 checks")
    # the agent's py-spy (the venv's, beside the inventory's python) read a process on each namespace host
    py_spy = str(Path(sys.executable).parent / "py-spy")
    for host in ("h1", "h2"):
        assert _row(report, host, "stacks").reason == f"py-spy 0.4.3 ({py_spy}) read the stack of a test process"
        assert data["facts"][host]["stacks"]["python"] == sys.executable
    cluster2.assert_only_sshd_left()


def test_healthy_three_hosts_fast(cluster3: Cluster, tmp_path: Path) -> None:
    report = _preflight(cluster3, tmp_path, fast=True)
    assert report.ok, report.render_table()
    assert "collective" not in {c.name for c in report.checks}
    assert "torch_gpus" not in report.facts["h1"]  # the fast probe does not import torch
    assert re.fullmatch(rf"ephemeral port \d+ on eth0 {cluster3.host('h2').address} reached from h1, h3, "
                        rf"1500-byte frames too",
                        _row(report, "h2", "data_plane").reason)
    assert _row(report, "h2", "interface").reason == (
        f"eth0 {cluster3.host('h2').address}, mtu 1500, same on all hosts (the kernel routes to h1, h3 through it); "
        f"GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME pinned to it")
    assert _row(report, "h3", "defaults").reason == "unpinned, gloo and NCCL would also reach the peers (eth0)"


def test_dropped_master_port_names_source_destination_and_port(cluster3: Cluster, tmp_path: Path) -> None:
    master = cluster3.host("h1").address
    with cluster3.firewall("h1", "-p", "tcp", "--dport", "29500", "-j", "DROP"):
        report = _preflight(cluster3, tmp_path, fast=True)
    assert not report.ok
    assert _row(report, "h1", "master_port").status is Status.PASS
    for worker in ("h2", "h3"):
        row = _row(report, worker, "master_port")
        assert row.status is Status.FAIL
        assert row.reason == f"{worker} -> h1 {master}:29500 timed out after 3s (a firewall drops the packets)"
        assert row.fix.startswith(f"allow tcp 29500 into h1 from {worker}")
    assert {c.host for c in report.failures} == {"h2", "h3"}
    assert f"  h2 master_port: h2 -> h1 {master}:29500 timed out" in report.render_table()


def test_rejected_master_port_is_told_from_a_drop(cluster2: Cluster, tmp_path: Path) -> None:
    rule = ("-p", "tcp", "--dport", "29500", "-j", "REJECT", "--reject-with", "tcp-reset")
    with cluster2.firewall("h1", *rule):
        report = _preflight(cluster2, tmp_path, fast=True)
    row = _row(report, "h2", "master_port")
    assert row.status is Status.FAIL
    assert row.reason == (f"h2 -> h1 {cluster2.host('h1').address}:29500 refused "
                          "(a firewall rejects it, or nothing listens)")


def test_master_port_in_use(cluster2: Cluster, tmp_path: Path) -> None:
    holder = cluster2.spawn("h1", [sys.executable, "-c", (
        "import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
        "s.bind(('0.0.0.0', 29500)); s.listen(); time.sleep(60)")])
    try:
        deadline = time.monotonic() + 10
        while "29500" not in cluster2.exec("h1", ["ss", "-ltn"]).stdout and time.monotonic() < deadline:
            time.sleep(0.1)
        report = _preflight(cluster2, tmp_path, fast=True)
    finally:
        holder.kill()
        holder.wait()
    row = _row(report, "h1", "master_port")
    assert (row.status, row.reason) == (Status.FAIL, "port 29500 is already in use on h1")
    assert _row(report, "h2", "master_port").status is Status.SKIP


def test_blocked_data_plane_names_every_failing_pair(cluster3: Cluster, tmp_path: Path) -> None:
    rule = ("-p", "tcp", "-m", "multiport", "!", "--dports", "22,29500", "-m", "conntrack", "--ctstate", "NEW",
            "-j", "DROP")
    with cluster3.firewall("h2", *rule):
        report = _preflight(cluster3, tmp_path, fast=True)
    row = _row(report, "h2", "data_plane")
    assert row.status is Status.FAIL
    address = cluster3.host("h2").address
    assert re.fullmatch(rf"h1 -> h2 eth0 {address}:(\d+) timed out after 3s \(a firewall drops the packets\); "
                        rf"h3 -> h2 eth0 {address}:\1 timed out after 3s \(a firewall drops the packets\)", row.reason)
    assert "ephemeral ports 32768-60999" in row.fix
    assert [c.host + " " + c.name for c in report.failures] == ["h2 data_plane"]
    assert _row(report, "h2", "master_port").status is Status.PASS


@pytest.fixture(scope="module")
def old_torch_python() -> Iterator[str]:
    """A second venv with only torch 2.13.0 (the machine's local CPU wheel): a real other version."""
    venv = Path(tempfile.mkdtemp(prefix="harness-oldtorch-"))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        # --no-compile: half the install's time goes to byte-compiling torch, which the probe's import does for the
        # few modules it needs
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile", f"torch=={OLD_TORCH}"],
                             capture_output=True, text=True, timeout=600)
        if pip.returncode:
            pytest.fail(f"could not install torch=={OLD_TORCH} in a second venv: {pip.stderr[-2000:]}")
        yield str(venv / "bin" / "python")
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def test_different_torch_fails_naming_hosts_and_versions(cluster2: Cluster, tmp_path: Path,
                                                         old_torch_python: str) -> None:
    report = _preflight(cluster2, tmp_path, inventory={"overrides": {"h2": {"python": old_torch_python}}})
    row = _row(report, "h2", "fingerprint")
    assert row.status is Status.FAIL
    assert row.reason.startswith("differs from h1: torch ")
    assert f"torch {OLD_TORCH}+cpu vs {torch.__version__}" in row.reason
    assert f"cuda none vs {torch.version.cuda}" in row.reason
    assert "torchvision missing vs " in row.reason
    assert _row(report, "h1", "fingerprint").status is Status.PASS
    assert report.mismatched == ["torch", "torch_git", "cuda", "nccl", "torchvision"]
    table = report.render_table()
    assert "software differs across hosts:" in table
    assert re.search(rf"\n  torch +{re.escape(torch.__version__)} +{re.escape(OLD_TORCH)}\+cpu\n", table)
    assert re.search(r"\n  torchvision +\S+ +missing\n", table)
    assert report.facts["h2"]["python_executable"] == old_torch_python
    # that venv has no py-spy, nor has the SSH session's PATH: the job would run, without stacks on a hang
    stacks = _row(report, "h2", "stacks")
    assert (stacks.status, stacks.reason) == (
        Status.WARN, f"py-spy is neither beside {old_torch_python} nor on PATH: hang verdicts and `harness stacks` "
                     f"will have no Python stacks from this host (the job itself runs)")
    assert stacks.fix == (f"`{old_torch_python} -m pip install py-spy==0.4.3` on h2 (the node agent looks for py-spy "
                          f"beside that Python, then on PATH)")
    assert _row(report, "h1", "stacks").status is Status.PASS
    assert re.search(rf"\nh2 +stacks +WARN +py-spy is neither beside {re.escape(old_torch_python)} nor on PATH", table)


def test_unreachable_host_fails_alone(cluster2: Cluster, tmp_path: Path) -> None:
    ghost = {"name": "ghost", "address": cluster2.unused_address}
    report = _preflight(cluster2, tmp_path, job=False, fast=True, inventory={"extra": [ghost]})
    row = _row(report, "ghost", "ssh")
    assert (row.status, row.details["kind"]) == (Status.FAIL, "no_route")
    assert row.reason == f"no route to {cluster2.unused_address} (No route to host)"
    assert [c.host for c in report.failures] == ["ghost"]
    assert _row(report, "h2", "data_plane").status is Status.PASS


def test_missing_python_is_reported(cluster2: Cluster, tmp_path: Path) -> None:
    report = _preflight(cluster2, tmp_path, fast=True, inventory={"overrides": {"h2": {"python": "/opt/nope/python"}}})
    row = _row(report, "h2", "fingerprint")
    assert row.status is Status.FAIL
    assert row.reason == ("probe failed: /opt/nope/python on h2 exited 127: sh: 1: exec: /opt/nope/python: not found "
                          "(is `python:` in the inventory right?)")
    assert [c.name for c in report.checks if c.host == "h2"] == ["ssh", "fingerprint"]
    assert _row(report, "h1", "data_plane").status is Status.SKIP


def _command_json(capsys: pytest.CaptureFixture[str], hosts: Path, **kwargs: object) -> tuple[int, dict]:
    status = preflight_command(hosts, None, json_out=True, collective=False, accept_new_host_keys=False, **kwargs)
    return status, json.loads(capsys.readouterr().out)


def test_command_reports_wrong_key_and_changed_host_key(cluster2: Cluster, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    stranger = cluster2.new_client_key("preflight_stranger")
    hosts = cluster2.write_inventory(tmp_path / "hosts.yaml", overrides={"h2": {"identity_file": str(stranger)}})
    status, data = _command_json(capsys, hosts, known_hosts=cluster2.known_hosts)
    assert status == 1
    ssh = {c["host"]: c for c in data["checks"] if c["check"] == "ssh"}
    assert ssh["h1"]["status"] == "pass"
    assert (ssh["h2"]["status"], ssh["h2"]["details"]["kind"]) == ("fail", "auth")
    assert ssh["h2"]["reason"].startswith(f"root@{cluster2.host('h2').address}:22 rejected key {stranger}")
    assert data["failures"] == [f"h2 ssh: {ssh['h2']['reason']} -> fix: {ssh['h2']['fix']}"]

    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{cluster2.host('h1').address} {cluster2.host('h2').host_key}\n"
                     f"{cluster2.host('h2').address} {cluster2.host('h2').host_key}\n")
    status, data = _command_json(capsys, cluster2.write_inventory(tmp_path / "hosts.yaml"), known_hosts=wrong)
    ssh = {c["host"]: c for c in data["checks"] if c["check"] == "ssh"}
    assert status == 1
    assert (ssh["h1"]["status"], ssh["h1"]["details"]["kind"]) == ("fail", "hostkey_mismatch")
    assert ssh["h1"]["reason"].startswith(f"host key for {cluster2.host('h1').address} does not match {wrong}")
    assert ssh["h2"]["status"] == "pass"


def test_command_accepts_new_host_keys_only_when_asked(cluster2: Cluster, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    known = tmp_path / "known_hosts"
    hosts = cluster2.write_inventory(tmp_path / "hosts.yaml")
    assert preflight_command(hosts, None, json_out=False, collective=False, accept_new_host_keys=False,
                             known_hosts=known) == 1
    assert "pass --accept-new-host-keys" in capsys.readouterr().out
    assert preflight_command(hosts, None, json_out=False, collective=False, accept_new_host_keys=True,
                             known_hosts=known) == 0
    out = capsys.readouterr().out
    assert re.search(r"h2 +ssh +PASS +root@\S+:22 in [\d.]+s, new host key SHA256:\S+ added to known_hosts", out)
    assert sorted(known.read_text().splitlines()) == sorted(f"{h.address} {h.host_key}" for h in cluster2.hosts)


def test_hostname_resolving_to_loopback_is_a_warning_because_the_launch_pins_the_interface(
        cluster2: Cluster, tmp_path: Path) -> None:
    with cluster2.hosts_entries("h2", ["127.0.1.1 h2"]):
        report = _preflight(cluster2, tmp_path, fast=True)
    assert report.ok, report.render_table()
    row = _row(report, "h2", "defaults")
    assert row.status is Status.WARN
    assert row.reason == ("torchrun's defaults fail here: gloo advertises 127.0.1.1 (what its hostname h2 resolves "
                          "to): loopback, so each peer connects to itself")
    assert row.fix == ("none needed: the harness pins eth0; torchrun by hand needs GLOO_SOCKET_IFNAME=eth0 "
                       "NCCL_SOCKET_IFNAME==eth0")
    assert _row(report, "h1", "defaults").status is Status.PASS
    assert report.interfaces == {"h1": "eth0", "h2": "eth0"}


def test_master_name_resolving_to_loopback_on_the_master(cluster3: Cluster, tmp_path: Path) -> None:
    """Hostnames as addresses, the controller on h3: h1's Debian-style /etc/hosts line breaks the job."""
    names = {"h1": {"address": "h1"}, "h2": {"address": "h2"}}
    hosts = cluster3.write_inventory(tmp_path / "hosts.yaml", hosts=["h1", "h2"], overrides=names)
    known = tmp_path / "known_hosts"
    known.write_text(f"h1 {cluster3.host('h1').host_key}\nh2 {cluster3.host('h2').host_key}\n")
    script = (
        "import json, sys\nfrom harness.spec.inventory import load_inventory\nfrom harness.spec.job import load_job\n"
        "from harness.preflight.runner import run_preflight\n"
        "report = run_preflight(load_inventory(sys.argv[1]), load_job(sys.argv[2]), known_hosts=sys.argv[3],\n"
        "                       fast=True)\n"
        "print(json.dumps(report.to_json()))\n"
    )
    with cluster3.hosts_entries("h1", ["127.0.1.1 h1"]):
        out = cluster3.exec("h3", [sys.executable, "-c", script, str(hosts), str(_job(tmp_path, 2)), str(known)])
    rows = {c["host"]: c for c in json.loads(out.stdout)["checks"] if c["check"] == "resolve"}
    assert rows["h1"]["status"] == "fail"
    assert rows["h1"]["reason"] == "resolves the master address h1 to 127.0.1.1 (loopback)"
    assert rows["h2"]["status"] == "fail"
    assert rows["h2"]["reason"] == f"resolves h1 to {cluster3.host('h1').address} but h1 resolves it to 127.0.1.1"


def test_collective_timeout_stops_every_process(cluster2: Cluster, tmp_path: Path) -> None:
    """Every new connection but SSH dropped: the rendezvous never completes, the deadline stops both."""
    inventory = load_inventory(cluster2.write_inventory(tmp_path / "hosts.yaml"))
    spec = load_job(_job(tmp_path, 2))
    connections = {h.name: connect(h, known_hosts=cluster2.known_hosts, timeout=5) for h in inventory.hosts}
    rule = ("-p", "tcp", "!", "--dport", "22", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
    try:
        with cluster2.firewall("h2", *rule), cluster2.firewall("h1", *rule):
            started = time.monotonic()
            checks = collective_checks(connections, inventory, spec, timeout=2, interfaces={})
            elapsed = time.monotonic() - started
    finally:
        for connection in connections.values():
            connection.close()
    hard = 2 * TORCH_TIMEOUT_FACTOR
    assert elapsed < hard + spec.timeouts.stop_grace + 10  # guard: the check's deadline, not a rendezvous never done
    assert [(c.host, c.status, c.reason) for c in checks] == [
        (host, Status.FAIL, f"all_reduce did not finish within {hard}s; stopped") for host in ("h1", "h2")]
    cluster2.assert_only_sshd_left()


def test_data_paths_must_exist_and_match_on_every_host(cluster2: Cluster, tmp_path: Path) -> None:
    """Each host gets its own workdir; the job's data path is present on both, then differs, then missing."""
    workdirs = {name: tmp_path / name for name in ("h1", "h2")}
    for workdir in workdirs.values():
        (workdir / "data" / "set").mkdir(parents=True)
        (workdir / "data" / "set" / "batch_1").write_bytes(b"\x01" * 4096)
    job = tmp_path / "job.yaml"
    job.write_text(_job(tmp_path, 2).read_text() + "data_paths: [data/set]\n")
    hosts = cluster2.write_inventory(tmp_path / "hosts.yaml",
                                     overrides={n: {"workdir": str(w)} for n, w in workdirs.items()})

    def run(fast: bool) -> Report:
        return run_preflight(load_inventory(hosts), load_job(job), known_hosts=cluster2.known_hosts, fast=fast)

    same = run(fast=False)
    assert _row(same, "h2", "data").status == Status.PASS, same.render_table()
    assert _row(same, "h2", "data").reason == "data/set: 1 files, 0 MiB, same on all hosts (compared contents)"
    (workdirs["h2"] / "data" / "set" / "batch_1").write_bytes(b"\x02" * 4096)
    assert _row(run(fast=True), "h2", "data").status == Status.PASS  # fast: names and sizes only
    differs = run(fast=False)
    assert not differs.ok and _row(differs, "h2", "data").status == Status.FAIL, differs.render_table()
    assert _row(differs, "h2", "data").reason.startswith("data/set differs from h1")
    shutil.rmtree(workdirs["h1"] / "data")
    missing = run(fast=True)
    row = _row(missing, "h1", "data")
    assert (row.status, row.reason) == (Status.FAIL, f"data/set is missing in {workdirs['h1']}")
    assert "harness prepare --data-dir data/set" in row.fix
