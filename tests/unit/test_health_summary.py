"""health.json, `harness status` and `harness logs --rank` of a job of 2,048 nodes x 8 ranks: what is written twice a
second is each node summed up and the odd ranks alone (record/health_summary.py), status lists nodes by state and
those ranks, and a rank's logs are read from its node's file alone; a small job's file and status are as before."""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.control.health_loop import TICK_SECONDS, HealthLoop
from harness.control.live import LiveNode, RankActivity, StepMark
from harness.node.proctable import start_ticks
from harness.node.protocol import HEALTH_MESSAGES_PER_SECOND
from harness.plan.planner import Node
from harness.record.health_summary import BEHIND_LISTED, ODD_LISTED, TABLE_SECONDS, NodeSpan, summed
from harness.record.rundir import RunDir
from harness.record.schema import SUMMED_PAST, ControllerId, LiveHealth, RankRow, RunState, RunStatus
from harness.record.stream import StreamReader, stamp
from harness.view import logs as logs_view
from harness.view.logs import Selection, log_lines
from harness.view.status import run_details
from harness.view.top import _last_lines, stream_tail

NODES, NPROC = 2048, 8
WORLD = NODES * NPROC
BYTES_PER_NODE = 200  # health.json's room per node, the odd ranks' rows aside (about 150 bytes, compact JSON)
HUNG, SLOW, STOPPED, BEHIND, STARTING_NODE = 77, 4242, 9000, 500, 1500


def busy_job(now: float) -> LiveHealth:
    """Every rank computing or waiting at step 120, but: rank HUNG without progress for 31 s (a hang's verdict names
    it), SLOW named slow, STOPPED stopped, BEHIND at step 117, and node STARTING_NODE's ranks still starting."""
    ranks = {}
    for rank in range(WORLD):
        node = rank // NPROC
        ranks[rank] = RankRow(f"node{node}", f"gpu-{node:04d}", "computing" if rank % 3 else "waiting", cpu=0.98,
                              busy=0.9, last_line=f"[rank{rank}]: step 120 loss 0.1", last_line_at=now - 1, step=120,
                              step_rate=4.1, idle=0.0, step_at=now - 1)
    ranks[HUNG] = replace(ranks[HUNG], state="no progress for 31 s", idle=31.0, step=119)
    ranks[STOPPED] = replace(ranks[STOPPED], state="stopped (SIGSTOP)", idle=12.0)
    ranks[BEHIND] = replace(ranks[BEHIND], step=117)
    for rank in range(STARTING_NODE * NPROC, (STARTING_NODE + 1) * NPROC):
        ranks[rank] = RankRow(f"node{STARTING_NODE}", f"gpu-{STARTING_NODE:04d}", "starting")
    return LiveHealth(attempt=0, t=now, slow={SLOW: 61.0}, ranks=ranks, started_at=now - 100)


def spans() -> list[NodeSpan]:
    return [NodeSpan(node, f"gpu-{node:04d}", range(node * NPROC, (node + 1) * NPROC)) for node in range(NODES)]


def running_run(root: Path, nnodes: int, world: int) -> RunDir:
    """A run recorded as running, its controller this process."""
    run = RunDir(root / "job-x")
    run.path.mkdir()
    me = ControllerId(os.getpid(), start_ticks(os.getpid()))
    run.write_state(RunState("job-x", "job", "local", RunStatus.RUNNING, time.time() - 100, nnodes, world, me,
                             [f"gpu-{node:04d}" for node in range(nnodes)]))
    return run


