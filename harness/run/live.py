"""One node of an attempt while it runs, as the controller sees it (LiveNode): its lines, which ranks
joined, how and when it ended. run/results.py turns it into the run record's RecordedNode and Failure
once the attempt is over; run/recovery.py classifies its failure."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

from harness.plan.planner import Node
from harness.run import worker_output
from harness.targets.base import Outcome

TAIL_LINES = 20
# torchrun's ChildFailedError report names the root-cause rank; use it when present.
ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: \d+\)")
ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


@dataclass
class LiveNode:
    """One node of an attempt as the controller saw it: its lines, how and when it ended."""

    node: Node
    started: float
    ended: float | None = None
    outcome: Outcome | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=500))
    joined: set[int] = field(default_factory=set)  # ranks seen connecting to the rendezvous store
    torchrun_reporting: bool = False  # torchrun's failure report began: its lines stay in the log
    in_agent_cpp_log: bool = False  # within a C++ log line of torchrun's own and its exception dump
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
        torchrun's own C++ log lines with their exception dumps (its store client's, e.g. a peer's agent
        that left first at the end of a run), nor torchrun's ChildFailedError report: the harness reports
        what they mean. Notes which ranks joined the rendezvous store."""
        line = worker_output.normalize(raw)
        if worker_output.is_cpp_info(line):
            if (rank := worker_output.joined_rank(line)) is not None:
                self.joined.add(rank)
            if quiet_cpp_info:
                return line, False
        self.in_agent_cpp_log = worker_output.is_agent_cpp_log(line) or \
            (self.in_agent_cpp_log and worker_output.continues_cpp_dump(line))
        self.tail.append(line)
        if self.in_agent_cpp_log:
            return line, False
        self.torchrun_reporting = self.torchrun_reporting or worker_output.starts_torchrun_report(line)
        return line, not (self.torchrun_reporting and worker_output.rank_of(line) is None)

    def last_lines(self, rank: int | None, count: int = TAIL_LINES) -> list[str]:
        """The failing rank's own last lines say why; the node's tail is the fallback."""
        own = [line for line in self.tail if rank is not None and line.startswith(f"[rank{rank}]:")]
        return (own or list(self.tail))[-count:]
