"""The node agent's link while its controller is gone (harness.node.link): what the node says meanwhile is
kept with its times and replayed, in order and once, to the controller that takes it back; the controller's
end (targets/agent_link.AgentNode.output) gives it back as blocks with the times they were said. Real pipes
and a real control socket; the whole of it, with real agents, in tests/integration/test_launch_local.py."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.node.link import CONTROL, ControllerLink, Link
from harness.node.protocol import Kind, Word, escape_output, message_line, split_line, word_line
from harness.plan.planner import NodePlan
from harness.record.disk import RecordDisk
from harness.record.stream import LoggedMark, resume_point
from harness.targets.agent_link import AgentNode, ChildAgentNode, agent_argv, agent_env, agent_program

RUN = "link-test"


def read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


@pytest.fixture
def link(tmp_path: Path) -> Iterator[tuple[ControllerLink, int]]:
    """A ControllerLink whose first link is a pipe (its read end returned), in a private directory."""
    read_fd, write_fd = os.pipe()
    words_r, words_w = os.pipe()
    controller = ControllerLink(RUN, Link(words_r, write_fd), str(tmp_path))
    yield controller, read_fd
    controller.close()
    for fd in (read_fd, words_w):
        os.close(fd)


def attach(path: Path, run_id: str = RUN) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(str(path / CONTROL))
    sock.sendall(word_line(Word.ATTACH, run_id))
    return sock


def received_until(sock: socket.socket, end: bytes) -> list[bytes]:
    """The lines sock sends up to and with end."""
    sock.shutdown(socket.SHUT_WR)
    received = b""
    deadline = time.monotonic() + 30
    while end not in received and time.monotonic() < deadline:
        received += sock.recv(1 << 16)
    return received.splitlines(keepends=True)


def test_what_is_said_unwatched_is_replayed_once_in_order_with_its_times(link, tmp_path: Path) -> None:
    controller, read_fd = link
    controller.write(b"step 1\n")
    assert read_all(read_fd) == b"step 1\n"
    assert controller.current is not None
    controller.lose(controller.current)
    lost = controller.lost_at
    assert lost is not None
    controller.write(b"step 2\n")
    controller.write(message_line(Kind.NODE_EXIT, "0"))
    assert read_all(read_fd) == b"", "nothing more on the lost link"
    assert not controller.delivered()
    sock = attach(tmp_path)
    new = controller.await_controller(time.time() + 30)
    assert new is not None and controller.attach(new)
    controller.write(b"step 3\n")
    lines = received_until(sock, b"step 3\n")
    messages = [split_line(line)[1] for line in lines]
    assert messages[0] is not None and messages[0].kind is Kind.UNWATCHED
    header = json.loads(messages[0].body)
    assert header["lost_at"] == lost and header["dropped"] == 0 and header["bytes"] > len(b"step 2\n")
    assert header["from"] == len(b"step 1\n"), "the controller that does not say where its logs end: from the loss"
    at = float(messages[1].body) if messages[1] is not None and messages[1].kind is Kind.AT else None
    assert at is not None and lost - 0.001 <= at <= time.time(), messages[1]  # said to the millisecond
    stream = len(b"step 1\nstep 2\n" + message_line(Kind.NODE_EXIT, "0"))
    assert lines[2:] == [b"step 2\n", message_line(Kind.NODE_EXIT, "0"),
                         message_line(Kind.WATCHED, json.dumps({"at": stream})), b"step 3\n"]
    assert controller.delivered() and controller.lost_at is None
    assert not (tmp_path / "spool").exists(), "the spool is gone once replayed"
    sock.close()


def test_what_the_lost_controller_never_logged_is_sent_again_from_where_its_logs_end(link, tmp_path: Path) -> None:
    """The lost controller had read and logged `step 1`; `step 2` was in the pipe when it died: the new one, which
    says where the logs end, gets `step 2` from what the agent sent and kept, then the spool."""
    controller, read_fd = link
    controller.write(b"step 1\n")
    assert read_all(read_fd) == b"step 1\n"
    controller.write(b"step 2\n")  # in flight: never read
    assert controller.current is not None
    controller.lose(controller.current)
    controller.write(b"step 3\n")
    logged = len(b"step 1\n")
    sock = attach(tmp_path, f"{RUN} {logged}")
    new = controller.await_controller(time.time() + 30)
    assert new is not None and new.resume_from == logged and controller.attach(new)
    controller.write(b"step 4\n")
    lines = received_until(sock, b"step 4\n")
    assert json.loads(split_line(lines[0])[1].body)["from"] == logged  # type: ignore[union-attr]
    assert [line for line in lines[1:] if split_line(line)[1] is None] == [b"step 2\n", b"step 3\n", b"step 4\n"]
    sock.close()


def test_only_a_word_naming_the_run_is_taken_for_a_controller(link, tmp_path: Path) -> None:
    controller, _ = link
    assert controller.current is not None
    controller.lose(controller.current)
    for word in ("another-run", f"{RUN} 12x"):
        with attach(tmp_path, word) as wrong:
            assert wrong.recv(100) == b"", "closed without a word"
    assert controller.await_controller(time.time() + 0.5) is None


class Replayed(AgentNode):
    """An AgentNode over fixed bytes: the controller's end of a replay."""

    def __init__(self, *chunks: bytes) -> None:
        super().__init__(NodePlan(host="h", address="127.0.0.1", node_rank=0, nproc=1, argv=("true",), env={}))
        self._data = chunks

    def _chunks(self) -> Iterator[bytes]:
        yield from self._data

    def _send(self, data: bytes) -> None: ...

    def _wait_agent(self) -> str:
        return ""

    def running(self) -> bool:
        return False

    def _agent_lost(self) -> None: ...


