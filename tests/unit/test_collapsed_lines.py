"""Identical lines of a node's ranks said once by its agent (`[ranks 8-15]: ...`, harness.node.protocol.RankLines),
and every reader of them: the controller's stream (each rank's last line and step, its tail, the cascade's slow
path), the terminal (collapsing or showing every line) and `harness logs`. A real agent's collapse: tests/unit/
test_agent_link.py; a real launch's: tests/integration/test_scale.py."""

from __future__ import annotations

import io
import random
import re
import time
from pathlib import Path

from harness.control import worker_output
from harness.control.live import LiveNode
from harness.control.output import Output
from harness.control.terminal import Terminal
from harness.node.protocol import RANKS_PREFIX, RankLines, collapsed_ranks, expanded, numbers_of
from harness.plan.planner import Node
from harness.record.rundir import RunDir
from harness.record.stream import StreamRecord, stamp
from harness.spec.progress import LinePatterns
from harness.view.logs import Selection, print_logs

PROGRESS = LinePatterns([r"\bstep (?P<step>\d+)"])
NODE_RANKS = range(8, 16)


def _node() -> LiveNode:
    return LiveNode(Node(host="sim1", address="127.0.0.1", node_rank=1, nproc=8), started=0.0)


def _said(lines: list[bytes], seed: int) -> bytes:
    """lines as an agent says them, read in chunks cut anywhere, its window ending at random reads."""
    stream = b"".join(lines)
    choose = random.Random(seed)
    held, said, at = RankLines(0.25), [], 0
    while at < len(stream):
        size = choose.randint(1, 40)
        said.append(held.take(stream[at:at + size], 0.0))
        at += size
        if choose.random() < 0.2:
            said.append(held.flush())
    return b"".join(said) + held.flush()


