"""Stand-in nodes for measuring one controller at thousands of nodes (bench/scale.py): many nodes served by one
process, each speaking the node agent's protocol (harness.node.protocol) over a socket of its own, so that what is
measured is the controller exactly as it runs -- its stream, record, health loop, judge and stacks capture -- and
not 2,048 agents and 16,384 ranks sharing two cores.

`python -m testbed.fleet JOB.yaml` is `harness launch JOB.yaml` with the simulated nodes' agents replaced by the
fleet: the same controller (harness.control.controller.launch) on a LocalBackend whose nodes are FleetNodes. Each
FleetNode connects to the fleet (`python -m testbed.fleet serve SOCKET`, started with the first attempt) and sends
what a real agent is sent: a header naming its node, then its program line (the agent and the node's command, as
harness.targets.agent_link.agent_program makes it), then the controller's words. The fleet reads the program's
arguments as the agent would -- its sample interval (`watch`) and the node's command, whose stand-in rank arguments
(testbed/standin/rank.py: --steps, --step-seconds, --busy-ms, --warning, --hang-rank, --hang-step) say what the
ranks do -- and answers as an agent whose ranks run that script would: STARTED, every rank's progress lines (each
step's identical ones said once, where its agent would: protocol.RankLines), health samples and arrivals every
interval (with its clock's offset from the controller's pings), every rank's stacks and collectives on a STACKS word,
NODE_EXIT at the end or on TERM/KILL. The ranks' steps begin once every node has
started (a step's all_reduce needs every rank); a hung rank stops before its step's collective, and its peers wait
in it.
"""

from __future__ import annotations

import ast
import contextlib
import heapq
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.node.collectives import ArrivalsDigest
from harness.node.protocol import (
    Arrival,
    ControllerClock,
    Kind,
    RankLines,
    RankSample,
    Word,
    alike_answers,
    arrivals_bodies,
    health_bodies,
    message_line,
    parse_word,
    sample_interval,
    stacks_bodies,
)
from harness.node.ranks import ProgressWatch
from harness.plan.planner import NodePlan
from harness.targets.agent_link import READ_BYTES, AgentNode
from harness.targets.local.backend import LocalBackend

RANK_SCRIPT = "testbed/standin/rank.py"  # where the stand-in ranks' frames say they are
WARNING = "UserWarning: this stand-in rank's library is deprecated and prints it on every rank"
TORCH_WAIT = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"
KEPT_ENTRIES = 4  # collectives a rank's Flight Recorder answer holds
IO_PER_STEP = 4096  # bytes a rank's all_reduce moves (its I/O counter, which the judge reads as progress)


def _flag(command: str, name: str, default: str) -> str:
    found = re.search(rf"(?:^|\s)--{name}\s+'?([^\s']+)", command)
    return found.group(1) if found else default


class Job:
    """What the stand-in ranks do, read from a node's command line as rank.py reads its arguments."""

    def __init__(self, command: str) -> None:
        self.steps = int(_flag(command, "steps", "100"))
        self.step_seconds = float(_flag(command, "step-seconds", "0.5"))
        self.busy = float(_flag(command, "busy-ms", "1.0")) / 1000
        self.warning = re.search(r"(?:^|\s)--warning\b", command) is not None
        self.hang_rank = int(_flag(command, "hang-rank", "-1"))
        self.hang_step = int(_flag(command, "hang-step", "-1"))


