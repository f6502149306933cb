"""Supervise the nodes of one run, whatever runs them: stream logs, propagate failure, stop cleanly.

A failed node must not leave the survivors hanging in a collective until NCCL/gloo time out, so the
first failure stops every other node (SIGTERM, then SIGKILL after the grace period).
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from harness.plan.planner import Node
from harness.run import worker_output
from harness.run.health import SLOW_WINDOW, HealthWatch, RankStack, Verdict, hang_verdict, ranks_text
from harness.run.records import RunDir, write_text_atomic
from harness.targets.base import NodeProcess, Outcome

TAIL_LINES = 20
STACKS_SECONDS = 20.0  # how long the nodes have to answer for their ranks' stacks
WATCH_TICK = 0.5  # how often the supervisor judges the samples and looks for `harness stacks` requests
# torchrun's ChildFailedError report names the root-cause rank; use it when present.
ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)")
ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class NodeRecord:
    """One node of an attempt as the controller saw it: its lines, how and when it ended."""

    node: Node
    started: float
    ended: float | None = None
    outcome: Outcome | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=500))
    joined: set[int] = field(default_factory=set)  # ranks seen connecting to the rendezvous store
    torchrun_reporting: bool = False  # torchrun's failure report began: its lines stay in the log
    oom: dict[int, str] = field(default_factory=dict)  # rank -> the kernel's line: its OOM killer ended it

    def root_cause(self) -> tuple[int | None, int | None]:
        """(global rank, exit code) of the first failed worker, from torchrun's "Root Cause" report."""
        rank = code = None
        in_root_cause = False
        for line in self.tail:
            in_root_cause = in_root_cause or line.startswith("Root Cause")
            if not in_root_cause:
                continue
            if rank is None and (match := ROOT_CAUSE_RANK.match(line)):
                rank = int(match.group(1))
            elif rank is not None and code is None and (match := ROOT_CAUSE_EXIT.match(line)):
                code = int(match.group(1))
        return rank, code

    def take(self, raw: str, quiet_cpp_info: bool = False) -> tuple[str, bool]:
        """A line of the node's output as it is logged (one rank prefix), and whether the live stream
        shows it: not torch's C++ INFO lines when they are the harness's own watch (quiet_cpp_info), nor
        torchrun's ChildFailedError report, which repeats what the harness reports better. Notes which
        ranks joined the rendezvous store."""
        line = worker_output.normalize(raw)
        if worker_output.is_cpp_info(line):
            if (rank := worker_output.joined_rank(line)) is not None:
                self.joined.add(rank)
            if quiet_cpp_info:
                return line, False
        self.tail.append(line)
        self.torchrun_reporting = self.torchrun_reporting or worker_output.starts_torchrun_report(line)
        return line, not (self.torchrun_reporting and worker_output.rank_of(line) is None)

    def last_lines(self, rank: int | None, count: int = TAIL_LINES) -> list[str]:
        """The failing rank's own last lines say why; the node's tail is the fallback."""
        own = [line for line in self.tail if rank is not None and line.startswith(f"[rank{rank}]:")]
        return (own or list(self.tail))[-count:]


