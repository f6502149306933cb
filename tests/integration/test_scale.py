"""The harness with 32 simulated nodes: each node a real node agent and torchrun's place taken by a stand-in that
starts its ranks as torchrun does, the ranks costing no torch import (testbed/standin; bench/scale.py measures
16 to 256 nodes). A hang is found and named among 64 ranks, the terminal shows the ranks' identical lines as one
line that names them (each node's agent collapsed its own first), and the run's logs keep every line; the
controller's threads do not grow with the nodes."""

from __future__ import annotations

import re
from pathlib import Path

from harness.node.protocol import RANKS_PREFIX, numbers_of

from conftest import REPO, assert_nothing_left, free_port, harness

STANDIN = REPO / "testbed" / "standin"
NODES, NPROC = 32, 2
WORLD = NODES * NPROC
HANG_STEP = 6
STALL = 20  # well past the spread of the 96 processes' start on a busy 2-core machine


def test_a_hang_among_32_nodes_is_named_and_identical_lines_collapse(write_yaml, launch, tmp_path):
    job = write_yaml(f"""
        name: scale
        nnodes: {NODES}
        nproc_per_node: {NPROC}
        backend: gloo
        master_port: {free_port()}
        entrypoint:
          script: {STANDIN / "rank.py"}
          args: [--steps, "1000", --step-seconds, "0.5", --warning, --hang-rank, "{WORLD - 1}",
                 --hang-step, "{HANG_STEP}"]
        env: {{PYTHONPATH: "{STANDIN / "shim"}:{REPO}"}}
        health: {{stall: {STALL}}}
        timeouts: {{stop_grace: 3, rendezvous: 300}}
        """)
    run = launch(job)
    run.wait_for(rf"^harness: run \S+: {NODES} node\(s\) x {NPROC} process\(es\) on sim0, sim1, sim2, \.\.\., "
                 rf"sim{NODES - 1}, master ")
    run.wait_for(rf"\]: epoch 1/1 step {HANG_STEP - 1}/", timeout=180)
    status = harness("status", run.run_id, "--runs-dir", str(tmp_path / "runs"))
    assert status.returncode == 0 and re.search(rf"^\s*{WORLD - 1}\s+node{NODES - 1}\b", status.stdout, re.M), \
        status.stdout
    threads = int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{run.proc.pid}/status").read_text(), re.M)[1])
    assert threads < NODES // 2, f"the controller runs {threads} threads for {NODES} nodes: they grow with the nodes"
    verdict = run.wait_for(r"^harness: hang: (.*)", timeout=STALL + 15 + 60).group(1)
    assert re.search(rf"ranks 0-{WORLD - 2} wait in all_reduce #{HANG_STEP} at \S+collectives.py:\d+ in _collective; "
                     rf"rank {WORLD - 1} \(node{NODES - 1} on sim{NODES - 1}\) has not reached #{HANG_STEP}, at "
                     r"\S+rank.py:\d+ in fetch_batch: time.sleep\(3600\) \(stacks in ", verdict), verdict
    assert run.finish(timeout=90) == 1
    assert run.summary()["first_failure"]["kind"] == "hang"
    assert_nothing_left(run.run_id)

    # every step's line once per window, naming its ranks, where 64 came: all of them named, in a few lines
    for step in range(1, HANG_STEP):
        shown = [m for line in run.lines
                 if (m := re.match(rf"(?:\[node\d+\] )?\[ranks? ([\d,-]+)\]: epoch 1/1 step {step}/", line))]
        assert 1 <= len(shown) <= 8, (step, shown)
        assert sorted(r for m in shown for r in numbers_of(m[1]) or []) == list(range(WORLD)), shown
    warnings = [line for line in run.lines if "UserWarning: this stand-in" in line]
    assert len(warnings) < WORLD // 4, warnings
    assert any(line.startswith("[ranks ") for line in warnings), warnings

    # each node's agent said its ranks' identical lines once, and the logs give each rank's own lines back
    collapsed = [line for path in (run.runs_dir / run.run_id).glob("node*.log") for line in path.read_text().splitlines()
                 if line.startswith(RANKS_PREFIX)]
    assert collapsed, "no node's agent collapsed its ranks' identical lines"
    logs = harness("logs", run.run_id, "--rank", "5", "--runs-dir", str(tmp_path / "runs"))
    steps = re.findall(r"^\[node2\] \[rank5\]: epoch 1/1 step (\d+)/", logs.stdout, re.M)
    assert steps == [str(s) for s in range(1, HANG_STEP)], logs.stdout[-2000:]