class StandInNode:
    """One node of the fleet: its ranks' course, computed from the job's start (t0) and the clock."""

    def __init__(self, link: socket.socket, header: dict[str, Any], index: int) -> None:
        self.link, self.index = link, index
        self.node_rank, self.ranks, self.world = int(header["node"]), list(header["ranks"]), int(header["world"])
        self.incoming = b""
        self.program_read = False
        self.job: Job | None = None
        self.watch = 0.0
        self.collapse = 0.0  # as its agent would hold its ranks' lines (protocol.RankLines; 0: not at all)
        self.started_at = time.time()
        self.arrived = dict.fromkeys(self.ranks, 0)  # the last collective each rank's arrivals said
        self.digest = ArrivalsDigest()  # as an agent says them: a collective once every rank arrived
        self.progress_watch = ProgressWatch()  # as an agent judges its ranks' progress
        self.said_step = 0  # the last step whose lines were sent
        self.ended = False
        self.clock = ControllerClock()  # as an agent keeps it, from the controller's pings

    def boot(self, program_line: bytes) -> None:
        """The agent's arguments from its program line (agent_link.agent_program): watch and the node's command."""
        program = ast.literal_eval(program_line.decode().strip()[len("exec("):-1])
        argv = ast.literal_eval(re.search(r"^ARGV = (.*)$", program, re.M).group(1))  # type: ignore[union-attr]
        self.watch, self.job = float(argv[6]), Job(argv[7])
        self.collapse = float(argv[14])
        self.program_read = True

    def send(self, kind: Kind, body: str) -> None:
        self.say(message_line(kind, body))

    def say(self, data: bytes) -> None:
        if not self.ended:
            try:
                self.link.sendall(data)
            except OSError:
                self.ended = True

    def hangs(self, rank: int) -> bool:
        assert self.job is not None
        return rank == self.job.hang_rank and self.job.hang_step > 0

    def completed(self, rank: int, t0: float | None, now: float) -> int:
        """Collectives (= steps) the rank completed by now: none before the job's start; none past a hang's step -1
        for anyone (its peers wait in the hang's collective)."""
        assert self.job is not None
        if t0 is None:
            return 0
        done = min(self.job.steps, max(0, int((now - t0) / self.job.step_seconds)))
        return min(done, self.job.hang_step - 1) if self.job.hang_step > 0 else done

    def enqueued(self, rank: int, t0: float | None, now: float) -> int:
        """The last collective the rank enqueued: the one it waits in, past a hang (but the hung rank's)."""
        assert self.job is not None
        done = self.completed(rank, t0, now)
        if t0 is None or self.job.hang_step <= 0 or self.hangs(rank):
            return done
        return self.job.hang_step if now - t0 >= self.job.hang_step * self.job.step_seconds else done

    def sample(self, t0: float | None, now: float) -> None:
        """One health sample of every rank, and their arrivals since the last."""
        assert self.job is not None
        samples = {}
        for rank in self.ranks:
            done, waiting = self.completed(rank, t0, now), self.enqueued(rank, t0, now)
            pending = now - self._enqueued_at(waiting, t0) if waiting > done and t0 is not None else -1.0
            samples[rank] = RankSample(100_000 + rank, "S", 0.05 + done * self.job.busy, done * self.job.busy,
                                       done * IO_PER_STEP, done, pending)
        for body in health_bodies(now, self.progress_watch.judged(now, samples)):
            self.send(Kind.HEALTH, body)
        arrived: dict[int, list[Arrival]] = {}
        for rank in self.ranks:
            last = self.enqueued(rank, t0, now)
            if last > self.arrived[rank] and t0 is not None:
                arrived[rank] = [Arrival("0", seq, int(self._enqueued_at(seq, t0) * 1e9))
                                 for seq in range(self.arrived[rank] + 1, last + 1)]
                self.arrived[rank] = last
        for body in arrivals_bodies(now, self.digest.add(self.ranks, arrived, time.time_ns()), self.clock.ahead()):
            self.send(Kind.ARRIVALS, body)

    def _enqueued_at(self, seq: int, t0: float | None) -> float:
        assert self.job is not None and t0 is not None
        return t0 + seq * self.job.step_seconds - self.job.step_seconds / 2

    def lines(self, t0: float, now: float) -> None:
        """Every rank's progress line of each step completed since the last said."""
        assert self.job is not None
        text = []
        for step in range(self.said_step + 1, self.completed(0, t0, now) + 1):
            text += [f"[rank{rank}]: epoch 1/1 step {step}/{self.job.steps} loss {1 / step:.4f}\n"
                     for rank in self.ranks]
            self.said_step = step
        if text:
            said = "".join(text).encode()
            if self.collapse > 0:  # the lines of a step come together: what the agent holds, it says as one
                held = RankLines(self.collapse)
                said = held.take(said, now) + held.flush()
            self.say(said)

    def stacks(self, tag: str, t0: float | None, now: float) -> None:
        """Every rank's answer as the agent gives it (harness.node.observer): its main thread, its collectives."""
        assert self.job is not None
        answers = {}
        for rank in self.ranks:
            done, waiting = self.completed(rank, t0, now), self.enqueued(rank, t0, now)
            if self.hangs(rank) and self.job.hang_step > 0 and done >= self.job.hang_step - 1:
                frames = [{"name": "fetch_batch", "file": RANK_SCRIPT, "line": 21, "code": "time.sleep(3600)"},
                          {"name": "main", "file": RANK_SCRIPT, "line": 54, "code": "fetch_batch(step, hang, wait)"}]
            else:
                frames = [{"name": "all_reduce", "file": TORCH_WAIT, "line": 2501, "code": "work.wait()"},
                          {"name": "main", "file": RANK_SCRIPT, "line": 55, "code": "dist.all_reduce(total)"}]
            entries = [{"group": "0", "seq": seq, "op": "gloo:all_reduce", "done": seq <= done, "sizes": [[1]],
                        "created_ns": int(self._enqueued_at(seq, t0) * 1e9) if t0 is not None else 0}
                       for seq in range(max(1, waiting - KEPT_ENTRIES + 1), waiting + 1)]
            answers[rank] = {"pid": 100_000 + rank, "state": "S", "workers": [], "collectives": entries,
                             "threads": [{"name": "MainThread", "tid": 100_000 + rank, "active": False, "gil": False,
                                          "frames": frames}]}
        for rank, answer in alike_answers(answers).items():
            for body in stacks_bodies(tag, rank, answer):
                self.send(Kind.STACKS, body)
        self.send(Kind.STACKS_DONE, tag)

    def end(self, code: int) -> None:
        self.send(Kind.NODE_EXIT, str(code))
        self.ended = True
        with contextlib.suppress(OSError):
            self.link.shutdown(socket.SHUT_RDWR)


