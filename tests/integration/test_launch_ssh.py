"""SSH launch on real hosts: sshd in network namespaces, torchrun + gloo across them. Where the test is about the
SSH supervision around a job (a killed worker, grace, a lost connection, stop), not torch, the job runs on the
stand-in torch (ddp_job(standin=True)); test_two_hosts_train_over_gloo keeps torchrun and gloo across hosts real."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from testbed.cluster import Cluster

from conftest import (
    REPO,
    SECRET_NAME,
    STOP_GRACE,
    assert_nothing_left,
    assert_secret_kept,
    attack_store,
    ddp_job,
    harness,
    leftover,
    stragglers_s,
    with_secret,
    worker_pid,
)


def ssh_args(cluster: Cluster, tmp_path: Path, *extra: str) -> list[str]:
    hosts = cluster.write_inventory(tmp_path / "hosts.yaml")
    return ["--hosts", str(hosts), "--known-hosts", str(cluster.known_hosts), *extra]



def test_two_hosts_train_over_gloo(cluster2, write_yaml, launch, tmp_path):
    """Over one SSH connection per host: the preflight gate's, the port pick's and the nodes' in one. With a secret
    from the launching environment (the hosts' logins have none), which reaches the ranks and nothing else."""
    before = {h.name: cluster2.logins(h) for h in cluster2.hosts}
    job, secret = with_secret(ddp_job(write_yaml, STEPS="10"))
    job.write_text(re.sub(r"master_port: \d+", "master_port: auto", job.read_text()))
    run = launch(job, *ssh_args(cluster2, tmp_path), env=os.environ | {SECRET_NAME: secret})
    assert run.finish() == 0, run.output
    assert_secret_kept(secret, run.output, 2, run.runs_dir)
    assert {h.name: cluster2.logins(h) - before[h.name] for h in cluster2.hosts} == {"h1": 1, "h2": 1}
    assert re.search(r"\[node0\] \[rank0\]: rank 0/2 up on h1;", run.output), run.output
    assert re.search(r"\[node1\] \[rank1\]: rank 1/2 up on h2;", run.output), run.output
    weights = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", run.output)
    assert sorted(r for r, _ in weights) == ["0", "1"] and len({w for _, w in weights}) == 1
    plan = (run.runs_dir / run.run_id / "plan.json").read_text()
    assert f'"MASTER_ADDR": "{cluster2.hosts[0].address}"' in plan
    assert run.summary()["status"] == "succeeded"
    assert_nothing_left(run.run_id)


def test_sigkill_of_a_worker_stops_the_other_host_within_5_s(cluster2, write_yaml, launch, tmp_path):
    """On real torch: the record names the killed worker, not its peer that lost it. (The stand-in's process group
    breaks within milliseconds of a death, so the peer's end can reach the harness before the killed rank's node
    reports it: a race of the stand-in's, not gloo's.) Meanwhile another user of the master host cannot reach the
    job's store, which its agent (root there) keeps from them while the node runs, and the launch says so."""
    run = launch(ddp_job(write_yaml, STEPS="100000", STEP_SECONDS="0.05", HANG_AT_STEP="150"),
                 *ssh_args(cluster2, tmp_path))
    run.wait_for(r"\[rank0\]: step 5 ")
    master = cluster2.hosts[0]
    assert attack_store(run.runs_dir / run.run_id, tmp_path / "pwned", lambda argv: cluster2.login(master, argv)) \
        .startswith(f"refused {master.address}:")
    port = json.loads((run.runs_dir / run.run_id / "plan.json").read_text())["master_port"]
    assert (f"harness: the job's rendezvous store on h1:{port} admits no other user of h1 (an iptables rule while its "
            f"node runs); every machine that reaches h1:{port} can reach it") in run.output, run.output
    os.kill(worker_pid(run.run_id, 1), signal.SIGKILL)
    assert run.finish(timeout=30) == 1, run.output
    summary = run.summary()
    failure = summary["first_failure"]
    assert (failure["host"], failure["node_rank"], failure["rank"], failure["rank_exit_code"]) == ("h2", 1, 1, -9)
    assert stragglers_s(summary) < 5.0, summary  # guard: "within seconds": ~1 s quiet (bench 5), not left to run
    assert_nothing_left(run.run_id)
    rules = subprocess.run(cluster2.login(master, ["iptables", "-S", "OUTPUT"]), capture_output=True, text=True)
    assert rules.returncode == 0 and "harness-store" not in rules.stdout, rules.stdout  # gone with the node


def test_a_dead_controllers_remote_nodes_stop_once_their_grace_has_passed(cluster2, write_yaml, launch, tmp_path):
    """Nobody attaches: each host's agent holds its node for supervision.grace, then stops it (on the stand-in torch:
    the agents' grace is what is tested)."""
    grace = 2
    job = ddp_job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05")
    job.write_text(job.read_text() + f"supervision: {{grace: {grace}}}\n")
    run = launch(job, *ssh_args(cluster2, tmp_path))
    run.wait_for(r"\[rank0\]: step 5 ")
    os.killpg(run.proc.pid, signal.SIGKILL)
    run.finish()
    assert_nothing_left(run.run_id, within=grace + STOP_GRACE + 5)


def test_unreachable_host_fails_before_anything_starts(cluster2, write_yaml, launch, tmp_path):
    hosts = tmp_path / "hosts.yaml"
    cluster2.write_inventory(hosts, hosts=["h1"], extra=[{"name": "ghost", "address": cluster2.unused_address}])
    started = time.monotonic()
    run = launch(ddp_job(write_yaml), "--hosts", str(hosts), "--known-hosts", str(cluster2.known_hosts),
                 "--skip-preflight")
    assert run.finish(timeout=60) == 1, run.output
    assert time.monotonic() - started < 30  # guard: fails at the connection (10 s at most), not the rendezvous (900 s)
    assert "ghost" in run.output
    assert_nothing_left(run.run_id)


def test_a_dropped_connection_is_made_again_and_the_run_goes_on(cluster2, write_yaml, launch, tmp_path):
    """Kill the sshd process serving h2's session, stopped for a while first: its agent holds its node, the
    controller logs in again and takes it back through the relay, and the agent sends again what the controller
    missed (what was in flight in sshd): no restart, every line once.
    `harness stop` then still reaches h2 over the new link. On the stand-in torch: the link, not torch, is tested."""
    run = launch(ddp_job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05", EVERY_RANK_SAYS_STEPS="1"),
                 *ssh_args(cluster2, tmp_path))
    run.wait_for(r"\[rank1\]: step 5 ")
    listener = cluster2.host("h2").sshd
    assert listener is not None
    sessions = [pid for pid in cluster2.pids("h2")
                if pid != listener.pid and Path(f"/proc/{pid}/comm").read_text().strip().startswith("sshd")]
    assert sessions, "no sshd session process found on h2"
    for pid in sessions:  # stopped first: what h2's rank says meanwhile is in flight when sshd dies
        os.kill(pid, signal.SIGSTOP)
    run.wait_for(r"\[node0\] \[rank0\]: step 30 ")  # in step with rank 1, which said its steps 10 to 30 meanwhile
    for pid in sessions:
        os.kill(pid, signal.SIGKILL)
    relinked = run.wait_for(r"^harness: node1 on h2: its link was lost and is made again; the \d+ line\(s\) it said "
                            r"meanwhile are in its logs, not shown here$", timeout=60)
    live = int(run.wait_for(r"\[node1\] \[rank1\]: step (\d+) ", after=relinked).group(1))  # its steps live again
    stopped = harness("stop", run.run_id, "--runs-dir", str(run.runs_dir))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert run.finish(timeout=60) == 130, run.output
    summary = run.summary()
    assert summary["status"] == "stopped" and len(summary["attempts"]) == 1, summary
    said = (run.runs_dir / run.run_id / "node1.log").read_text()
    steps = [int(step) for step in re.findall(r"\[rank1\]: step (\d+) ", said)]
    assert steps == list(range(0, 5 * len(steps), 5)), said  # every one, once
    assert steps[-1] >= live, said
    assert_nothing_left(run.run_id)


def test_stop_from_another_terminal_reaches_every_host(cluster2, write_yaml, launch, tmp_path):
    """`harness stop` (SIGTERM to the controller), the one stop path that Ctrl-C shares (unit/test_stop_signals.py);
    on the stand-in torch, as the stop is the harness's."""
    run = launch(ddp_job(write_yaml, standin=True, STEPS="100000", STEP_SECONDS="0.05"), *ssh_args(cluster2, tmp_path))
    run.wait_for(r"\[rank1\]: ")
    run.wait_for(r"\[rank0\]: step 5 ")
    assert {p for p in leftover(run.run_id)} & set(cluster2.pids("h2"))  # really running on h2
    stopped = harness("stop", run.run_id, "--runs-dir", str(run.runs_dir))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert run.finish(timeout=20) == 130
    assert run.summary()["status"] == "stopped"
    assert_nothing_left(run.run_id)


def test_failed_preflight_starts_nothing(cluster2, write_yaml, launch, tmp_path):
    """A firewall dropping the master port on h1: the fast preflight fails and no node, record or run dir exists."""
    job = ddp_job(write_yaml)
    port = re.search(r"master_port: (\d+)", job.read_text()).group(1)
    with cluster2.firewall("h1", "-p", "tcp", "--dport", port, "-j", "DROP"):
        run = launch(job, *ssh_args(cluster2, tmp_path))
        assert run.finish(timeout=120) == 1, run.output
    assert run.output.startswith("harness: error: preflight failed, nothing was started "
                                 "(use --skip-preflight to launch anyway):"), run.output
    assert re.search(rf"h2\s+master_port\s+FAIL\s+h2 -> h1 \S+:{port} timed out", run.output), run.output
    assert not (tmp_path / "runs").exists()
    cluster2.assert_only_sshd_left()


def test_two_ssh_hosts_on_one_machine_pass_preflight_and_launch(cluster2, write_yaml, tmp_path):
    """sshd on 127.0.0.1 and 127.0.0.2, as people try before a cluster (here inside h1, which is one machine):
    preflight passes data_plane (loopback's MTU, 65536, is more than a datagram holds) and resolve (loopback
    is right when every host is this machine), and launch starts without --skip-preflight (the job on the stand-in
    torch: preflight and the start are tested here, not gloo)."""
    h1 = cluster2.host("h1")
    config = tmp_path / "loopback_sshd_config"
    config.write_text((cluster2.dir / "h1_sshd_config").read_text().replace(
        f"ListenAddress {h1.address}", "ListenAddress 127.0.0.1\nListenAddress 127.0.0.2"))
    sshd = subprocess.Popen(cluster2.login(h1, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        inventory = cluster2.inventory_data(overrides={})
        inventory["hosts"] = [{"name": "a", "address": "127.0.0.1"}, {"name": "b", "address": "127.0.0.2"}]
        hosts = tmp_path / "hosts.yaml"
        hosts.write_text(yaml.safe_dump(inventory, sort_keys=False))
        known = tmp_path / "known_hosts"
        known.write_text(f"127.0.0.1 {h1.host_key}\n127.0.0.2 {h1.host_key}\n")
        job = ddp_job(write_yaml, standin=True, STEPS="10")
        in_h1 = cluster2.login(h1, [sys.executable, "-m", "harness.cli"])
        for _ in range(100):  # sshd listening
            if subprocess.run(cluster2.login(h1, ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.2/22"]),
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        checked = subprocess.run([*in_h1, "preflight", str(hosts), "--job", str(job), "--known-hosts", str(known)],
                                 capture_output=True, text=True, timeout=180, cwd=REPO)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert re.search(r"^b +data_plane +PASS +.* on lo .*, 65535-byte frames too$", checked.stdout, re.M), \
            checked.stdout
        assert re.search(r"^b +resolve +PASS +master 127\.0\.0\.1 -> 127\.0\.0\.1", checked.stdout, re.M), checked.stdout
        launched = subprocess.run([*in_h1, "launch", str(job), "--hosts", str(hosts), "--known-hosts", str(known),
                                   "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, timeout=180,
                                  cwd=REPO)
        assert launched.returncode == 0, launched.stdout + launched.stderr
        assert re.search(r"\[node1\] \[rank1\]: rank 1/2 up on h1;", launched.stdout), launched.stdout
    finally:
        sshd.kill()
        sshd.wait()
