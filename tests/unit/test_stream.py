"""The run's stream, pure parts: a node's output taken a block at a time (the fast path and the line by
line path agree), failed peers' consequent tracebacks held back, the terminal that never holds a rank
up, the agent link's blocks, and the timed record that `harness logs` reads. (For real: the launches of
tests/integration, e.g. test_health.py's slow rank and test_recovery.py's program error.)"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.control.cascade import alike_words
from harness.control.health_loop import rank_row
from harness.control.live import FIRST_STEP_LOOKED_AT, TAIL_KEPT, LiveNode, StepMark
from harness.control.output import Output
from harness.control.stack_capture import StackCapture
from harness.control.terminal import Terminal
from harness.node.protocol import Kind, Word, message_line, parse_word, word_line
from harness.plan.planner import Node
from harness.record.index import create_run_dir
from harness.record.rundir import RunDir
from harness.record.schema import ControllerId, RunState, RunStatus
from harness.record.stream import STAMP_WIDTH, StreamRecord, stamp
from harness.spec.job import Health
from harness.spec.progress import LinePatterns
from harness.targets.agent_link import AgentNode
from harness.view.logs import Selection, duration, print_logs
from harness.view.top import _last_lines

from conftest import harness

PROGRESS = LinePatterns([r"\bstep (?P<step>\d+)"])
GLOO_PEER_GONE = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
                  "peer [127.0.0.1]:16069. This is typically caused by a remote worker crashing. GLHF!")


def live(node_rank: int = 0) -> LiveNode:
    return LiveNode(Node(host=f"sim{node_rank}", address="127.0.0.1", node_rank=node_rank, nproc=2), started=0.0)


def traceback(rank: int, exception: str) -> list[str]:
    return [f"[rank{rank}]: Traceback (most recent call last):", f'[rank{rank}]:   File "/job/t.py", line 8, in <module>',
            f"[rank{rank}]:     dist.all_reduce(t)", f"[rank{rank}]: {exception}"]


def text(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def test_a_block_of_plain_rank_lines_passes_whole_and_notes_each_ranks_last_line_and_step():
    """...and the node's first step, which a restart's block of quick steps would otherwise hide: the attempt's
    first step says which steps it redid."""
    node = live()
    lines = [f"[rank{i % 2}]: epoch 0 step {i}/90 loss 0.5" for i in range(1, 9)] + ["[rank1]: saving"]
    block = node.take_block(text(lines), at=100.0, progress=PROGRESS)
    assert block.logged == block.streamed == block.shown == text(lines) and block.shown_lines == 9
    assert (node.activity[0].line, node.activity[0].at, list(node.activity[0].steps)) == (lines[-2], 100.0, [(100.0, 8)])
    assert (node.activity[1].line, list(node.activity[1].steps)) == ("[rank1]: saving", [(100.0, 1), (100.0, 7)])
    assert list(node.tail) == lines
    node.take_block(text(["[rank1]: epoch 0 step 9/90", "[rank1]: epoch 0 step 11/90"]), at=101.0, progress=PROGRESS)
    assert list(node.activity[1].steps) == [(100.0, 1), (100.0, 7), (101.0, 11)], "the first step only once"


def test_a_long_block_whose_first_steps_come_at_its_end_still_gives_the_first_of_them():
    """Only a block's ends are searched for the node's first step (a chatty job's every line would cost a search
    otherwise), and an end with a step has the whole block read: 100 lines of a data loader's words, then a
    restart's quick steps after its resume, not only the block's last step."""
    node = live()
    loading = [f"[rank0]: loading shard {i} of 100 from /data/cifar (50000 images)" for i in range(100)]
    steps = ["[rank0]: Resumed from checkpoint at step 12", *(f"[rank0]: step {i}/90 loss 0.5" for i in range(13, 17))]
    assert len(text(loading)) > 2 * FIRST_STEP_LOOKED_AT
    node.take_block(text(loading + steps), at=100.0, progress=Health().progress_pattern)
    assert list(node.activity[0].steps) == [(100.0, 13), (100.0, 16)]
    assert node.activity[0].resumed == (100.0, 12)


def test_the_payloads_step_counts_from_the_runs_start_across_epochs_and_a_still_rank_has_no_rate():
    """`epoch 2/12 step 8/10` is step 18: the step and its rate do not fall back at an epoch's start; a rank that
    reports no new step for a while is not moving (rate 0), whatever its last steps' pace was."""
    node = live()
    pattern = Health().progress_pattern
    for at, line in ((100.0, "epoch 1/12 step 9/10 loss 1.0"), (101.0, "epoch 2/12 step 1/10 loss 0.9"),
                     (102.0, "epoch 2/12 step 8/10 loss 0.8"), (103.0, "step 30")):
        node.take_block(f"[rank0]: {line}\n", at=at, progress=pattern)
    assert [mark.step for mark in node.activity[0].steps] == [9, 11, 18, 30]
    moving = rank_row(node, None, node.activity[0], now=104.0)
    assert (moving.step, moving.step_rate) == (30, 7.0)
    assert rank_row(node, None, node.activity[0], now=120.0).step_rate == 0.0