def _by_rank(text: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        if (rank := worker_output.rank_of(line)) is not None:
            lines.setdefault(rank, []).append(line)
    return lines


def test_an_agent_says_identical_lines_of_its_ranks_once_each_ranks_lines_in_order_and_others_in_their_place():
    """Random streams of 8 ranks' lines (a few texts, so that copies meet), torchrun's own lines and lines with a
    carriage return among them, cut into random chunks: every rank's lines come back whole and in order, a line of no
    rank comes after everything said before it and before everything said after it, and copies went as one."""
    texts = [b"UserWarning: deprecated", b"epoch 1/1 step 3/9", b"", b"same"]
    for seed in range(60):
        choose = random.Random(seed)
        lines = []
        for _ in range(choose.randint(1, 80)):
            kind = choose.random()
            if kind < 0.1:
                lines.append(b"torchrun's own line %d\n" % len(lines))
            elif kind < 0.15:
                lines.append(b"[rank%d]: bar %d\r\n" % (choose.choice(NODE_RANKS), len(lines)))
            else:
                lines.append(b"[rank%d]: %s\n" % (choose.choice(NODE_RANKS), choose.choice(texts)))
        said = _said(lines, seed).decode()
        again = expanded(said, NODE_RANKS)
        given = b"".join(lines).decode()
        assert _by_rank(again) == _by_rank(given), seed
        assert sorted(again.splitlines()) == sorted(given.splitlines()), seed
        assert len(said.splitlines()) <= len(given.splitlines()), seed
        for index, line in enumerate(lines):
            if not line.startswith(b"[rank") or b"\r" in line:  # a barrier: what came before it is still before it
                before = again.splitlines(keepends=True).index(line.decode())
                assert sorted(again.splitlines(keepends=True)[:before]) == \
                    sorted(b"".join(lines[:index]).decode().splitlines(keepends=True)), seed


def test_a_step_line_of_eight_ranks_goes_as_one_that_names_them_and_a_line_cut_between_reads_joins_its_copies():
    held = RankLines(0.25)
    first = held.take(b"".join(b"[rank%d]: epoch 1/1 step 3/9\n" % rank for rank in NODE_RANKS) + b"[rank8]: Warn", 5.0)
    assert first == b"" and held.due == 5.25, "held for the window"
    assert held.take(b"ing\n[rank9]: Warning\n", 5.1) == b""
    assert held.flush() == b"[ranks 8-15]: epoch 1/1 step 3/9\n[ranks 8,9]: Warning\n"
    assert held.take(b"[rank8]: no end yet", 6.0) == b"[rank8]: no end yet", "nothing held: a line's start goes"
    assert held.take(b" ... its end\n[rank8]: next\n", 6.1) == b" ... its end\n"
    assert held.flush() == b"[rank8]: next\n"


def test_a_collapsed_line_makes_no_rank_of_another_node_nor_a_million_lines():
    assert collapsed_ranks("[ranks 8-15]: x", NODE_RANKS) == (list(NODE_RANKS), "x")
    for forged in ("[ranks 0-15]: x", "[ranks 8-99999999]: x", "[ranks 9-8]: x", "[ranks 8,,9]: x", "[ranks ]: x"):
        assert collapsed_ranks(forged, NODE_RANKS) is None, forged
        assert expanded(forged + "\n", NODE_RANKS) == forged + "\n"
    assert collapsed_ranks("[ranks 0-99999999]: x") is None, "where its node's ranks are not known: at most 1,024"
    assert expanded("[ranks 8,9]: a\x0cb\x1ec\u2028d\n", NODE_RANKS) == \
        "[rank8]: a\x0cb\x1ec\u2028d\n[rank9]: a\x0cb\x1ec\u2028d\n", "a line ends at its newline alone"
    node = _node()
    node.take_block("[ranks 0-99999999]: step 4\n[ranks 0-15]: step 4\n", at=1.0, progress=PROGRESS)
    assert node.activity == {}


def test_the_controller_notes_each_rank_of_a_collapsed_line_and_gives_each_its_own_lines_back():
    node = _node()
    block = node.take_block("[ranks 8-15]: epoch 1/1 step 3/9\n[rank9]: epoch 1/1 step 4/9\n[ranks 8,10]: bye\n",
                            at=7.0, progress=PROGRESS)
    assert block.shown_lines == 3 and block.logged == block.shown, "the fast path: as it came"
    assert {rank: (a.line, [s.step for s in a.steps]) for rank, a in node.activity.items()} == {
        8: ("[rank8]: bye", [3]), 9: ("[rank9]: epoch 1/1 step 4/9", [4]), 10: ("[rank10]: bye", [3]),
        **{rank: (f"[rank{rank}]: epoch 1/1 step 3/9", [3]) for rank in range(11, 16)}}
    assert node.last_lines(10) == ["[rank10]: epoch 1/1 step 3/9", "[rank10]: bye"]
    assert worker_output.rank_lines(node.tail, 9) == ["epoch 1/1 step 3/9", "epoch 1/1 step 4/9"]


def test_a_collapsed_traceback_takes_the_slow_path_as_each_ranks_own():
    """Identical tracebacks of two ranks, collapsed line by line: the cascade sees each rank's, and shows the one
    traceback once, as it shows the same traceback of another rank."""
    node = _node()
    lines = ["Traceback (most recent call last):", '  File "/job/t.py", line 8, in <module>', "ValueError: bad batch"]
    block = node.take_block("".join(f"[ranks 8,9]: {line}\n" for line in lines), at=1.0)
    assert block.logged == "".join(f"[rank{rank}]: {line}\n" for line in lines for rank in (8, 9))
    assert block.shown == "".join(f"[rank8]: {line}\n" for line in lines)
    assert worker_output.user_error(worker_output.rank_lines(node.tail, 9)).exception == "ValueError: bad batch"


def test_the_terminal_merges_collapsed_lines_of_several_nodes_and_one_that_shows_every_line_expands_them():
    out = io.StringIO()
    terminal = Terminal(out, window=3600.0, collapse=True)
    for line in ("[node0] [ranks 0-7]: w\n", "[node1] [rank8]: w\n", "[node1] [ranks 9-15]: w\n", "[node1] [rank9]: w\n"):
        terminal.job_lines(line, 1)
    terminal.close()
    assert out.getvalue().splitlines() == ["[ranks 0-15]: w", "[node1] [rank9]: w"]
    out = io.StringIO()
    terminal = Terminal(out, collapse=False)
    Output(terminal)._show(_node().take_block("[ranks 8,9]: w\n[rank8]: x\n", at=1.0), "[node1] ", _node())
    terminal.close()
    assert out.getvalue() == "[node1] [rank8]: w\n[node1] [rank9]: w\n[node1] [rank8]: x\n"


def test_harness_logs_gives_each_rank_its_own_lines_of_a_collapsed_one(tmp_path: Path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    record = StreamRecord(run.stream)
    record.harness("harness: a line that quotes [node1] [ranks 8-15]: x is the harness's own\n")
    with record.open_node(0, 1) as node1:
        node1.write(f"{stamp(time.time())} [node1] [ranks 8-10]: step 1\n")
        node1.write(f"{stamp(time.time())} [node1] [rank9]: step 2 [ranks 1-3]: x\n")

    def logs(**chosen: object) -> str:
        out = io.StringIO()
        print_logs(run, Selection(**chosen), out)  # type: ignore[arg-type]
        return out.getvalue()

    assert logs(ranks=frozenset({9})) == "[node1] [rank9]: step 1\n[node1] [rank9]: step 2 [ranks 1-3]: x\n"
    assert logs(grep=re.compile("step 1")) == "".join(f"[node1] [rank{rank}]: step 1\n" for rank in (8, 9, 10))
    assert "harness: a line that quotes [node1] [ranks 8-15]: x" in logs()
    record.close()


def test_numbers_read_back_as_written():
    assert numbers_of("0-3,8,10,11") == [0, 1, 2, 3, 8, 10, 11]
    assert numbers_of("1-2000", most=1024) is None and numbers_of("1-1024", most=1024) == list(range(1, 1025))
    assert not RANKS_PREFIX.startswith("[rank]")
