"""Supervise the nodes of one run, whatever runs them: stream logs, propagate failure, stop cleanly.

A failed node must not leave the survivors hanging in a collective until NCCL/gloo time out, so the
first failure stops every other node (SIGTERM, then SIGKILL after the grace period).
"""

from __future__ import annotations

import contextlib
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
from harness.targets.base import NodeProcess, Outcome

TAIL_LINES = 20
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
    go to the log only."""

    grace: float
    out: IO[str] = sys.stdout
    log_file: Callable[[Node], Path] | None = None
    quiet_cpp_info: bool = False
    records: list[NodeRecord] = field(default_factory=list)
    first_failure: NodeRecord | None = None
    stopping_since: float | None = None  # when the supervisor began stopping the nodes (failure or request)
    _print_lock: threading.Lock = field(default_factory=threading.Lock)
    _events: queue.Queue[NodeRecord] = field(default_factory=queue.Queue)
    _threads: list[threading.Thread] = field(default_factory=list)
    _processes: list[NodeProcess] = field(default_factory=list)

    def start(self, processes: list[NodeProcess]) -> None:
        for process in processes:
            record = NodeRecord(process.node, started=time.time())
            self.records.append(record)
            self._spawn(self._pump, process, record)
            self._spawn(self._reap, process, record)
        self._processes = list(processes)

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
            if not record.outcome.ok and self.first_failure is None and not stopping:
                self.first_failure = record
                self.say(f"{record.node.label} on {record.node.host} failed ({record.outcome.describe()}); "
                         f"stopping the other nodes")
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