def test_a_resume_line_starts_the_count_and_a_line_without_the_total_keeps_it():
    """Every rank says where it resumed, rank 0 alone prints steps: the others have no step (no rate of 0 to draw),
    and rank 0's total stays through a line that names no total."""
    node = live()
    pattern = Health().progress_pattern
    resumes = "".join(f"[rank{rank}]: resume: epoch 1/2 step 25/50 (global step 25) from ckpt-25.pt\n"
                      for rank in range(4))
    node.take_block(resumes, at=100.0, progress=pattern)
    for at, line in ((101.0, "epoch 1/2 step 26/50 loss 1.0"), (102.0, "checkpoint: step 26 saved in 0.1 s"),
                     (103.0, "step 27 loss 0.9")):
        node.take_block(f"[rank0]: {line}\n", at=at, progress=pattern)
    assert [(rank, activity.resumed) for rank, activity in sorted(node.activity.items())] == \
        [(rank, StepMark(100.0, 25)) for rank in range(4)]
    assert [mark.step for mark in node.activity[0].steps] == [26, 27] and node.activity[0].total == 100
    assert all(not node.activity[rank].steps and rank_row(node, None, node.activity[rank], now=104.0).step_rate is None
               for rank in (1, 2, 3))


def test_a_big_block_keeps_its_last_lines_in_the_tail():
    node = live()
    lines = [f"[rank0]: line {i}" for i in range(TAIL_KEPT * 3)]
    assert node.take_block(text(lines), at=1.0).shown_lines == TAIL_KEPT * 3
    assert list(node.tail) == lines[-TAIL_KEPT:]
    node.take_block(text(lines[:2]), at=2.0)
    assert list(node.tail) == lines[-TAIL_KEPT + 2:] + lines[:2]


def test_a_rank_line_holding_a_separator_stays_one_line_of_its_rank(tmp_path):
    """A rank prints a record separator (the agent's messages begin with one), a form feed and U+2028 inside a line:
    the line is logged, shown and tailed whole with its rank (str.splitlines would break it at each), slow path or
    fast; `harness top` shows it whole from the node's log."""
    odd = "[rank1]: \x1eharness-node-exit 0 \x0c page \u2028 done"
    node = live()
    block = node.take_block(text([odd, "[rank0]: [rank0]: doubled"]), at=1.0)  # the doubled prefix: the slow path
    assert block.logged == block.shown == text([odd, "[rank0]: doubled"]) and node.tail[0] == odd
    assert node.take_block(text([odd]), at=2.0).shown == text([odd])  # the fast path
    log = tmp_path / "node1.log"
    log.write_bytes(text([odd, "[rank1]: after"]).encode())
    assert list(_last_lines(log, 2)) == [odd + "\n", "[rank1]: after\n"]


def test_block_by_block_and_line_by_line_say_the_same():
    """A doubled prefix, torchrun's own lines, its report: the line path's rules, whatever the block sizes."""
    lines = ["[rank0]: [rank0]: warning", "[rank0]: step 1", "W1125 10:00:00.000 123 torch/distributed/elastic/x.py] "
             "failed", "[rank1]: still here", "Root Cause"]
    whole, single = live(), live()
    block = whole.take_block(text(lines), at=1.0)
    shown = [line for line, show in map(single.take, lines) if show]
    assert block.shown == text(shown) == "[rank0]: warning\n[rank0]: step 1\n[rank1]: still here\n"
    assert block.logged == text(["[rank0]: warning", *lines[1:]])


