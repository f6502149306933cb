"""A hang's stacks as the run keeps them: a file per rank for a job of a few hundred ranks; past that, one file for
each set of ranks whose stacks are alike and one for each rank alike with none, so that the files written before a
verdict grow with the kinds of stacks, not with the ranks (16,384 at 2,048 nodes x 8)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.control.stack_capture import RANK_FILES, keep
from harness.health.rank_stack import Collective, Frame, RankStack, StackThread
from harness.health.verdict import hang_verdict
from harness.plan.planner import Node
from harness.record.rundir import RunDir

WAIT = (Frame("all_reduce", "/site-packages/torch/distributed/distributed_c10d.py", 2501),
        Frame("main", "train.py", 55, "dist.all_reduce(total)"))
LOADING = (Frame("fetch_batch", "train.py", 21, "time.sleep(3600)"), Frame("main", "train.py", 54))


def _stack(rank: int, frames: tuple[Frame, ...], seq: int, done: bool) -> RankStack:
    """A rank of node rank // 8, with a pid and thread id of its own."""
    node = Node(host=f"h{rank // 8}", address="10.0.0.1", node_rank=rank // 8, nproc=8)
    return RankStack(rank, node, 1000 + rank, "S", (StackThread("MainThread", 5000 + rank, frames),),
                     collectives=(Collective("0", seq, "gloo:all_reduce", done, [[1]], 0),))


def _hang(ranks: int) -> dict[int, RankStack]:
    """Every rank waits in all_reduce #60 but the last, which never reached it."""
    stacks = {rank: _stack(rank, WAIT, 60, False) for rank in range(ranks - 1)}
    return stacks | {ranks - 1: _stack(ranks - 1, LOADING, 59, True)}


def test_past_rank_files_ranks_alike_share_a_file_and_the_odd_rank_has_its_own(tmp_path: Path) -> None:
    ranks = 2048
    run = RunDir(tmp_path / "run")
    keep(run, tmp_path / "run" / "kept", _hang(ranks))
    kept = tmp_path / "run" / "kept"
    assert sorted(p.name for p in kept.iterdir()) == ["alike-rank0.txt", f"rank{ranks - 1}.txt", "stacks.json"]
    alike = (kept / "alike-rank0.txt").read_text()
    assert alike.startswith(f"ranks 0-{ranks - 2} ({ranks - 1} ranks) have stacks alike; rank 0's:\n"), alike[:200]
    assert "dist.all_reduce(total)" in alike and "#60 all_reduce [[1]] unfinished" in alike
    assert "time.sleep(3600)" in (kept / f"rank{ranks - 1}.txt").read_text()
    assert sorted(map(int, json.loads((kept / "stacks.json").read_text()))) == list(range(ranks)), \
        "stacks.json keeps every rank"


def test_ranks_at_another_collective_are_not_alike(tmp_path: Path) -> None:
    stacks = _hang(RANK_FILES + 2) | {0: _stack(0, WAIT, 61, False)}
    run = RunDir(tmp_path / "run")
    keep(run, tmp_path / "run" / "kept", stacks)
    names = sorted(p.name for p in (tmp_path / "run" / "kept").iterdir())
    assert names == ["alike-rank1.txt", "rank0.txt", f"rank{RANK_FILES + 1}.txt", "stacks.json"], names


def test_a_job_of_a_few_hundred_ranks_keeps_a_file_per_rank(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    keep(run, tmp_path / "run" / "kept", _hang(RANK_FILES))
    names = {p.name for p in (tmp_path / "run" / "kept").iterdir()}
    assert names == {f"rank{rank}.txt" for rank in range(RANK_FILES)} | {"stacks.json"}


def test_the_verdict_over_16384_ranks_names_the_one_behind() -> None:
    """At 2,048 nodes x 8 the verdict looked at every rank's sizes once for each rank (minutes on two cores)."""
    ranks = 2048 * 8
    verdict = hang_verdict(30, _hang(ranks), {})
    assert verdict.odd == [ranks - 1]
    assert f"ranks 0-{ranks - 2} wait in all_reduce #60 at train.py:55 in main" in verdict.text, verdict.text[:500]
    assert f"rank {ranks - 1} (node{(ranks - 1) // 8} on h{(ranks - 1) // 8}) has not reached #60" in verdict.text
