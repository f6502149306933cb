"""Follow a job that a scheduler owns (harness.targets.base.Scheduler) from the first look to its end:
announce its state, stream every node's log with the node's prefix, cancel it on a stop, and turn
what was seen into the run record's Attempts, one per run of the job (the first, then each requeue)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.plan.planner import Node
from harness.run.live import LiveNode
from harness.run.records import Attempt, RunState, RunStatus
from harness.run.recovery import attempt_failures, attempt_kind
from harness.run.results import failure_of, recorded_node, stopped_status
from harness.run.rundir import RunDir
from harness.run.stream_record import stamp, stamped
from harness.run.terminal import Terminal
from harness.targets.base import JobStatus, Scheduler

POLL_SECONDS = 0.5  # how often the job's state is asked for and the logs are read


@dataclass
class Tail:
    """New complete lines of a file another machine is still writing."""

    path: Path
    offset: int = 0
    partial: str = ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                handle.seek(self.offset)
                text = handle.read()
                self.offset = handle.tell()
        except FileNotFoundError:
            return []
        *complete, self.partial = (self.partial + text).split("\n")
        return complete

    def rest(self) -> list[str]:
        """Once the writer is gone: also a last line without its newline."""
        lines = self.lines()
        last, self.partial = self.partial, ""
        return lines + ([last] if last else [])


@dataclass
class _Attempt:
    """One run of the job (the first, then one per requeue)."""

    number: int
    started: float | None = None
    own_lines: list[str] = field(default_factory=list)  # the scheduler's own output in this attempt
    nodes: list[LiveNode] = field(default_factory=list)
    tails: list[Tail] = field(default_factory=list)


class Follower:
    """One submitted job, followed to its end; what it saw becomes Attempt records."""

    def __init__(self, scheduler: Scheduler, run: RunDir, state: RunState, job_id: str, out: Terminal) -> None:
        self.scheduler, self.run, self.state, self.job_id, self.out = scheduler, run, state, job_id, out
        self.nproc = state.world_size // state.nnodes
        self.own = Tail(scheduler.own_log(run.path, job_id))
        self.current = _Attempt(0)
        self.attempts: list[Attempt] = []
        self.cancelled = False
        self.reason: str | None = None
        self.what = f"{scheduler.name.capitalize()} job {job_id}"

    def follow(self, stop: threading.Event) -> Attempt | None:
        """Until the job has ended; returns nothing when it never started."""
        seen: tuple[str, str | None] | None = None
        while True:
            job = self.scheduler.describe(self.job_id)
            if job.attempt > self.current.number:
                self._requeued(job)
            if (job.state, job.reason) != seen:
                seen = (job.state, job.reason)
                self._announce(job)
            if self.current.started is None and job.hosts:
                self._running(job)
            if job.never_starts is not None and not self.cancelled:
                self.reason = f"{self.what} can never start: {job.never_starts} (pending reason {job.reason})"
                self._cancel()
            if stop.is_set() and not self.cancelled:
                self.out.say(f"stop requested: cancelling {self.what}")
                self._cancel()
            self._pump()
            if job.finished:
                self._pump(final=True)
                return None if self.current.started is None else self._attempt_record(job)
            stop.wait(POLL_SECONDS)

    def _cancel(self) -> None:
        self.scheduler.cancel(self.job_id)
        self.cancelled = True

    def _announce(self, job: JobStatus) -> None:
        why = f" ({job.reason})" if job.reason else ""
        if job.state == "PENDING":
            self.out.say(f"{self.what} pending{why}")
        elif job.state == "RUNNING":
            self.out.say(f"{self.what} running on {job.where}"
                          + (f" (attempt {job.attempt})" if job.attempt else ""))
        elif job.state not in ("CONFIGURING", "COMPLETING"):
            self.out.say(f"{self.what} {job.state.lower()}{why}")

    def _running(self, job: JobStatus) -> None:
        attempt = self.current
        attempt.started = time.time()
        for rank, host in enumerate(job.hosts):
            attempt.nodes.append(LiveNode(Node(host, host, rank, self.nproc), started=attempt.started))
            attempt.tails.append(Tail(self.run.log_file(rank, attempt.number)))
        self.state = replace(self.state, hosts=list(job.hosts), attempt=attempt.number)
        self.run.write_state(self.state)

    def _pump(self, final: bool = False) -> None:
        """Print every node's new lines with its prefix, and the scheduler's own (srun, harness)."""
        for record, tail in zip(self.current.nodes, self.current.tails, strict=True):
            shown = []
            for raw in tail.rest() if final else tail.lines():
                line, show = record.take(raw)
                if show:
                    shown.append(f"[{record.node.label}] {line}\n")
                    self._print(shown[-1][:-1])
            if shown and self.out.record is not None:  # the run's timed record, as a supervised run's
                with self.out.record.open_node(self.current.number, record.node.node_rank) as timed:
                    timed.write(stamped("".join(shown), f"{stamp(time.time())} "))
        for line in self.own.rest() if final else self.own.lines():
            self.current.own_lines.append(line)
            self._print(f"[{self.scheduler.name}] {line}")

    def _print(self, line: str) -> None:
        self.out.job_lines(line + "\n", 1)

    def _requeued(self, job: JobStatus) -> None:
        self._pump(final=True)
        self.out.say(f"{self.what} was requeued (restart {job.attempt}): the next attempt resumes from the "
                      f"newest checkpoint")
        self.attempts.append(self._attempt_record(None))
        self.current = _Attempt(job.attempt)

    def _attempt_record(self, job: JobStatus | None) -> Attempt:
        """The attempt's nodes and failures; the nodes the scheduler ended after the first failure
        (srun's --kill-on-bad-exit) are not failures. job: None when the attempt was requeued."""
        attempt = self.current
        ended = time.time()
        reported, rest = self.scheduler.node_outcomes(attempt.own_lines, job)
        order = [rank for rank in reported if rank < len(attempt.nodes)]
        for record in attempt.nodes:
            rank = record.node.node_rank
            record.outcome = reported.get(rank, rest)
            record.ended = ended + (order.index(rank) * 1e-3 if rank in order else 0.0)
        first = attempt.nodes[order[0]].ended if order else None
        found = attempt_failures([r for r in attempt.nodes if r.outcome and r.outcome.error is None], first)
        started = attempt.started or ended
        failures = [failure_of(f, started, ended) for f in found]
        if self.cancelled and self.reason is None:
            status = stopped_status(self.run)
        elif job is not None and job.succeeded and not failures:
            status = RunStatus.SUCCEEDED
        else:
            status = RunStatus.FAILED
            if not failures and job is not None and self.reason is None:
                self.reason = f"{self.scheduler.name.capitalize()} ended job {self.job_id}: {job.state}" + \
                    (f" ({job.reason})" if job.reason else "") + \
                    (f", exit code {job.exit_code}" if job.exit_code else "")
        return Attempt(
            attempt=attempt.number, hosts=[r.node.host for r in attempt.nodes], status=status, started_at=started,
            ended_at=ended, nodes=[recorded_node(r, self.run, attempt.number) for r in attempt.nodes],
            failures=failures, kind=attempt_kind(found) if failures else None, down=[], preflight_s=0.0,
            nnodes=self.state.nnodes, world_size=self.state.world_size,
        )