def test_a_peers_consequent_traceback_is_held_back_and_the_root_cause_shown():
    """In either order: the rank that raised its own error is shown, the one that lost its peer is held."""
    for first, second in ((0, 1), (1, 0)):
        node = live()
        own = traceback(first, "ValueError: bad batch")
        consequent = traceback(second, GLOO_PEER_GONE)
        shown = node.take_block(text(own + consequent + [f"[rank{second}]: terminate called"]), at=1.0).shown
        assert shown == text(own), shown
        assert (node.cascade.held, node.cascade.held_from) == (5, {second})


def test_the_same_traceback_of_another_rank_is_shown_once_whichever_node_says_it():
    shown: dict[tuple[str, ...], int] = {}
    first, second = live(0), live(1)
    first.cascade.shown = second.cascade.shown = shown
    error = "RuntimeError: nccl2 requires at least one CUDA device"
    assert first.take_block(text(traceback(0, error)), at=1.0).shown == text(traceback(0, error))
    assert second.take_block(text([*traceback(1, error), "[rank1]: after"]), at=1.0).shown == "[rank1]: after\n"
    assert second.cascade.alike == {1: 0} and second.cascade.held == 0, "not a consequence: a rank that failed alike"
    assert alike_words({rank: 0 for rank in range(1, 16384)} | {9: 3}, "harness logs r") == [
        "ranks 1-8,10-16383 failed with the same traceback as rank 0, held back from this terminal: `harness logs r "
        "--rank 1-8,10-16383`",
        "rank 9 failed with the same traceback as rank 3, held back from this terminal: `harness logs r --rank 9`"]
    other = traceback(1, "ValueError: its own")
    assert second.take_block(text(other), at=2.0).shown == text(other), "another traceback is shown"


def test_a_traceback_split_across_blocks_waits_for_its_exception_line():
    node = live()
    lines = traceback(1, "KeyError: 'x'")
    assert node.take_block(text(lines[:2]), at=1.0).shown == ""
    assert node.take_block(text(["[rank0]: step 3"]), at=1.1).shown == "[rank0]: step 3\n"
    assert node.take_block(text(lines[2:]), at=1.2).shown == text(lines)


def test_a_traceback_cut_short_by_the_nodes_end_is_shown_at_the_end():
    node = live()
    lines = traceback(1, "")[:2]
    assert node.take_block(text(lines), at=1.0).shown == ""
    assert node.release().shown == text(lines)


def test_once_another_node_failed_its_ranks_own_lines_are_shown_and_the_consequences_held():
    """The ranks' last step and checkpoint lines are the job's (the next attempt resumes from that checkpoint); what
    torchrun and torch say of the failure, and a rank's traceback that a peer went away, are held back."""
    node = live(1)
    node.held_all = True
    lines = ["[rank2]: step 9", "[rank2]: checkpoint: 9 steps saved in 0.1 s just in time",
             "[rank3]:[W1128 10:00:01.000000000 ProcessGroupGloo.cpp:100] Warning: a peer is gone",
             "[rank3]: Traceback (most recent call last):", '[rank3]:   File "t.py", line 3, in <module>',
             "[rank3]: RuntimeError: Connection closed by peer [127.0.0.1]:1234",
             "W1128 10:00:01.000 1 torch/distributed/elastic/agent/server/api.py:704] Received 15 death signal"]
    block = node.take_block(text(lines), at=1.0)
    assert block.shown == text(lines[:2]) and node.cascade.held == 4, block.shown  # torchrun's report: log only


def test_a_c10d_stores_info_line_and_its_exception_dump_stay_out_of_the_stream():
    """torchrun's own store with --rdzv-backend c10d: an INFO line that begins an exception dump."""
    lines = ["[I1125 17:10:49.112694679 TCPStoreLibUvBackend.cpp:1266] [c10d] Failed to bind to ipv6 address, "
             "trying ipv4.",
             "Exception raised from makeWithPort at /pytorch/torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp:313 "
             "(most recent call first):",
             "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f58 in libc10.so)",
             "<omitting python frames>", "frame #38: _start + 0x21 (0x559b in /venv/bin/python3)", "",
             "[rank0]: sum 4.0"]
    block = live().take_block(text(lines), at=1.0, quiet_cpp_info=True)
    assert block.shown == "[rank0]: sum 4.0\n"
    assert block.logged == text(lines)


