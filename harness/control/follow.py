"""Follow a run whose controller a scheduler runs (harness.targets.base.Scheduler: a Slurm batch job) from
the user's terminal: announce the job's state (pending, running, requeued), print the run's stream from
its timed record as the controller in the allocation writes it (record/stream.py, the file system
shared with the nodes), cancel the job on a stop, and say how the job ended when no controller did."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from pathlib import Path

from harness.control.terminal import Terminal
from harness.record.rundir import RunDir
from harness.record.stream import StreamReader, each_rank, record_files, unstamp
from harness.targets.base import JobStatus, Scheduler

POLL_SECONDS = 0.1  # how often the record is read (the run's lines reach the terminal this late at most)
DESCRIBE_EVERY = 5  # polls: how often the job's state is asked of the scheduler
OWN_LOG_LINES = 20  # of the batch step's output, shown when the job ended without its controller's record


class Follower:
    """One submitted job, followed to its end."""

    def __init__(self, scheduler: Scheduler, run: RunDir, job_id: str, out: Terminal, own_file: str) -> None:
        self.scheduler, self.run, self.job_id, self.out, self.own_file = scheduler, run, job_id, out, own_file
        self.readers: dict[Path, StreamReader] = {}
        self.attempt = 0
        self.cancelled = False
        self.reason: str | None = None  # why the job ended without the controller's record, when it did
        self.what = f"{scheduler.name.capitalize()} job {job_id}"

    def follow(self, stop: threading.Event) -> JobStatus:
        """Until the job has ended; its last state."""
        seen: tuple[str, str | None] | None = None
        for poll in itertools.count():
            if poll % DESCRIBE_EVERY == 0 or (stop.is_set() and not self.cancelled):
                job = self.scheduler.describe(self.job_id)
                if job.attempt > self.attempt:
                    self.attempt = job.attempt
                    self.out.say(f"{self.what} was requeued (restart {job.attempt}): the run goes on there, from "
                                 f"the newest checkpoint")
                if (job.state, job.reason) != seen:
                    seen = (job.state, job.reason)
                    self._announce(job)
                if job.never_starts is not None and not self.cancelled:
                    self.reason = f"{self.what} can never start: {job.never_starts} (pending reason {job.reason})"
                    self._cancel()
                if stop.is_set() and not self.cancelled:
                    self.out.say(f"stop requested: cancelling {self.what}")
                    self._cancel()
                if job.finished:
                    self._pump()
                    return job
            self._pump()
            (time.sleep if self.cancelled else stop.wait)(POLL_SECONDS)
        raise AssertionError("unreachable: itertools.count() never ends")

    def ended_without_record(self, job: JobStatus) -> str:
        """Why the run ended when its controller wrote no summary: the job's end, and the batch step's
        last words (a run directory the nodes cannot see, a harness they cannot import)."""
        if self.reason is not None:
            return self.reason
        own = self.scheduler.own_log(self.run.path, self.job_id)
        try:
            said = [line for line in own.read_text(errors="replace").splitlines() if line.strip()][-OWN_LOG_LINES:]
        except OSError:
            said = []
        for line in said:
            self.out.say(f"[{self.scheduler.name}] {line}")
        how = f"{job.state}" + (f" ({job.reason})" if job.reason else "") + \
            (f", exit code {job.exit_code}" if job.exit_code else "")
        return (f"{self.what} ended ({how}) without the harness's record of the run: its batch step's output is "
                f"{own}")

    def _cancel(self) -> None:
        self.scheduler.cancel(self.job_id)
        self.cancelled = True

    def _announce(self, job: JobStatus) -> None:
        why = f" ({job.reason})" if job.reason else ""
        if job.state == "PENDING":
            self.out.say(f"{self.what} pending{why}")
        elif job.state == "RUNNING":
            self.out.say(f"{self.what} running on {job.where}" + (f" (attempt {job.attempt})" if job.attempt else ""))
        elif job.state not in ("CONFIGURING", "COMPLETING"):
            self.out.say(f"{self.what} {job.state.lower()}{why}")

    def _pump(self) -> None:
        """The record's new lines (the controller's words and every rank's), in time order."""
        for path in record_files(self.run.stream):
            if path.name != self.own_file:
                self.readers.setdefault(path, StreamReader(path))
        for line in heapq.merge(*(reader.lines() for reader in self.readers.values())):
            for shown in [line] if self.out.collapse else each_rank(line):
                self.out.job_lines(unstamp(shown), 1)
