"""The health watch on real SSH hosts (sshd in network namespaces): a job that stops making progress is called
hung within health.stall seconds and a few more, every rank's stack is read on its own host with py-spy and kept,
the verdict names who the hang is about, and the job is stopped with nothing left on any host (the rules of the
verdict: harness/health/judge.py). The partition runs torch and gloo across the hosts (a real all_reduce cut, each
rank's wait read through torch's frames to the user's line); the asleep and the stopped rank run on the stand-in torch
(testbed/standin/rank.py), as what they test is the watch, py-spy on the rank's host and the verdict's words about
that rank, not torch."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from testbed.cluster import Cluster

from conftest import REPO, STANDIN_ENV, assert_nothing_left, free_port, worker_pid

STALL = 10  # health.stall of these jobs
# Seconds from the fault to the verdict, on a busy 2-core machine: a guard, not a speed (bench 9, simulated nodes:
# ~1.5 s past the stall at most, quiet), that tells the watch's verdict from gloo's 30 min timeout.
DETECT_WITHIN = STALL + 15
SCRIPT = REPO / "tests" / "scripts" / "health_steps.py"
SHOWN = "tests/scripts/health_steps.py"  # the script as the verdict names it: relative to the ranks' workdir
VERDICT = r"^harness: hang: (no progress for .*?)(?: \(stacks in (\S+)/\))?$"
STANDIN_RANK = REPO / "testbed" / "standin" / "rank.py"  # the stand-in's rank: steps, each an all_reduce; a hang
STANDIN_COLLECTIVES = REPO / "testbed" / "standin" / "collectives.py"  # where a stand-in rank waits in a collective


def _line_of(text: str, script: Path = SCRIPT) -> int:
    """The line of a script that holds text (the verdict names frames by line)."""
    return next(n for n, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def _job(write_yaml, **env: str) -> Path:
    lines = "".join(f"  {key}: '{value}'\n" for key, value in env.items()) or "  {}\n"
    return write_yaml(f"name: health\nnnodes: 2\nnproc_per_node: 1\nbackend: gloo\nmaster_port: {free_port()}\n"
                      f"entrypoint: {{script: {SCRIPT}}}\nenv:\n{lines}health: {{stall: {STALL}}}\n")


def _standin_job(write_yaml, *args: str) -> Path:
    """STANDIN_RANK with args on the stand-in torch, every rank saying each step (`epoch 1/1 step N/...`), 20 a
    second."""
    argv = json.dumps(["--steps", "100000", "--step-seconds", "0.05", *args])
    return write_yaml(f"name: health\nnnodes: 2\nnproc_per_node: 1\nbackend: gloo\nmaster_port: {free_port()}\n"
                      f"entrypoint: {{script: {STANDIN_RANK}, args: {argv}}}\n"
                      f"env: {{PYTHONPATH: '{STANDIN_ENV['PYTHONPATH']}'}}\nhealth: {{stall: {STALL}}}\n")



def _ssh_args(cluster: Cluster, tmp_path: Path) -> list[str]:
    hosts = cluster.write_inventory(tmp_path / "hosts.yaml")
    return ["--hosts", str(hosts), "--known-hosts", str(cluster.known_hosts)]


@contextlib.contextmanager
def _partition(cluster: Cluster, a: str, b: str) -> Iterator[None]:
    """Drop every packet between hosts a and b (in b's namespace, both ways); each host's link to the
    controller (the bridge's .1, where the SSH connections come from) stays up. Removed on any exit."""
    peer = cluster.host(a).address
    with cluster.firewall(b, "-s", peer, "-j", "DROP"), cluster.firewall(b, "-d", peer, "-j", "DROP", chain="OUTPUT"):
        yield
    rules = cluster.exec(b, ["iptables", "-S"]).stdout
    assert peer not in rules, rules


def _detected(run, fault_at: float) -> tuple[re.Match[str], float]:
    """The verdict line and how long after the fault (time.monotonic()) it came."""
    verdict = run.wait_for(VERDICT, timeout=DETECT_WITHIN + 30)
    return verdict, time.monotonic() - fault_at


def _first_failure_after(summary: dict, fault_wall: float) -> float:
    """When the controller called the hang (summary.json), in seconds after the fault (time.time())."""
    attempt = summary["attempts"][0]
    return attempt["started_at"] + summary["first_failure"]["after_s"] - fault_wall


def test_a_data_plane_partition_is_a_hang_blamed_on_the_network(cluster2, write_yaml, launch, tmp_path):
    """h1 and h2 cannot reach each other, the controller still reaches both: every rank waits in the same
    all_reduce, none is behind, so the verdict suspects the network; the SSH links stop the job."""
    run = launch(_job(write_yaml), *_ssh_args(cluster2, tmp_path))
    run.wait_for(r"\[node1\] \[rank1\]: rank 1/2 up on h2", timeout=120)
    run.wait_for(r"\[node0\] \[rank0\]: step 20 ", timeout=120)
    with _partition(cluster2, "h1", "h2"):
        cut, cut_wall = time.monotonic(), time.time()
        verdict, after = _detected(run, cut)
        assert after < DETECT_WITHIN, f"hang seen {after:.1f} s after the partition"  # guard: see DETECT_WITHIN
        assert run.finish(timeout=60) == 1, run.output
        assert_nothing_left(run.run_id, within=15)  # stopped over SSH while the partition still holds
        cluster2.assert_only_sshd_left(within=15)
    all_reduce = _line_of("dist.all_reduce(batch)")
    # The cut caught both ranks waiting in the same all_reduce, or one of them still inside the one before,
    # which the other completed (the rest of its data was lost): the network either way, no rank to blame.
    seq = int(re.search(r"all_reduce #(\d+)", verdict.group(1)).group(1))
    both = (f"no progress for {STALL} s: ranks 0,1 wait in all_reduce #{seq} at {SHOWN}:{all_reduce} in train_step; "
            f"no rank is behind: the collective itself does not complete (suspect the network between the nodes, a "
            f"peer's host, or a GPU kernel before it that never ends)")
    one_inside = [f"no progress for {STALL} s: rank {ahead} waits in all_reduce #{seq} at {SHOWN}:{all_reduce} in "
                  f"train_step; rank {1 - ahead} (node{1 - ahead} on h{2 - ahead}) waits in all_reduce #{seq - 1}, which "
                  f"rank {ahead} completed: the rest of its data did not arrive (suspect the network between the nodes, "
                  f"or a peer's host)" for ahead in (0, 1)]
    assert verdict.group(1) in [both, *one_inside], run.output
    # Whichever rank's samples first span the stall is named here (the hosts sample on their own clocks).
    assert re.search(rf"^harness: no progress for {STALL} s on (rank [01]|ranks 0,1): reading every rank's stack$",
                     run.output, re.M), run.output

    summary = run.summary()
    failure = summary["first_failure"]
    assert summary["status"] == "failed" and [a["kind"] for a in summary["attempts"]] == ["hang"], summary
    assert failure["kind"] == "hang" and failure["evidence"] == verdict.group(1), failure
    assert _first_failure_after(summary, cut_wall) < DETECT_WITHIN  # guard: see DETECT_WITHIN
    stacks = run.runs_dir / run.run_id / "stacks" / "attempt-0"
    assert verdict.group(2) == str(stacks.parent) + "/attempt-0"
    for rank, host in ((0, "h1"), (1, "h2")):
        text = (stacks / f"rank{rank}.txt").read_text()
        assert text.startswith(f"rank {rank} (node{rank} on {host}), pid "), text
        assert "all_reduce (torch/distributed/distributed_c10d.py:" in text, text
        assert f"train_step ({SHOWN}:{all_reduce})" in text, text
    assert sorted(p.name for p in stacks.iterdir()) == ["rank0.txt", "rank1.txt", "stacks.json"]


def test_a_rank_asleep_in_its_step_is_named_with_its_line(cluster2, write_yaml, launch, tmp_path):
    """Rank 1 (on h2) sleeps in its data loading at step 25 while rank 0 waits for it in that step's all_reduce: the
    verdict says which collective rank 0 waits in, and that rank 1 has not reached it, at its own line of the
    script."""
    run = launch(_standin_job(write_yaml, "--hang-rank", "1", "--hang-step", "25"), *_ssh_args(cluster2, tmp_path))
    run.wait_for(r"\[node1\] \[rank1\]: epoch 1/1 step 24/", timeout=180)  # its last step: then it sleeps
    asleep, asleep_wall = time.monotonic(), time.time()
    verdict, after = _detected(run, asleep)
    assert after < DETECT_WITHIN, f"hang seen {after:.1f} s after rank 1 fell asleep"  # guard: see DETECT_WITHIN
    assert run.finish(timeout=60) == 1, run.output
    sleep, waits = _line_of("time.sleep(3600)", STANDIN_RANK), _line_of(".readline()", STANDIN_COLLECTIVES)
    shown, collectives = STANDIN_RANK.relative_to(REPO), STANDIN_COLLECTIVES.relative_to(REPO)  # from the workdir
    assert verdict.group(1) == (
        f"no progress for {STALL} s: rank 0 waits in all_reduce #25 at {collectives}:{waits} in _collective; "
        f"rank 1 (node1 on h2) has not reached #25, at {shown}:{sleep} in fetch_batch: time.sleep(3600)"), run.output

    summary = run.summary()
    failure = summary["first_failure"]
    assert (failure["kind"], failure["host"], failure["node_rank"], failure["rank"]) == ("hang", "h2", 1, 1), failure
    assert failure["evidence"] == verdict.group(1)
    assert _first_failure_after(summary, asleep_wall) < DETECT_WITHIN  # guard: see DETECT_WITHIN
    assert re.search(rf"harness: run {run.run_id} FAILED: first failure on node 1 \(h2, global rank 1\): hung after "
                     rf"\S+ s \(hang: the verdict above\)", run.output), run.output
    assert run.output.count(verdict.group(1)) == 1, "the verdict is said once"
    stacks = run.runs_dir / run.run_id / "stacks" / "attempt-0"
    asleep_stack = (stacks / "rank1.txt").read_text()
    assert f"fetch_batch ({shown}:{sleep})\n        time.sleep(3600)" in asleep_stack, asleep_stack
    assert "all_reduce" in (stacks / "rank0.txt").read_text()
    assert_nothing_left(run.run_id, within=15)
    cluster2.assert_only_sshd_left(within=15)


def test_a_stopped_rank_s_stack_is_read(cluster2, write_yaml, launch, tmp_path):
    """Rank 1 on h2 stopped (SIGSTOP): the verdict names it as stopped and says where, from its stack."""
    run = launch(_standin_job(write_yaml), *_ssh_args(cluster2, tmp_path))
    run.wait_for(r"\[node0\] \[rank0\]: epoch 1/1 step 20/", timeout=120)
    pid = worker_pid(run.run_id, 1)
    os.kill(pid, signal.SIGSTOP)
    verdict, after = _detected(run, time.monotonic())
    assert run.finish(timeout=60) == 1, run.output
    assert after < DETECT_WITHIN  # guard: see DETECT_WITHIN
    assert verdict.group(1).startswith(f"no progress for {STALL} s: rank 1 (node1 on h2) is stopped (SIGSTOP) "), \
        verdict.group(1)
    stopped = (run.runs_dir / run.run_id / "stacks" / "attempt-0" / "rank1.txt").read_text()
    assert stopped.startswith(f"rank 1 (node1 on h2), pid {pid}, stopped (SIGSTOP)\n"), stopped
    assert_nothing_left(run.run_id, within=15)
    cluster2.assert_only_sshd_left(within=15)
    assert "(no stack" not in verdict.group(1) and f"({STANDIN_RANK.relative_to(REPO)}:" in stopped, stopped