class Fleet:
    """Every stand-in node on one selector; the job's clock starts once the world's nodes have all started."""

    def __init__(self, address: str) -> None:
        self.selector = selectors.DefaultSelector()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(address)
        self.server.listen(4096)
        self.selector.register(self.server, selectors.EVENT_READ)
        self.nodes: list[StandInNode] = []
        self.due: list[tuple[float, int, int]] = []  # (when, node's index, what: 0 sample, 1 started) heap
        self.t0: float | None = None
        self.world = 0
        self.step_seconds = 0.0
        self.said_step = 0  # the last step whose lines every node sent
        self.joined = 0  # ranks whose node has started

    def serve(self) -> None:
        while True:
            now = time.time()
            wake = min([self.due[0][0]] if self.due else [now + 1.0])
            if self.t0 is not None and self.step_seconds:
                wake = min(wake, self.t0 + (self.said_step + 1) * self.step_seconds)
            for key, _ in self.selector.select(timeout=max(0.0, min(wake - now, 1.0))):
                if key.fileobj is self.server:
                    link, _ = self.server.accept()
                    self.selector.register(link, selectors.EVENT_READ, [b"", None])
                else:
                    self._read(key)
            self._tick(time.time())

    def _read(self, key: selectors.SelectorKey) -> None:
        link: socket.socket = key.fileobj  # type: ignore[assignment]
        state = key.data
        try:
            chunk = link.recv(READ_BYTES)
        except OSError:
            chunk = b""
        if not chunk:
            self.selector.unregister(link)
            link.close()
            if state[1] is not None:
                state[1].ended = True
            return
        state[0] += chunk
        while b"\n" in state[0]:
            line, _, state[0] = state[0].partition(b"\n")
            node = state[1]
            if node is None:
                state[1] = node = StandInNode(link, json.loads(line), len(self.nodes))
                self.nodes.append(node)
                self.world = node.world
            elif not node.program_read:
                node.boot(line)
                heapq.heappush(self.due, (time.time(), node.index, 1))
            else:
                self._obey(node, line)

    def _obey(self, node: StandInNode, line: bytes) -> None:
        word = parse_word(line)
        if word is None or node.ended:
            return
        if word[0] is Word.STACKS:
            node.stacks(word[1], self.t0, time.time())
        elif word[0] is Word.PING and word[1]:
            node.clock.heard(float(word[1]), time.time())
        elif word[0] in (Word.TERM, Word.KILL):
            node.end(-15 if word[0] is Word.TERM else -9)

    def _tick(self, now: float) -> None:
        while self.due and self.due[0][0] <= now:
            _, index, what = heapq.heappop(self.due)
            node = self.nodes[index]
            if node.ended:
                continue
            if what == 1:
                self._started(node, now)
            else:
                node.sample(self.t0, now)
            if node.watch > 0:
                every = sample_interval(node.watch, now - node.started_at, node.world // len(node.ranks))
                heapq.heappush(self.due, (now + every, index, 0))
        if self.t0 is None or now < self.t0 + (self.said_step + 1) * self.step_seconds:
            return
        self.said_step = int((now - self.t0) / self.step_seconds)
        for node in self.nodes:
            if not node.ended:
                node.lines(self.t0, now)
                if node.job is not None and node.said_step >= node.job.steps:
                    node.end(0)

    def _started(self, node: StandInNode, now: float) -> None:
        node.send(Kind.STARTED, ",".join(map(str, node.ranks)))
        assert node.job is not None
        if node.job.warning:
            node.say("".join(f"[rank{rank}]: {WARNING}\n" for rank in node.ranks).encode())
        self.joined += len(node.ranks)
        if self.t0 is None and self.joined >= self.world:
            self.t0, self.step_seconds = now, node.job.step_seconds


class FleetNode(AgentNode):
    """A node of the fleet, as the controller sees any agent: its stream in, its words out."""

    def __init__(self, node: NodePlan, address: str) -> None:
        super().__init__(node)
        self._link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._link.connect(address)
        header = {"node": node.node_rank, "ranks": list(node.ranks), "world": int(node.env["NNODES"]) * node.nproc}
        self._link.sendall(json.dumps(header).encode() + b"\n")

    def _chunks(self) -> Iterator[bytes]:
        while chunk := self._link.recv(READ_BYTES):
            yield chunk

    def readable(self) -> int | None:
        return self._link.fileno()

    def read_ready(self) -> bytes:
        return self._link.recv(READ_BYTES)

    def _send(self, data: bytes) -> None:
        self._link.sendall(data)

    def _wait_agent(self) -> str:
        self._output_done.wait()
        return "the stand-in node's link closed without its end"

    def running(self) -> bool:
        return not self._output_done.is_set()

    def _agent_lost(self) -> None:
        """Nothing runs behind a stand-in node."""


class FleetBackend(LocalBackend):
    """Simulated nodes whose agents are the fleet's stand-ins: no standbys (each would be a second node)."""

    def __init__(self) -> None:
        super().__init__(sys.executable)
        self._folder = tempfile.TemporaryDirectory(prefix="fleet-")
        self.address = str(Path(self._folder.name) / "fleet.sock")
        self._fleet: subprocess.Popen[bytes] | None = None

    def _agent(self, node: NodePlan) -> AgentNode:
        if self._fleet is None:
            self._fleet = subprocess.Popen([sys.executable, "-m", "testbed.fleet", "serve", self.address])
            while not os.path.exists(self.address):
                if self._fleet.poll() is not None:
                    raise OSError(f"the fleet ended at its start (exit {self._fleet.returncode})")
                time.sleep(0.05)
        return FleetNode(node, self.address)

    def stand_by(self, *args: Any, **kwargs: Any) -> None:
        """No standbys."""

    def stand_down(self) -> None:
        super().stand_down()
        if self._fleet is not None:
            self._fleet.kill()
            self._fleet.wait()
        self._folder.cleanup()


def launch(job: str) -> int:
    """`harness launch JOB` on the fleet, from this working directory (its runs/ folder)."""
    from harness.commands import open_files_as_allowed
    from harness.control import controller
    from harness.record.rundir import new_run_id, runs_root
    from harness.spec.job import load_job

    open_files_as_allowed()
    spec = load_job(job)
    return controller.launch(FleetBackend(), spec, Path(job).read_text(encoding="utf-8"), job, runs_root(),
                             new_run_id(spec.name))


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        Fleet(argv[1]).serve()
        return 0
    return launch(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