@dataclass
class Supervisor:
    """grace: SIGTERM-to-SIGKILL seconds; log_file: where each node's lines go (None: nowhere);
    quiet_cpp_info: torch's C++ INFO lines are the harness's own watch (plan.STORE_WATCH_ENV), so they
    go to the log only. health: the watch for hangs and slow ranks (None: off); run: where stacks,
    the health file and `harness stacks` requests live; attempt: this attempt's number."""

    grace: float
    out: IO[str] = sys.stdout
    log_file: Callable[[Node], Path] | None = None
    quiet_cpp_info: bool = False
    health: HealthWatch | None = None
    run: RunDir | None = None
    attempt: int = 0
    records: list[NodeRecord] = field(default_factory=list)
    first_failure: NodeRecord | None = None
    hang: Verdict | None = None  # the job hung: who it is about
    hang_at: float | None = None
    stopping_since: float | None = None  # when the supervisor began stopping the nodes (failure or request)
    _print_lock: threading.Lock = field(default_factory=threading.Lock)
    _events: queue.Queue[NodeRecord] = field(default_factory=queue.Queue)
    _threads: list[threading.Thread] = field(default_factory=list)
    _processes: list[NodeProcess] = field(default_factory=list)
    _answers: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # tag -> rank -> answer
    _answered: dict[str, set[int]] = field(default_factory=dict)  # tag -> node ranks done
    _answer_lock: threading.Condition = field(default_factory=threading.Condition)

    def start(self, processes: list[NodeProcess]) -> None:
        for process in processes:
            record = NodeRecord(process.node, started=time.time())
            self.records.append(record)
            self._spawn(self._pump, process, record)
            self._spawn(self._reap, process, record)
            self._spawn(self._listen, process, record)
        self._processes = list(processes)
        if self.health is not None or self.run is not None:
            self._spawn(self._watch)

    def _listen(self, process: NodeProcess, record: NodeRecord) -> None:
        """The agent's messages: health samples to the watch, stacks to whoever asked for them."""
        parts: dict[tuple[str, int], list[str]] = {}
        while record.outcome is None or not process.messages.empty():
            try:
                kind, rest = process.messages.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if kind == "health" and self.health is not None:
                    self.health.observe(record.node, json.loads(rest))
                elif kind == "stacks":
                    tag, rank, _, last, chunk = rest.split(" ", 4)
                    parts.setdefault((tag, int(rank)), []).append(chunk)
                    if last == "1":
                        with self._answer_lock:
                            answer = json.loads("".join(parts.pop((tag, int(rank)))))
                            self._answers.setdefault(tag, {})[int(rank)] = answer
                elif kind == "oom":
                    record.oom.update({int(rank): line for rank, line in json.loads(rest).items()})
                elif kind == "stacks-done":
                    with self._answer_lock:
                        self._answered.setdefault(rest, set()).add(record.node.node_rank)
                        self._answer_lock.notify_all()
            except (ValueError, KeyError, TypeError):  # a damaged message is one lost sample, not a crash
                continue

    def capture_stacks(self, tag: str, timeout: float = STACKS_SECONDS) -> dict[int, RankStack]:
        """Every running node's ranks' stacks, asked for at once; whatever arrived within timeout."""
        live = [(p, r) for p, r in zip(self._processes, self.records, strict=True) if r.outcome is None]
        for process, _ in live:
            process.request_stacks(tag)
        deadline = time.monotonic() + timeout
        nodes = {r.node.node_rank: r.node for _, r in live}
        with self._answer_lock:
            while not set(nodes) <= self._answered.get(tag, set()) | self._ended_nodes():
                if not self._answer_lock.wait(max(0.0, deadline - time.monotonic())):
                    break
            answers = self._answers.pop(tag, {})
        by_rank = {rank: node for node in nodes.values() for rank in node.ranks}
        return {rank: RankStack.from_answer(rank, by_rank[rank], answer) for rank, answer in answers.items()
                if rank in by_rank}

    def _ended_nodes(self) -> set[int]:
        return {r.node.node_rank for r in self.records if r.outcome is not None}

    def _watch(self) -> None:
        """Until every node has ended: judge hangs and slow ranks, answer `harness stacks` requests."""
        while any(r.outcome is None for r in self.records):
            time.sleep(WATCH_TICK)
            if self.run is not None:
                self._answer_stack_requests(self.run)
            if self.health is None or self.stopping_since is not None:
                continue
            for node_rank in self._ended_nodes():
                self.health.node_ended(node_rank)
            for rank, waited in self.health.slow_changes(time.time()):
                self.say(self._slow_words(rank, waited))
                self._write_health()
            if stalled := self.health.stalled():
                self._hung(stalled)

    def _slow_words(self, rank: int, waited: float | None) -> str:
        node = self._node_of(rank)
        if waited is None:
            return f"rank {rank} ({node.label} on {node.host}) is no longer slow"
        return (f"slow: rank {rank} ({node.label} on {node.host}): its peers wait for it {waited:.0f}% of the time "
                f"(over the last {SLOW_WINDOW:g} s)")

    def _node_of(self, rank: int) -> Node:
        return next(r.node for r in self.records if rank in r.node.ranks)

    def _hung(self, stalled: list[int]) -> None:
        """Read every rank's stacks, keep them, say who the hang is about, and stop the job."""
        assert self.health is not None
        self.hang_at = time.time()
        self.say(f"no progress for {self.health.stall:g} s on {ranks_text(stalled)}: reading every rank's stack")
        stacks = self.capture_stacks(f"hang-{self.attempt}")
        ended = {rank: (r.node, r.outcome.describe()) for r in self.records if r.outcome is not None
                 for rank in r.node.ranks}
        if self.run is not None:
            self._keep_stacks(self.run.stacks / f"attempt-{self.attempt}", stacks)
        self.hang = hang_verdict(self.health.stall, stacks, ended)
        self._write_health()
        kept = f" (stacks in {self.run.stacks}/attempt-{self.attempt}/)" if self.run else ""
        self.say(f"hang: {self.hang.text}{kept}")
        self.stop_all()

    def _keep_stacks(self, where: Path, stacks: dict[int, RankStack]) -> None:
        where.mkdir(parents=True, exist_ok=True)
        for rank, stack in stacks.items():
            write_text_atomic(where / f"rank{rank}.txt", stack.text())
        write_text_atomic(where / "stacks.json", json.dumps(
            {str(rank): {"node": s.node.node_rank, "host": s.node.host, "pid": s.pid, "state": s.state,
                         "threads": s.threads, "error": s.error} for rank, s in sorted(stacks.items())}))

    def _answer_stack_requests(self, run: RunDir) -> None:
        """`harness stacks` leaves request-TAG in the stacks directory; the answer is TAG/stacks.json."""
        for request in sorted(run.stacks.glob("request-*")) if run.stacks.is_dir() else []:
            tag = request.name.removeprefix("request-")
            self._keep_stacks(run.stacks / tag, self.capture_stacks(tag))
            request.unlink(missing_ok=True)

    def _write_health(self) -> None:
        if self.run is None or self.health is None:
            return
        slow = {str(rank): round(waited, 1) for rank, waited in self.health.slow_ranks().items()}
        write_text_atomic(self.run.health_file, json.dumps(
            {"attempt": self.attempt, "slow": slow, "hang": f"hang: {self.hang.text}" if self.hang else None}))

    def _spawn(self, target: Callable[..., Any], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _pump(self, process: NodeProcess, record: NodeRecord) -> None:
        prefix = f"[{record.node.label}] "
        with contextlib.ExitStack() as stack:
            log = None
            if self.log_file is not None:
                log = stack.enter_context(open(self.log_file(record.node), "a", encoding="utf-8"))
            for raw in process.output():
                line, show = record.take(raw, self.quiet_cpp_info)
                if log is not None:
                    log.write(line + "\n")
                    log.flush()
                if not show:
                    continue
                with self._print_lock:
                    self.out.write(prefix + line + "\n")
                    self.out.flush()

    def _reap(self, process: NodeProcess, record: NodeRecord) -> None:
        outcome = process.wait()
        record.ended = time.time()
        record.outcome = outcome
        self._events.put(record)

    def say(self, message: str) -> None:
        with self._print_lock:
            self.out.write(f"harness: {message}\n")
            self.out.flush()

    def wait(self, stop_requested: threading.Event) -> None:
        """Until every node has ended; the first failure or a stop request stops the rest."""
        pending = len(self.records)
        stopping = False
        while pending:
            if stop_requested.is_set() and not stopping:
                self.say("stop requested: stopping every node")
                self.stop_all()
                stopping = True
            try:
                record = self._events.get(timeout=0.1)
            except queue.Empty:
                continue
            pending -= 1
            assert record.outcome is not None
            if not record.outcome.ok and self.first_failure is None and self.stopping_since is None:
                self.first_failure = record
                # The failing rank's own code, as the report and `harness status` give it (torchrun's is 1).
                rank, code = record.root_cause()
                how = f"rank {rank} {Outcome.from_returncode(code).describe()}" if rank is not None and \
                    code is not None else record.outcome.describe()
                self.say(f"{record.node.label} on {record.node.host} failed ({how}); stopping the other nodes")
                self.stop_all()
                stopping = True

    def stop_all(self) -> None:
        """SIGTERM every node now; SIGKILL whatever is left after the grace period (in background)."""
        if self.stopping_since is None:
            self.stopping_since = time.time()
        for process, record in zip(self._processes, self.records, strict=True):
            if record.outcome is None:
                process.terminate()
        self._spawn(self._kill_after_grace)

    def _kill_after_grace(self) -> None:
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            if all(r.outcome is not None for r in self.records):
                return
            time.sleep(0.05)
        for process, record in zip(self._processes, self.records, strict=True):
            if record.outcome is None:
                process.kill()

    def finish(self) -> None:
        """Every node has ended: sweep stragglers (orphaned workers), drain output threads."""
        for process in self._processes:
            process.kill()
        for thread in self._threads:
            thread.join(timeout=2)