def test_a_2048_by_8_job_health_json_sums_up_each_node_and_keeps_only_the_odd_ranks(tmp_path: Path) -> None:
    now = time.time()
    full = busy_job(now)
    health = summed(full, spans(), [HUNG], now - 5)
    run = running_run(tmp_path, NODES, WORLD)
    run.write_health(health)
    size = run.health_file.stat().st_size
    assert size < NODES * BYTES_PER_NODE + ODD_LISTED * 600, size  # every rank's rows took about 500 bytes a rank
    back = run.read_health(0)
    assert back == health and back.world_size == WORLD
    starting = set(range(STARTING_NODE * NPROC, (STARTING_NODE + 1) * NPROC))
    assert set(back.ranks) == {HUNG, SLOW, STOPPED, BEHIND} | starting, sorted(back.ranks)
    assert back.odd_left == 0 and back.table_at == now - 5
    node9 = back.nodes[HUNG // NPROC]
    assert (node9.first_rank, node9.last_rank, node9.states) == (72, 79, {"computing": 4, "waiting": 3,
                                                                          "no progress": 1})
    assert (node9.least_step, node9.most_step, node9.host) == (119, 120, "gpu-0009")
    assert back.nodes[STARTING_NODE].states == {"starting": 8} and back.nodes[STARTING_NODE].cpu is None
    assert back.nodes[0].cpu == round(8 * 0.98, 3)

    # the table of every rank, written less often: the rows read are its rows with health.json's odd ones over them
    run.write_health_table(replace(full, ranks={**full.ranks, HUNG: replace(full.ranks[HUNG], idle=26.0)}))
    rows = run.read_rank_rows(back)
    assert len(rows) == WORLD and rows[HUNG].idle == 31.0 and rows[0] == full.ranks[0]


def test_odd_ranks_past_the_listed_ones_are_counted_and_the_longest_still_come_first() -> None:
    """Every rank of half the nodes without progress: ODD_LISTED are listed, the ones still longest first."""
    now = time.time()
    full = busy_job(now)
    ranks = dict(full.ranks)
    for rank in range(WORLD // 2):
        ranks[rank] = replace(ranks[rank], state=f"no progress for {20 + rank % 7} s", idle=20.0 + rank % 7)
    health = summed(replace(full, ranks=ranks, slow={}), spans(), [], None)
    assert len(health.ranks) == ODD_LISTED and health.odd_left > WORLD // 2 - ODD_LISTED
    assert {row.idle for row in health.ranks.values()} == {26.0}, "the ones without progress longest"


def test_ranks_behind_are_odd_past_one_step_and_at_most_a_few() -> None:
    now = time.time()
    full = busy_job(now)
    ranks = {rank: replace(row, step=119 if rank % 2 else 120) for rank, row in full.ranks.items()}
    assert BEHIND not in summed(replace(full, ranks=ranks), spans(), [], None).ranks, "one step: ranks in step"
    ranks.update({rank: replace(ranks[rank], step=100) for rank in range(100, 130)})
    listed = summed(replace(full, ranks=ranks), spans(), [], None).ranks
    assert sorted(set(listed) & set(range(100, 130))) == list(range(100, 100 + BEHIND_LISTED))


def test_status_of_a_2048_by_8_job_lists_nodes_by_state_and_the_odd_ranks_alone(tmp_path: Path) -> None:
    now = time.time()
    run = running_run(tmp_path, NODES, WORLD)
    run.write_health(summed(busy_job(now), spans(), [HUNG], now - 5))
    text = run_details(run)
    lines = text.splitlines()
    assert len(lines) < 30, text
    assert "  ranks by node (2048 nodes, 16384 ranks):" in lines, text
    assert "    nodes 0-8,10-1124,1126-1499,1501-2047 (2045, on gpu-0000...): 8 computing or waiting; steps " \
           "117-120" in lines, text
    assert "    node9 (gpu-0009): 7 computing or waiting, 1 no progress; steps 119-120" in lines, text
    assert "    node1125 (gpu-1125): 7 computing or waiting, 1 stopped (SIGSTOP); step 120" in lines, text
    assert "    node1500 (gpu-1500): 8 starting" in lines, text
    rows = [line.split()[:2] for line in lines if re.match(r"  +\d+ node", line)]
    assert rows == [[str(HUNG), "node9"], [str(BEHIND), "node62"], [str(SLOW), "node530"], [str(STOPPED), "node1125"],
                    *[[str(rank), "node1500"] for rank in range(12000, 12008)]], text
    assert re.search(rf"^  {WORLD - 12} of {WORLD} ranks not listed: computing or waiting, as most are; every rank's "
                     rf"row: {re.escape(str(run.health_table))} \(every 30 s, last \d+s ago\); a rank's lines: "
                     r"`harness logs job-x --rank N`$", text, re.M), text


def test_a_small_job_health_json_and_status_are_as_before(tmp_path: Path) -> None:
    """Up to SUMMED_PAST ranks, health.json is every rank's row in the record's own form, without the summary's
    fields, and status lists every rank (the widths of RANK and NODE as they were)."""
    now = time.time()
    run = running_run(tmp_path, 2, 4)
    ranks = {rank: RankRow(f"node{rank // 2}", f"sim{rank // 2}", "waiting" if rank else "computing", cpu=0.5, step=3)
             for rank in range(4)}
    health = LiveHealth(attempt=0, t=now, ranks=ranks, started_at=now - 5)
    run.write_health(health)
    text = run.health_file.read_text()
    assert list(json.loads(text)) == ["attempt", "t", "slow", "hang", "ranks", "started_at", "progress", "slowed"]
    assert text.startswith('{\n  "attempt": 0,\n  "t": ') and run.read_health(0) == health
    assert run.read_rank_rows(health) == ranks
    lines = run_details(run).splitlines()
    assert "  RANK NODE    HOST         STATE                      CPU    STEP  STEP/S  LAST LINE" in lines
    assert "     3 node1   sim1         waiting                    50%       3       -  -" in lines
    assert not any("ranks by node" in line or "not listed" in line for line in lines), lines
    assert SUMMED_PAST >= 64, "every job of the integration tests keeps every rank's row"


def test_the_health_loop_writes_every_rank_s_row_only_every_table_seconds_past_summed_past(tmp_path: Path) -> None:
    run = running_run(tmp_path, 64, 64 * 8)
    nodes = [LiveNode(Node(f"sim{n}", f"10.0.0.{n}", n, 8), started=time.time()) for n in range(64)]
    loop = HealthLoop(None, run, 0, nodes, SimpleNamespace(), SimpleNamespace(say=print), SimpleNamespace())
    loop._write_health()
    health = run.read_health(0)
    assert health is not None and len(health.nodes) == 64 and health.nodes[3].states == {"starting": 8}
    assert health.ranks == {} and health.table_at == health.t
    assert len(run.read_rank_rows(health)) == 64 * 8
    run.health_table.unlink()
    loop._write_health()
    assert not run.health_table.exists(), "within TABLE_SECONDS of the last"
    loop._table_at = time.time() - 31
    loop._write_health()
    assert run.health_table.exists()


def test_past_summed_past_the_timeline_takes_every_rank_every_table_seconds_and_the_odd_ranks_between(
        tmp_path: Path) -> None:
    """64 nodes x 8, every rank at step 120 but rank 77 at step 100 (behind: odd), past the attempt's young seconds:
    the first line holds every rank, the lines after it only rank 77 (marked so) until TABLE_SECONDS have passed, then
    every rank again; while the attempt is young, and in a job of up to SUMMED_PAST ranks, every line has every rank.
    What the timeline takes a second then grows with the odd ranks, not with every rank."""
    for nnodes, world in ((64, 64 * 8), (32, SUMMED_PAST)):
        (tmp_path / str(nnodes)).mkdir()
        run = running_run(tmp_path / str(nnodes), nnodes, world)
        nproc = world // nnodes
        nodes = [LiveNode(Node(f"sim{n}", f"10.0.0.{n}", n, nproc), started=time.time() - 100) for n in range(nnodes)]
        for live in nodes:
            for rank in live.node.ranks:
                activity = live.activity[rank] = RankActivity(f"[rank{rank}]: step", time.time())
                activity.steps.append(StepMark(time.time(), 100 if rank == 77 else 120))
        loop = HealthLoop(None, run, 0, nodes, SimpleNamespace(), SimpleNamespace(say=print), SimpleNamespace())
        for _ in range(3):
            loop._write_health()
            loop._sampled = 0.0  # the next line due at once
        loop._timeline_every_at = time.time() - TABLE_SECONDS
        loop._write_health()
        lines = [json.loads(line) for line in run.timeline.read_text().splitlines()]
        held = [(len(line["ranks"]), line.get("odd_only", False)) for line in lines]
        if world > SUMMED_PAST:
            assert held == [(world, False), (1, True), (1, True), (world, False)]
            assert list(lines[1]["ranks"]) == ["77"] and lines[1]["ranks"]["77"]["step"] == 100
        else:
            assert held == [(world, False)] * 4
        for live in nodes:  # a young attempt: every rank at every sample, its course from its start
            live.started = time.time()
        loop._sampled = 0.0
        loop._write_health()
        assert len(json.loads(run.timeline.read_text().splitlines()[-1])["ranks"]) == world


@pytest.mark.parametrize(("nnodes", "every"), [(16, TICK_SECONDS), (512, 512 / HEALTH_MESSAGES_PER_SECOND)])
def test_the_health_loop_weighs_every_rank_as_often_as_their_samples_come(tmp_path: Path, nnodes: int,
                                                                          every: float) -> None:
    """Twice a second up to 250 nodes; past them, once per sample interval (protocol.paced): health.json is not
    written again, nor the slow ranks weighed, at a tick that comes before new samples can have."""
    run = running_run(tmp_path, nnodes, nnodes)
    nodes = [LiveNode(Node(f"sim{n}", f"10.0.{n // 250}.{n % 250}", n, 1), started=time.time()) for n in range(nnodes)]
    loop = HealthLoop(None, run, 0, nodes, SimpleNamespace(answer_requests=lambda run: None), SimpleNamespace(say=print),
                      SimpleNamespace(since=None))
    assert loop.every == pytest.approx(every)
    loop._tick()
    first = run.read_health(0)
    loop._weighed_at = time.time() - 0.3  # the next tick 0.3 s after the last weighing, however long that took
    loop._tick()
    second = run.read_health(0)
    assert first is not None and second is not None
    assert (second.t == first.t) == (every > TICK_SECONDS), "the second tick, 0.3 s on: rewritten in a small job only"
    loop._weighed_at = time.time() - every
    loop._tick()
    third = run.read_health(0)
    assert third is not None and third.t > first.t


@pytest.fixture
def planned_run(tmp_path: Path) -> RunDir:
    """A run of 64 nodes x 8 whose logs hold a line of every rank, and a second attempt on 32 nodes x 16."""
    run = RunDir(tmp_path / "job-logs")
    run.path.mkdir()
    for attempt, (nnodes, nproc) in enumerate([(64, 8), (32, 16)]):
        nodes = [{"node_rank": n, "ranks": list(range(n * nproc, (n + 1) * nproc))} for n in range(nnodes)]
        run.plan_json(attempt).write_text(json.dumps({"attempt": attempt, "nodes": nodes}))
        folder = run.stream / f"attempt{attempt}"
        folder.mkdir(parents=True)
        for node in nodes:
            (folder / f"node{node['node_rank']}.log").write_text("".join(
                f"{stamp(1000.0 + attempt * 100 + rank)} [node{node['node_rank']}] [rank{rank}]: hello\n"
                for rank in node["ranks"]))
    return run


def test_logs_of_a_rank_are_read_from_the_nodes_that_hold_it_alone(planned_run: RunDir,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []

    def reader(path: Path) -> StreamReader:
        opened.append(path.relative_to(planned_run.stream).as_posix())
        return StreamReader(path)

    monkeypatch.setattr(logs_view, "StreamReader", reader)
    lines = list(log_lines(planned_run, Selection(ranks=frozenset({21}))))
    assert lines == ["[node2] [rank21]: hello\n", "[node1] [rank21]: hello\n"]
    assert sorted(opened) == ["attempt0/node2.log", "attempt1/node1.log"]


def test_top_reads_a_chunk_of_each_node_s_log_and_finds_the_same_last_lines(planned_run: RunDir) -> None:
    chatty = planned_run.stream / "attempt1" / "node5.log"  # one node's many lines are the newest
    with chatty.open("a") as log:
        log.write("".join(f"{stamp(2000.0 + i)} [node5] [rank80]: line {i} {'x' * 100}\n" for i in range(200)))
    every = sorted(line for path in Selection().files(planned_run.stream) for line in _last_lines(path, 50))
    assert stream_tail(planned_run, 50) == every[-50:]
    assert stream_tail(planned_run, 50)[0].endswith("line 150 " + "x" * 100 + "\n")