def test_the_rank_hooks_worker_server_never_reaches_the_stream_whatever_the_log_level():
    """Its lines as torch 2.11 and 2.15 print them: listening once the process group exists, then at the rank's end
    (its destructor), with or without torch's rank prefix; one behind a progress bar's carriage return."""
    server = "[W1126 16:16:13.906053331 WorkerServer.cpp:{}] [c10d] {}"
    lines = ["[rank0]: 10%|#  | 1/10\r" + server.format(150, "Server listening to UNIX /tmp/harness-agent-7-8-x/0.sock"),
             "[rank0]: [rank0]:" + server.format(188, "WorkerServer destructor called without shutdown"),
             "[rank0]: step 3", "[rank0]: " + server.format(181, "Server shutting down"),
             "[rank0]: " + server.format(176, "Server exited")]
    for quiet in (True, False):
        node = live()
        block = node.take_block(text(lines), at=1.0, quiet_cpp_info=quiet)
        assert block.shown == block.streamed == "[rank0]: 10%|#  | 1/10\n[rank0]: step 3\n", block.shown
        assert block.logged.count("WorkerServer.cpp") == 4, "the node's log keeps them"
        assert list(node.tail) == ["[rank0]: 10%|#  | 1/10", "[rank0]: step 3"]
    assert live().take_block("[rank0]: " + server.format(188, "Server exited early") + "\n", 1.0).shown, \
        "only the server's own words are left out"


def test_the_stores_unnamed_clients_in_the_jobs_own_network_never_reach_the_stream():
    """In the simulated nodes' own network no name server answers the store's reverse lookup of each client
    (torch 2.15's words); another warning of the same file is the job's to see."""
    unnamed = ("[rank0]: [W1202 02:55:34.718929804 socket.cpp:207] [c10d] The hostname of the client socket cannot be "
               "retrieved. err=-3")
    block = live().take_block(f"{unnamed}\n[rank0]: step 1\n", at=1.0)
    assert block.shown == "[rank0]: step 1\n" and unnamed in block.logged
    other = "[rank0]: [W1202 02:55:34.718929804 socket.cpp:207] [c10d] The client socket has failed to connect"
    assert live().take_block(other + "\n", 1.0).shown == other + "\n"


class _Blocking(io.StringIO):
    """A terminal that hangs until released, as a paused SSH session does."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def write(self, text: str) -> int:
        self.release.wait()
        return super().write(text)


def test_a_stuck_terminal_still_leaves_out_what_it_cannot_take_and_says_so():
    out = _Blocking()
    terminal = Terminal(out, backlog_bytes=1000, window=0.01, collapse=True)
    terminal.say("started")
    for i in range(1000):
        terminal.job_lines(f"[node0] [rank0]: line {i}\n[node0] [rank1]: line {i}\n", 2)
    out.release.set()
    terminal.close()
    shown = out.getvalue().splitlines()
    missed = sum(int(re.search(r"(\d+) of its lines", line)[1]) for line in shown if "fell behind" in line)
    collapsed = [line for line in shown if line.startswith("[ranks 0,1]: line ")]
    assert collapsed and len(collapsed) == sum("line " in line for line in shown)
    assert missed + 2 * len(collapsed) == 2000  # a busy machine's writer may say so more than once


def test_a_stuck_terminal_never_holds_up_the_job_and_is_told_what_it_missed():
    out = _Blocking()
    terminal = Terminal(out, backlog_bytes=1000)
    terminal.say("started")
    began = time.monotonic()
    for i in range(1000):
        terminal.job_lines(f"[node0] [rank0]: line {i}\n", 1)
    # guard: the writer is held until after the loop, so a wait for it would hang; 1,000 lines take milliseconds
    assert time.monotonic() - began < 5, "the job's lines waited for the terminal"
    terminal.say("ended")
    out.release.set()
    terminal.close()
    shown = out.getvalue().splitlines()
    assert shown[0] == "harness: started" and "harness: ended" in shown
    missed = next(line for line in shown if "fell behind" in line)
    assert int(re.search(r"(\d+) of its lines", missed)[1]) + sum("line " in s for s in shown) == 1000


class _Chunks(AgentNode):
    """The agent link's parsing over given chunks of bytes (what a pipe or a channel delivers)."""

    def __init__(self, chunks: list[bytes]) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # no node: only the stream is read
        self.chunks = chunks

    def _chunks(self) -> Iterator[bytes]:
        yield from self.chunks

    def _send(self, data: bytes) -> None:
        raise AssertionError("nothing is sent")

    def _wait_agent(self) -> str:
        return ""

    def running(self) -> bool:
        return False

    def _agent_lost(self) -> None:
        pass


