"""The terminal at scale: identical job lines from several ranks (or several nodes' torchrun) that come
within a window are shown as one line naming them, in the order they first came, nothing lost; few
ranks, or --no-collapse, see every line as it is."""

from __future__ import annotations

import argparse
import io
import re
import threading
from pathlib import Path

import pytest

from harness import cli, commands
from harness.control import controller
from harness.control.terminal import Terminal, _Copies, _Group
from harness.node.protocol import COLLAPSE_ABOVE, number_ranges

LONG = 3600.0  # a window no test outlives: what is held is shown by close() or a harness line


class _Watched(io.StringIO):
    """A terminal that tells when something reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.written = threading.Event()

    def write(self, text: str) -> int:
        count = super().write(text)
        self.written.set()
        return count


def _line(rank: int, text: str, nproc: int = 8) -> str:
    return f"[node{rank // nproc}] [rank{rank}]: {text}\n"


def _shown(lines: list[str], window: float = LONG) -> list[str]:
    out = io.StringIO()
    terminal = Terminal(out, window=window, collapse=True)
    for line in lines:
        terminal.job_lines(line, 1)
    terminal.close()
    return out.getvalue().splitlines()


def test_a_thousand_ranks_printing_the_same_line_show_one():
    assert _shown([_line(rank, "UserWarning: foo") for rank in range(1024)]) == ["[ranks 0-1023]: UserWarning: foo"]


def test_identical_and_distinct_lines_keep_the_order_they_first_came_in():
    lines = [_line(0, "a"), _line(1, "a"), _line(0, "b"), _line(10, "c"), _line(3, "a"), _line(1, "b"),
             _line(8, "a"), _line(10, "a"), _line(11, "a")]
    assert _shown(lines) == ["[ranks 0,1,3,8,10,11]: a", "[ranks 0,1]: b", "[node1] [rank10]: c"]


def test_a_single_ranks_lines_are_shown_as_they_came():
    block = _line(5, "step 3 loss 2.1") + _line(5, "step 4 loss 2.0")
    out = io.StringIO()
    terminal = Terminal(out, window=LONG, collapse=True)
    terminal.job_lines(block, 2)
    terminal.job_lines("[node0] some torchrun line\n", 1)
    terminal.close()
    assert out.getvalue() == block + "[node0] some torchrun line\n"


def test_a_block_of_several_ranks_lines_collapses_line_by_line():
    """Output hands the terminal a node's block at a time: its lines collapse one by one."""
    blocks = ["".join(_line(rank, f"step {step}") for rank in range(node * 8, node * 8 + 8) for step in (1, 2))
              for node in range(4)]
    out = io.StringIO()
    terminal = Terminal(out, window=LONG, collapse=True)
    for block in blocks:
        terminal.job_lines(block, 16)
    terminal.close()
    assert out.getvalue().splitlines() == ["[ranks 0-31]: step 1", "[ranks 0-31]: step 2"]


def test_torchruns_own_lines_from_many_nodes_collapse_without_their_glog_headers():
    warning = "torch/distributed/run.py:792] Setting OMP_NUM_THREADS environment variable for each process"
    lines = [f"[node{node}] W1127 09:12:{33 + node % 2:02d}.{node:06d} {1000 + node} {warning}\n"
             for node in range(256)]
    assert _shown(lines) == [f"[nodes 0-255] W1127 09:12:33.000000 1000 {warning}"]
    cpp = [_line(rank, f"[W1127 09:12:33.{rank:06d} socket.cpp:12] [c10d] a warning") for rank in range(4)]
    assert _shown(cpp) == ["[ranks 0-3]: [W1127 09:12:33.000000 socket.cpp:12] [c10d] a warning"]
    assert _shown(lines[:1]) == [lines[0].rstrip("\n")], "one node's line is shown as it came"


def test_a_rank_and_a_node_saying_the_same_are_not_one():
    assert _shown([_line(0, "hello"), "[node1] hello\n", _line(9, "hello")]) == \
        ["[ranks 0,9]: hello", "[node1] hello"]


def test_a_rank_printing_the_same_line_twice_keeps_both():
    assert _shown([_line(0, "x"), _line(0, "x")]) == ["[node0] [rank0]: x", "[node0] [rank0]: x"]
    assert _shown([_line(0, "x"), _line(0, "x"), _line(1, "x"), _line(2, "x"), _line(1, "x")]) == \
        ["[ranks 0-2]: x", "[ranks 0,1]: x"]


def test_a_rank_repeating_itself_fills_one_group_after_another():
    lines = [_line(0, ""), _line(0, ""), _line(0, ""), _line(1, ""), _line(2, ""), _line(1, "")]
    assert _shown(lines) == ["[ranks 0-2]: ", "[ranks 0,1]: ", "[node0] [rank0]: "]


def test_a_ranks_next_copy_goes_to_the_oldest_group_without_one_after_older_groups_were_shown():
    copies = _Copies()

    def join(member: int) -> _Group:
        group = copies.group_of([member])
        if group is None:
            group = _Group(("rank", "x"), _line(member, "x"), "", 0.0, 0.0)
            copies.groups.append(group)
        copies.joined([member])
        group.members.append(member)
        return group

    first, second = join(0), join(0)
    assert join(1) is first and second is not first
    copies.groups.popleft()
    copies.released += 1
    assert join(2) is second and join(1) is second, "the oldest group still held"
    assert join(0) not in (first, second) and join(1) is copies.groups[1]


