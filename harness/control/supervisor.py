"""Supervise the nodes of one attempt, whatever runs them: the first failure (or a stop request) stops
every node. The supervisor only wires its parts together, each in a module of its own: the one stream
and the node logs (output.py), stopping (stopper.py), the health loop (health_loop.py, judged by
harness.health) and the ranks' stacks (stack_capture.py); its threads route what each node says to them."""

from __future__ import annotations

import contextlib
import functools
import queue
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.control.cascade import Cascade, alike_words
from harness.control.health_loop import HealthLoop
from harness.control.live import LiveNode
from harness.control.output import Output, Streams
from harness.control.stack_capture import StackCapture
from harness.control.stopper import Stopper
from harness.control.terminal import Terminal
from harness.health.judge import HealthJudge
from harness.health.rank_stack import ranks_text
from harness.health.rendezvous import RendezvousVerdict
from harness.health.slowdown import SlowPolicy
from harness.health.verdict import Verdict
from harness.node.protocol import Kind, Message, ResultChunks, number_ranges, parse_arrivals, parse_health, parse_oom
from harness.plan.planner import Node, NodePlan
from harness.record.rundir import RunDir
from harness.record.schema import HealthEvent
from harness.record.stream import StreamRecord
from harness.spec.progress import LinePatterns
from harness.targets.base import NodeProcess, Outcome

# What _reap puts on a node's messages once it has ended, after all it said. One listener takes every node's
# messages (_listen), waiting for the next one and spending nothing while the nodes are quiet (at 2,048 nodes, a
# poll of each every 50 ms woke an idle controller 41,000 times a second; then a listener thread per node woke
# a thousand times a second and was half of the controller's threads); it ends once every node's HEARD_ALL came.
HEARD_ALL = Message(Kind.NODE_EXIT, "the node ended")
# How long the end of an attempt waits for its nodes' last output: their failure is judged from it (torchrun's
# report comes last), and a loaded machine can keep a reader thread seconds behind its node.
DRAIN_SECONDS = 10.0



def store_words(node: NodePlan, why_open: str) -> str:
    """What the agent that hosts the job's store found it could do (Kind.STORE): who can reach the store."""
    where = f"the job's rendezvous store on {node.host}:{node.store_port}"
    anyone = (f"every machine that reaches {node.host}:{node.store_port} can reach it: torch's store has no "
              f"authentication (docs/security.md)")
    if why_open:
        return f"{where} is open to every user of {node.host} ({why_open}), and {anyone}"
    return f"{where} admits no other user of {node.host} (an iptables rule while its node runs); {anyone}"


Heard = queue.Queue[tuple[NodeProcess, LiveNode, Message]]  # every node's messages, with the node that said each


class _Heard:
    """A node's messages, routed to the supervisor's one listener with the node they came from."""

    def __init__(self, process: NodeProcess, live: LiveNode, heard: Heard) -> None:
        self.process, self.live, self.heard = process, live, heard

    def put(self, item: Message, /) -> None:
        self.heard.put((self.process, self.live, item))


def heard_as(process: NodeProcess, live: LiveNode, heard: Heard) -> _Heard:
    """process's messages from now on to heard, those it said before (a standby's, a node taken back) first."""
    routed = _Heard(process, live, heard)
    if isinstance(process.messages, queue.Queue):
        with contextlib.suppress(queue.Empty):
            while True:
                routed.put(process.messages.get_nowait())
    return routed