def test_the_agent_link_yields_whole_lines_and_takes_messages_from_the_middle_of_a_chunk():
    exit_line = message_line(Kind.NODE_EXIT, "0")
    health = message_line(Kind.HEALTH, '{"t": 1, "ranks": {}}')
    link = _Chunks([b"[rank0]: a\n[rank0]: b", b"c\n[rank1]: half ", health + b"line\n", exit_line + b"tail"])
    assert list(link.output()) == ["[rank0]: a\n", "[rank0]: bc\n", "[rank1]: half line\n", "tail\n"]
    assert link._exit_code == 0 and link.messages.get_nowait().kind is Kind.HEALTH


@pytest.mark.parametrize("meanwhile", [b"[rank1]: step 5\n", b""], ids=["a-line-meanwhile", "none"])
def test_a_link_made_again_is_said_once_when_its_node_is_live_again(meanwhile: bytes):
    """An SSH link made again (targets/ssh/backend.py): its agent's replay, then live lines. The terminal gets one
    line for it, with what came meanwhile (in the logs), even when nothing did; the replay's lines are not shown."""
    replay = message_line(Kind.UNWATCHED, json.dumps({"lost_at": 1.0, "bytes": 0, "dropped": 0, "from": 16})) + \
        meanwhile + message_line(Kind.WATCHED, json.dumps({"at": 16 + len(meanwhile)}))
    link = _Chunks([b"[rank1]: step 0\n", replay, b"[rank1]: step 10\n"])
    out = io.StringIO()
    terminal = Terminal(out)
    Output(terminal).pump(link, LiveNode(Node(host="h2", address="10.0.0.2", node_rank=1, nproc=1), started=0.0))
    terminal.close()
    lines = len(meanwhile.splitlines())
    assert out.getvalue().splitlines() == [
        "[node1] [rank1]: step 0",
        f"harness: node1 on h2: its link was lost and is made again; the {lines} line(s) it said meanwhile are in "
        "its logs, not shown here",
        "[node1] [rank1]: step 10"]
    assert link.position == 16 + len(meanwhile) + len(b"[rank1]: step 10\n")


def test_a_word_whose_argument_would_split_it_is_refused_and_so_is_a_stacks_request_not_of_harness_stacks(
        tmp_path: Path):
    """`STACKS x\nKILL` would reach the agent as two words; a request file named so, left in a writable run
    directory, would have every node killed."""
    assert parse_word(word_line(Word.STACKS, "20261128-020000-ab12")) == (Word.STACKS, "20261128-020000-ab12")
    for argument in ("x\nKILL", "x\rKILL", "x\x00"):
        with pytest.raises(ValueError, match="no control character"):
            word_line(Word.STACKS, argument)
    run = RunDir(tmp_path / "r")
    run.stacks.mkdir(parents=True)
    (run.stacks / "request-x\nKILL").touch()
    asked: list[str] = []
    capture = StackCapture([(SimpleNamespace(request_stacks=asked.append), SimpleNamespace(outcome=None, node=Node(
        host="h1", address="10.0.0.1", node_rank=0, nproc=1)))])  # type: ignore[list-item]
    capture.answer_requests(run)
    assert asked == [] and list(run.stacks.iterdir()) == [], "a request not named as harness stacks names it"


def test_harness_logs_merges_the_record_in_time_order_and_filters_it(tmp_path: Path):
    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    record = StreamRecord(run.stream)
    record.harness("harness: started\n")
    with record.open_node(0, 0) as node0, record.open_node(0, 1) as node1:
        node0.write(f"{stamp(time.time())} [node0] [rank0]: step 1\n")
        node1.write(f"{stamp(time.time())} [node1] [rank1]: step 1 Error\n")
        node0.write(f"{stamp(time.time())} [node0] [rank0]: done\n")
    record.close()

    def logs(**chosen: object) -> str:
        out = io.StringIO()
        print_logs(run, Selection(**chosen), out)  # type: ignore[arg-type]
        return out.getvalue()

    assert logs() == "harness: started\n[node0] [rank0]: step 1\n[node1] [rank1]: step 1 Error\n[node0] [rank0]: done\n"
    assert logs(ranks=frozenset({1})) == logs(node=1) == "[node1] [rank1]: step 1 Error\n"
    assert logs(grep=re.compile("step"), ranks=frozenset({0})) == "[node0] [rank0]: step 1\n"
    assert logs(since=stamp(time.time() + 60)) == ""
    timed = logs(timestamps=True).splitlines()
    assert [line[:STAMP_WIDTH] for line in timed] == sorted(line[:STAMP_WIDTH] for line in timed)