def test_the_controller_gets_each_replayed_block_with_the_time_it_was_said_and_where_it_ends() -> None:
    """The replay's own words (UNWATCHED, AT, WATCHED) are not of the agent's stream: each block's end there is
    counted from UNWATCHED's `from` to WATCHED's `at`, then on."""
    header = json.dumps({"lost_at": 100.0, "bytes": 50, "dropped": 0, "from": 1000})
    node = Replayed(message_line(Kind.UNWATCHED, header) + b"a\n" + message_line(Kind.AT, "101.5") + b"b\nc\n"
                    + message_line(Kind.WATCHED, json.dumps({"at": 2000})) + b"live\n")
    blocks = []
    for text in node.output():
        blocks.append((text, node.said_at, node.position))
    assert blocks == [("a\n", 100.0, 1002), ("b\nc\n", 101.5, 1006), ("live\n", None, 2005)]
    assert node.unwatched == {"lost_at": 100.0, "bytes": 50.0, "dropped": 0.0, "from": 1000.0}
    assert node.replayed.is_set()


def test_a_block_ends_in_the_stream_before_a_worker_line_a_message_cut() -> None:
    """A message after a worker's unfinished line: the block's end is that line's start (it is not logged yet)."""
    first = b"one\ntw" + message_line(Kind.HEALTH, "{}")
    node = Replayed(first, b"o\n")
    blocks = [(text, node.position) for text in node.output()]
    assert blocks == [("one\n", len(b"one\n")), ("two\n", len(first + b"o\n"))]


def test_a_takeover_cuts_each_log_back_to_its_last_mark(tmp_path: Path) -> None:
    """What a lost controller wrote past its last mark is cut, so that the agent's stream, sent again from the
    mark's place, is logged once; a log the mark does not size (-1) is left whole."""
    logs = [tmp_path / "node0.log", tmp_path / "timed.log", tmp_path / "other.log"]
    for log in logs:
        log.write_text("kept\n")
    with LoggedMark(RecordDisk(tmp_path), tmp_path / "node0.logged", "node0's log mark") as mark:
        mark.write(12, [5, 5, None])
        mark.write(7, [5, 5, None])  # a shorter mark, in place: nothing of the longer one is left
    for log in logs:
        with log.open("a") as handle:
            handle.write("written past the mark\n")
    assert resume_point(tmp_path / "node0.logged", logs) == 7
    assert [log.read_text() for log in logs] == ["kept\n", "kept\n", "kept\nwritten past the mark\n"]
    assert resume_point(tmp_path / "missing.logged", logs) is None


class LocalAgent(ChildAgentNode):
    """A real node agent, a child of the test, as the local backend starts it."""

    def __init__(self, node: NodePlan) -> None:
        super().__init__(node, agent_argv(sys.executable, node), os.environ | agent_env(node))

    def _wait_agent(self) -> str:
        return self._child_ended()

    def _agent_lost(self) -> None: ...


def _agent_printing(output: bytes, code: int, nproc: int, folder: Path) -> LocalAgent:
    """A real agent started on a node of nproc ranks whose command prints output and exits with code."""
    script = f"import sys; sys.stdout.buffer.write({output!r}); sys.stdout.flush(); sys.exit({code})"
    node = NodePlan(host="h", address="127.0.0.1", node_rank=0, nproc=nproc, argv=(sys.executable, "-c", script),
                    env={"HARNESS_RUN_ID": "agent-test", "NODE_RANK": "0", "HARNESS_ATTEMPT": "0"},
                    workdir=str(folder))
    agent = LocalAgent(node)
    agent.boot(agent_program(node, grace=1, silence=60, watch=0))
    agent.talk()
    return agent


def test_a_rank_that_prints_the_agents_marker_forges_no_message(tmp_path: Path) -> None:
    """A rank prints, byte for byte, the agent's messages: its node's end (0), the end of a replay (an offset in
    the stream), an OOM kill, its ranks started; and an RS of its own at a line's end and before a US. A real
    agent passes it to the real parser: every byte of it is the node's output, the node's end is the agent's
    (3), no message came, and the stream's position is where the agent's stream ends."""
    forged = message_line(Kind.NODE_EXIT, "0") + b"step 1 " + message_line(Kind.WATCHED, json.dumps({"at": 10**9})) \
        + message_line(Kind.OOM, json.dumps({"0": "Out of memory: Killed process 1"})) \
        + message_line(Kind.STARTED, "0") + b"an RS at the end \x1e\n\x1e\x1f stays\n"
    agent = _agent_printing(forged, 3, nproc=1, folder=tmp_path)
    said = "".join(agent.output())
    assert said == forged.decode()
    assert agent.wait().exit_code == 3
    assert agent.messages.empty()
    assert agent.position == len(escape_output(forged) + message_line(Kind.NODE_EXIT, "3"))


def test_a_real_agent_says_its_ranks_identical_lines_once_and_all_it_held_before_the_nodes_end(tmp_path: Path) -> None:
    """A node of 8 ranks (a job above COLLAPSE_ABOVE): the agent holds its ranks' lines for their window and says
    the copies as one, torchrun's own line in its place; what it holds when the node ends comes before the end."""
    lines = b"".join(b"[rank%d]: UserWarning: deprecated\n" % rank for rank in range(8)) + b"torchrun's own\n" + \
        b"[rank3]: step 1\n[rank0]: step 1\n"
    agent = _agent_printing(lines, 0, nproc=8, folder=tmp_path)
    said = "".join(agent.output())
    assert said == "[ranks 0-7]: UserWarning: deprecated\ntorchrun's own\n[ranks 0,3]: step 1\n"
    assert agent.wait().exit_code == 0
