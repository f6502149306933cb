"""Hosts kept out of every run after they failed (record/hosts_out.py): for their cool-down only, never more of an
inventory at once than its limit, brought back by name or address; `harness hosts` lists them. Kept out for real
by a run on SSH hosts: tests/integration/test_recovery.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.record.hosts_out import ALL, HostOut, RunsHosts, bring_back, hosts_out, take_out
from harness.spec.job import Restarts

from conftest import harness

MACHINES = {f"h{i}": f"10.0.0.{i}:22" for i in range(1, 9)}


def test_a_failed_host_is_kept_out_for_its_cool_down_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    made, left = take_out(path, {"h2": "connection to h2 lost"}, MACHINES, "run-1", 60, 2)
    assert left == [] and [(e.name, e.machine, e.reason, e.run_id) for e in made] == [
        ("h2", "10.0.0.2:22", "connection to h2 lost", "run-1")]
    # guard: its cool-down starts now (take_out's clock, not another); the call takes milliseconds
    assert made[0].until - made[0].since == 60 and abs(made[0].since - time.time()) < 5
    assert hosts_out(path) == made
    assert hosts_out(path, now=made[0].until + 1) == [], "its cool-down over, it is offered again"
    again, _ = take_out(path, {"h2": "lost again"}, MACHINES, "run-2", 60, 2)
    assert again == [] and hosts_out(path) == made, "a host already out keeps its first reason and end"
    assert take_out(path, {"h3": "lost"}, MACHINES, "run-1", 0, 2) == ([], []), "cooldown 0"


def test_no_more_hosts_than_the_limit_are_out_at_once(tmp_path: Path) -> None:
    """Three hosts failing together on an inventory of eight, limit 2: the third is left in (one bad switch
    must not drain the cluster); hosts out of another inventory do not count."""
    path = tmp_path / "hosts.json"
    take_out(path, {"x1": "lost"}, {"x1": "10.9.9.1:22"}, "run-0", 60, 1)
    failed = dict.fromkeys(("h1", "h2", "h3"), "lost")
    made, left = take_out(path, failed, MACHINES, "run-1", 60, Restarts().out_limit(len(MACHINES)))
    assert [e.name for e in made] == ["h1", "h2"] and left == ["h3"]
    assert [e.name for e in hosts_out(path)] == ["x1", "h1", "h2"]
    assert Restarts().out_limit(3) == 1 and Restarts(max_out=0).out_limit(100) == 0


def test_a_host_is_brought_back_by_name_address_or_all_and_an_unknown_one_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    take_out(path, dict.fromkeys(("h1", "h2", "h3"), "lost"), MACHINES, "run-1", 60, 8)
    assert [e.name for e in bring_back(path, "h1")] == ["h1"]
    assert [e.name for e in bring_back(path, "10.0.0.2")] == ["h2"]
    with pytest.raises(UsageError, match=r"no host 'h9' is kept out \(kept out: h3; `harness hosts` lists them\)"):
        bring_back(path, "h9")
    assert [e.name for e in bring_back(path, ALL)] == ["h3"] and hosts_out(path) == []


def test_a_damaged_file_is_an_error_that_says_how_to_forget(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match=r"hosts.json: cannot read the hosts kept out .*delete the file"):
        hosts_out(path)


def test_a_run_says_which_hosts_are_kept_out_and_which_it_keeps_out(tmp_path: Path) -> None:
    path = tmp_path / "hosts.json"
    earlier = RunsHosts(path, MACHINES, "run-1", 60, 2)
    said = earlier.keep_out({"h2": "connection to h2 lost", "h3": "gpu_health: GPU 0 needs a GPU reset",
                             "h4": "lost", "sim9": "not an inventory host"})
    assert said[0].startswith("h2 is kept out of later runs until ") and said[0].endswith(
        "(restarts.cooldown); `harness hosts --release h2` brings it back")
    assert said[2] == ("h4 not kept out of later runs: 2 of the inventory's 8 hosts are out already "
                       "(restarts.max_out); so many failing together is more likely the network's fault than theirs: "
                       "look before bringing them back")
    renamed = RunsHosts(path, {"node-a": "10.0.0.2:22", "node-b": "10.0.0.3:22", "node-c": "10.0.0.4:22"},
                        "run-2", 60, 2)
    lines = renamed.keep_out_earlier()
    assert list(renamed.kept_out) == ["node-a", "node-b"], "the machine, whatever an inventory calls it"
    assert lines[1].startswith("node-b is kept out until ") and lines[1].endswith(
        ": gpu_health: GPU 0 needs a GPU reset (run run-1); `harness hosts --release node-b` brings it back")
    assert RunsHosts(path, {}, "run-3", 60, 2).keep_out_earlier() == [], "simulated nodes: nothing kept out"


def test_harness_hosts_lists_them_and_brings_one_back(tmp_path: Path) -> None:
    """The verb, in a state directory of its own."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    path = tmp_path / "harness" / "hosts.json"
    assert "no host is kept out" in harness("hosts", env=env).stdout
    assert not path.parent.exists(), "listing writes nothing"
    path.parent.mkdir()
    path.write_text(json.dumps([HostOut("10.0.0.2:22", "h2", "connection to h2 lost", "run-1", time.time(),
                                        time.time() + 600).__dict__]))
    listed = harness("hosts", env=env).stdout.splitlines()
    assert listed[0].split() == ["HOST", "ADDRESS", "FOR", "RUN", "WHY"]
    assert listed[1].split()[:5] == ["h2", "10.0.0.2:22", "10", "min", "more"] and listed[1].endswith(
        "run-1  connection to h2 lost")
    assert listed[2] == "bring one back: harness hosts --release HOST (or all)"
    assert harness("hosts", "--release", "h2", env=env).stdout == "h2 (10.0.0.2:22) is back: the next run may use it\n"
    unknown = harness("hosts", "--release", "h2", env=env)
    assert unknown.returncode == 2 and "no host 'h2' is kept out" in unknown.stderr