def test_harness_logs_filters_that_match_nothing_say_so_and_a_rank_or_node_the_run_never_had_is_refused(
        tmp_path: Path):
    run = create_run_dir(tmp_path / "runs", "job-two")
    run.write_state(RunState(run_id="job-two", name="job", mode="local", status=RunStatus.SUCCEEDED, started_at=1.0,
                             nnodes=2, world_size=2, controller=ControllerId(1, 1), hosts=["sim0", "sim1"]))
    run.plan_json().write_text(json.dumps({"nodes": [{"node_rank": 0, "ranks": [0]}, {"node_rank": 1, "ranks": [1]}]}))
    record = StreamRecord(run.stream)
    with record.open_node(0, 0) as node0, record.open_node(0, 1) as node1:
        node0.write(f"{stamp(time.time() - 600)} [node0] [rank0]: step 1\n")
        node1.write(f"{stamp(time.time() - 600)} [node1] [rank1]: step 1\n")
    record.close()
    runs = ("--runs-dir", str(tmp_path / "runs"))
    seven = harness("logs", "job-two", "--rank", "7", *runs)
    assert (seven.returncode, seven.stdout) == (2, "")
    assert seven.stderr == "harness: error: run job-two has no rank 7: its ranks are 0-1\n"
    assert harness("logs", "job-two", "--node", "3", *runs).stderr.endswith("has no node3: its nodes are node0-1\n")
    named = harness("logs", "job-two", "--node", "node1", *runs)
    assert (named.returncode, named.stdout) == (0, "[node1] [rank1]: step 1\n"), named.stderr
    both = harness("logs", "job-two", "--rank", "0-1", *runs)  # ranges, as the harness itself names ranks
    assert both.stdout.count("step 1\n") == 2, both.stderr
    assert "expected ranks such as 3, 0,2,5 or 0-7,12, got '1-'" in harness("logs", "job-two", "--rank", "1-", *runs).stderr
    recent = harness("logs", "job-two", "--since", "30s", "--rank", "0", *runs)
    assert (recent.returncode, recent.stdout) == (0, "")
    assert re.fullmatch(r"harness: no line of run job-two matches --rank 0 --since \(after \S+Z\)\n", recent.stderr)


def test_harness_logs_into_a_pipe_closed_early_is_a_normal_end(tmp_path: Path):
    """`harness logs RUN | head -1`: no BrokenPipeError traceback, exit 0."""
    run = create_run_dir(tmp_path / "runs", "job-long")
    run.write_state(RunState(run_id="job-long", name="job", mode="local", status=RunStatus.SUCCEEDED, started_at=1.0,
                             nnodes=1, world_size=1, controller=ControllerId(1, 1), hosts=["sim0"]))
    record = StreamRecord(run.stream)
    with record.open_node(0, 0) as node0:
        node0.write("".join(f"{stamp(time.time())} [node0] [rank0]: step {i}\n" for i in range(100_000)))
    record.close()
    logs = subprocess.Popen([sys.executable, "-m", "harness.cli", "logs", "job-long", "--runs-dir", str(tmp_path / "runs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert logs.stdout is not None and logs.stdout.readline() == "[node0] [rank0]: step 0\n"
    logs.stdout.close()  # as head does after its line
    assert logs.wait(timeout=60) == 0 and logs.communicate()[1] == ""


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("5m", 300), ("1h30m", 5400), ("2d", 172800)])
def test_durations(text: str, seconds: float):
    assert duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5x", "m5", "1h 30m", "-5m"])
def test_a_duration_that_is_none_is_refused(text: str):
    with pytest.raises(ValueError, match="expected a duration such as 90s"):
        duration(text)