def test_lines_of_no_node_are_shown_in_their_place():
    """A Slurm job's follower shows the record's lines, the controller's words among them."""
    assert _shown([_line(0, "a"), "harness: started\n", _line(1, "a")]) == ["[ranks 0,1]: a", "harness: started"]


def test_held_lines_are_shown_when_their_window_ends():
    out = _Watched()
    terminal = Terminal(out, window=0.05, collapse=True)
    terminal.job_lines(_line(0, "x") + _line(1, "x") + _line(2, "x"), 3)
    assert out.written.wait(30), "the window's end showed nothing"
    assert out.getvalue() == "[ranks 0-2]: x\n"
    out.written.clear()
    terminal.job_lines(_line(3, "x"), 1)
    assert out.written.wait(30)
    assert out.getvalue() == "[ranks 0-2]: x\n[node0] [rank3]: x\n", "a copy after the window is a line of its own"
    terminal.close()


def test_close_shows_everything_held():
    out = io.StringIO()
    terminal = Terminal(out, window=LONG, collapse=True)
    for rank in range(16):
        terminal.job_lines(_line(rank, "same") + _line(rank, f"own {rank}"), 2)
    terminal.close()
    assert out.getvalue().splitlines() == ["[ranks 0-15]: same", *(f"[node{r // 8}] [rank{r}]: own {r}"
                                                                   for r in range(16))]


def test_the_harness_words_come_after_the_job_lines_that_came_before_them():
    out = io.StringIO()
    terminal = Terminal(out, window=LONG, collapse=True)
    terminal.job_lines(_line(0, "before") + _line(1, "before"), 2)
    terminal.say("node1 failed")
    terminal.job_lines(_line(2, "before") + _line(3, "after"), 2)
    terminal.close()
    assert out.getvalue().splitlines() == ["[ranks 0,1]: before", "harness: node1 failed",
                                           "[node0] [rank2]: before", "[node0] [rank3]: after"]


def test_collapse_off_shows_every_line_as_it_came():
    lines = [_line(rank, "UserWarning: foo") for rank in range(16)]
    out = io.StringIO()
    terminal = Terminal(out)
    for line in lines:
        terminal.job_lines(line, 1)
    terminal.close()
    assert out.getvalue() == "".join(lines)


def test_turning_collapse_off_shows_what_is_held_first():
    out = io.StringIO()
    terminal = Terminal(out, window=LONG, collapse=True)
    terminal.job_lines(_line(0, "a") + _line(1, "a"), 2)
    terminal.collapse = False
    terminal.job_lines(_line(2, "a"), 1)
    terminal.close()
    assert out.getvalue().splitlines() == ["[ranks 0,1]: a", "[node0] [rank2]: a"]


@pytest.mark.parametrize("numbers,text", [
    ([5], "5"), ([7, 8], "7,8"), ([3, 1, 2], "1-3"), ([1, 3, 5], "1,3,5"), ([0, 1, 2, 3, 8, 10, 11], "0-3,8,10,11"),
    (range(1024), "0-1023"), ([0, 2, 3, 4, 1023], "0,2-4,1023"),
])
def test_rank_ranges(numbers: list[int], text: str):
    assert number_ranges(numbers) == text


@pytest.mark.parametrize("world_size,flag,on", [(COLLAPSE_ABOVE, True, False), (COLLAPSE_ABOVE + 1, True, True),
                                                (1024, False, False)])
def test_an_attempt_collapses_above_a_few_ranks_unless_turned_off(world_size: int, flag: bool, on: bool):
    terminal = Terminal(io.StringIO())
    run = controller._TargetRun()
    run.collapse = flag
    run.collapse_for(terminal, world_size)
    terminal.close()
    assert terminal.collapse is on


@pytest.mark.parametrize("words", [["jobs/smoke.yaml"], ["train.py", "--nnodes", "2"]])
def test_no_collapse_reaches_the_controller_from_a_spec_file_or_a_script(words: list[str], tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    given: list[bool] = []

    def launch(*args: object, collapse: bool = True, **kwargs: object) -> int:
        given.append(collapse)
        return 0

    monkeypatch.setattr(controller, "launch", launch)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    for flags in ([], ["--no-collapse"]):
        args, rest = cli.parser().parse_known_args(["launch", *words, "--runs-dir", str(tmp_path), *flags])
        assert rest == []
        commands.launch(argparse.Namespace(**vars(args), script_args=[], rerun=["launch", *words]))
    assert given == [True, False]


def test_copies_that_keep_coming_keep_their_line_held_up_to_a_limit_and_many_ranges_stay_one_line():
    """A step's line from 1,024 ranks on a busy machine comes over a second or more: each copy holds the line a
    window longer, never past COLLAPSE_LONGEST windows from the first; scattered ranks are named in part."""
    out = _Watched()
    terminal = Terminal(out, window=0.3, collapse=True)
    for rank in range(0, 5):
        terminal.job_lines(_line(rank, "step 1"), 1)
        assert not out.written.wait(0.1), out.getvalue()  # 0.5 s in all, past the first copy's window
    assert out.written.wait(5)
    terminal.job_lines("".join(_line(rank, "step 2") for rank in range(0, 1024, 3)), 342)
    terminal.close()
    first, second = out.getvalue().splitlines()
    assert first == "[ranks 0-4]: step 1"
    assert re.fullmatch(r"\[ranks 0,3,6,9,(\d+,)+\.\.\. 342 in all\]: step 2", second) and len(second) < 80, second