class Supervisor:
    """grace: SIGTERM-to-SIGKILL seconds; terminal: the user's; log_file: where each node's lines go (None:
    nowhere); record: the run's timed record of its stream (None: none); quiet_cpp_info: torch's C++ INFO
    lines are the harness's own watch, so they go to the log only; progress: the job's step lines.
    judge: what judges hangs and slow ranks (None: off); run: where stacks, the health file and
    `harness stacks` requests live; attempt: this attempt's number; furthest: the furthest step of the run's
    earlier attempts (None: none); checkpoint: the job's lines that say a checkpoint was saved; rendezvous: the
    seconds every node has to start its ranks (timeouts.rendezvous; None: no deadline); slow_policy: what a lasting
    slowness is weighed against (None: it is not weighed)."""

    def __init__(self, grace: float, terminal: Terminal, log_file: Callable[[Node], Path] | None = None,
                 quiet_cpp_info: bool = False, judge: HealthJudge | None = None, run: RunDir | None = None,
                 attempt: int = 0, record: StreamRecord | None = None, progress: LinePatterns | None = None,
                 furthest: int | None = None, checkpoint: re.Pattern[str] | None = None,
                 rendezvous: float | None = None, slow_policy: SlowPolicy | None = None) -> None:
        self.output = Output(terminal, log_file, record, attempt, quiet_cpp_info, progress, checkpoint)
        self._started: list[tuple[NodeProcess, LiveNode]] = []  # every started node, what stops and asks it
        self.stopper = Stopper(grace, self._started)
        self.stacks = StackCapture(self._started)
        self.nodes: list[LiveNode] = []
        self.health_loop = HealthLoop(judge, run, attempt, self.nodes, self.stacks, self.output, self.stopper,
                                      furthest, rendezvous, slow_policy)
        self.first_failure: LiveNode | None = None
        self._ended: queue.Queue[LiveNode] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._streams: Streams | None = None  # reads every node a selector can wait on (control/output.py's Streams)
        self._pumped: list[threading.Event] = []  # set as each of those nodes' output is all worked on
        self._heard: Heard = queue.Queue()  # every node's messages, for the one listener (_listen)

    @property
    def processes(self) -> list[NodeProcess]:
        return [process for process, _ in self._started]

    @property
    def hang(self) -> Verdict | None:
        return self.health_loop.hang

    @property
    def hang_at(self) -> float | None:
        return self.health_loop.hang_at

    @property
    def slow_out(self) -> HealthEvent | None:
        """The weighing that stopped the job to restart it without a slow rank's host."""
        return self.health_loop.slow_out

    @property
    def unjoined(self) -> RendezvousVerdict | None:
        """The rendezvous did not complete in time: the nodes that never started their ranks."""
        return self.health_loop.unjoined

    @property
    def stopping_since(self) -> float | None:
        """When the supervisor began stopping the nodes (a failure, a hang or a request)."""
        return self.stopper.since

    def say(self, message: str) -> None:
        self.output.say(message)

    def start(self, processes: list[NodeProcess], started: float | None = None) -> None:
        """started: when the nodes started (None: now; earlier for nodes taken back)."""
        shown: dict[tuple[str, ...], int] = {}  # the tracebacks shown, whichever node showed them
        at = started or time.time()
        self._started += [(process, LiveNode(process.node, started=at, cascade=Cascade(shown=shown)))
                          for process in processes]
        self.nodes += [live for _, live in self._started]  # every node known before any can end (_reap counts)
        for process, live in self._started:
            process.messages = heard_as(process, live, self._heard)
        self._spawn(self._listen, len(self._started))
        # A node's end follows its output's (its agent's stdout closes as it exits; an SSH channel, a pod's link as
        # they end): each node is waited for once its output ended, on a thread of its own from then, not on a thread
        # per node the whole run (2,048 of them at 2,048 nodes, waiting).
        for process, live in self._started:
            if process.readable() is None:
                self._spawn(self._pump_then_reap, process, live)
            else:
                self._streams = self._streams or Streams(self.say)
                self._pumped.append(self._streams.add(process, self.output.steps(process, live),
                                                      functools.partial(self._spawn, self._reap, process, live)))
        if self.health_loop.judge is not None or self.health_loop.run is not None:
            self._spawn(self.health_loop.loop)

    def _listen(self, nodes: int) -> None:
        """The agents' messages: health samples and arrivals to the judge, stacks to whoever asked, OOM kills
        to the node; each one every node said before its end (HEARD_ALL)."""
        judge = self.health_loop.judge
        results: dict[int, ResultChunks] = {}
        while nodes:
            process, live, message = self._heard.get()
            if message is HEARD_ALL:
                nodes -= 1
                continue
            try:
                if message.kind is Kind.HEALTH and judge is not None:
                    health = parse_health(message.body)
                    judge.observe(live.node, health.t, health.samples)
                elif message.kind is Kind.ARRIVALS and judge is not None:
                    judge.arrived(live.node, message.received or time.time(), parse_arrivals(message.body))
                elif message.kind in (Kind.STACKS, Kind.STACKS_DONE):
                    self.stacks.take(live, message)
                elif message.kind is Kind.OOM:
                    live.oom.update(parse_oom(message.body))
                elif message.kind is Kind.STARTED and live.ranks_at is None:
                    live.ranks_at = time.time()
                elif message.kind is Kind.STORE:
                    self.say(store_words(process.node, message.body))
                elif message.kind is Kind.RESULT and \
                        (result := results.setdefault(live.node.node_rank, ResultChunks()).take(message.body)):
                    self._keep_result(*result)
            except (ValueError, KeyError, TypeError):  # a damaged message is one lost sample, not a crash
                continue

    def _keep_result(self, rank: int, result: bytes) -> None:
        if self.health_loop.run is None:
            return
        try:
            self.health_loop.run.write_result(self.health_loop.attempt, rank, result)
        except OSError as exc:
            self.say(f"rank {rank}'s result could not be kept in {self.health_loop.run.path}: {exc.strerror or exc}")

    def _pump_then_reap(self, process: NodeProcess, live: LiveNode) -> None:
        try:
            self.output.pump(process, live)
        finally:
            self._reap(process, live)

    def _reap(self, process: NodeProcess, live: LiveNode) -> None:
        outcome = process.wait()
        live.ended = time.time()
        live.outcome = outcome
        process.messages.put(HEARD_ALL)
        self.stacks.node_ended()
        if all(node.outcome is not None for node in self.nodes):
            self.health_loop.ended.set()
        self._ended.put(live)

    def wait(self, stop_requested: threading.Event) -> None:
        """Until every node has ended; the first failure or a stop request stops the rest."""
        pending = len(self.nodes)
        stopping = False
        while pending:
            if stop_requested.is_set() and not stopping:
                self.say("stop requested: stopping every node")
                self.stop_all()
                stopping = True
            try:
                live = self._ended.get(timeout=0.1)
            except queue.Empty:
                continue
            pending -= 1
            assert live.outcome is not None
            if not live.outcome.ok and self.first_failure is None and self.stopping_since is None:
                self.first_failure = live
                for other in self.nodes:  # what the others say now follows from this failure
                    other.held_all = other is not live
                # The failing rank's own code, as the report and `harness status` give it (torchrun's is 1).
                cause = live.root_cause()
                how = f"rank {cause.rank} {Outcome.from_returncode(cause.exit_code).describe()}" \
                    if cause.rank is not None and cause.exit_code is not None else live.outcome.describe()
                self.say(f"{live.node.label} on {live.node.host} failed ({how}); stopping the other nodes")
                self.stop_all()
                stopping = True

    def stop_all(self) -> None:
        self.stopper.stop_all()

    def finish(self) -> None:
        """Every node has ended: sweep stragglers (orphaned workers), drain output threads, and say what
        was held back from the terminal."""
        self.stopper.sweep()
        deadline = time.monotonic() + DRAIN_SECONDS
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for pumped in self._pumped:
            pumped.wait(timeout=max(0.0, deadline - time.monotonic()))
        if self._streams is not None:
            self._streams.close(timeout=max(0.0, deadline - time.monotonic()))
        held = sum(live.cascade.held for live in self.nodes)
        if held:
            ranks = sorted(set().union(*(live.cascade.held_from for live in self.nodes)))
            whose = f"of {ranks_text(ranks)} " if ranks else ""
            self.say(f"{held} line(s) {whose}held back from this terminal: they follow from the first failure (a "
                     f"peer that went away); see them with `{self.output.terminal.logs_command}"
                     + (f" --rank {number_ranges(ranks)}`" if ranks else "`"))
        alike = {rank: first for live in self.nodes for rank, first in live.cascade.alike.items()}
        for words in alike_words(alike, self.output.terminal.logs_command):
            self.say(words)

    def _spawn(self, target: Callable[..., Any], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)
