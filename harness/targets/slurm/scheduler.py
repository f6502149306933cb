"""`harness launch --target slurm`: submit the batch script, follow the job to its end, report as every
backend does.

Slurm owns the processes (the job outlives this terminal, requeues itself, and runs without the
harness), so the harness follows instead of supervising: it checks with `sbatch --test-only` that the
job can ever start, submits it, watches its state (pending with the reason -> running on which nodes
-> requeued -> ended), streams the node logs srun writes into the run directory (shared storage, as a
Slurm submit directory is), cancels the job on Ctrl-C or `harness stop`, and reads each node's end
from srun's own report. A requeue is the next attempt (HARNESS_ATTEMPT = SLURM_RESTART_COUNT).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from harness.node.agent import start_ticks
from harness.plan.planner import NodePlan, resolve_nproc
from harness.run.controller import failure_of, finish, node_result, say, stopped_status
from harness.run.records import (
    Attempt,
    ControllerId,
    RunDir,
    RunState,
    RunStatus,
    create_run_dir,
    run_dir,
    write_text_atomic,
)
from harness.run.recovery import attempt_failures, attempt_kind
from harness.run.supervisor import NodeRecord
from harness.spec.job import JobSpec
from harness.targets.base import Outcome
from harness.targets.slurm.batch import batch_log, batch_script
from harness.targets.slurm.client import SlurmClient, SlurmJob, task_outcomes

POLL_SECONDS = 0.5  # how often the job's state is asked for and the logs are read


@dataclass
class _Tail:
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
    """One run of the batch script (the first, then one per requeue)."""

    number: int
    started: float | None = None
    batch_lines: list[str] = field(default_factory=list)  # the script's own output in this attempt (srun's report)
    records: list[NodeRecord] = field(default_factory=list)
    tails: list[_Tail] = field(default_factory=list)


class _Follower:
    """One submitted job, followed from the first look to its end; what it saw becomes Attempt records."""

    def __init__(self, client: SlurmClient, run: RunDir, state: RunState, job_id: int, out: IO[str]) -> None:
        self.client, self.run, self.state, self.job_id, self.out = client, run, state, job_id, out
        self.nproc = state.world_size // state.nnodes
        self.batch = _Tail(batch_log(run.path, job_id))
        self.current = _Attempt(0)
        self.attempts: list[Attempt] = []
        self.cancelled = False
        self.reason: str | None = None

    def follow(self, stop: threading.Event) -> Attempt | None:
        """Until the job has ended; returns nothing when it never started."""
        seen: tuple[str, str] | None = None
        while True:
            job = self.client.job(self.job_id)
            if job.restarts > self.current.number:
                self._requeued(job)
            if (job.state, job.reason) != seen:
                seen = (job.state, job.reason)
                self._announce(job)
            # A short job may start and end between two looks: its nodes are still on record.
            if self.current.started is None and (job.state == "RUNNING" or job.finished) \
                    and job.nodelist not in ("", "(null)"):
                self._running(job)
            if (why := job.never_starts) is not None and not self.cancelled:
                self.reason = f"Slurm job {self.job_id} can never start: {why} (pending reason {job.reason})"
                self._cancel()
            if stop.is_set() and not self.cancelled:
                say(self.out, f"stop requested: cancelling Slurm job {self.job_id}")
                self._cancel()
            self._pump()
            if job.finished:
                self._pump(final=True)
                return self._ended(job)
            stop.wait(POLL_SECONDS)

    def _cancel(self) -> None:
        self.client.cancel(self.job_id)
        self.cancelled = True

    def _announce(self, job: SlurmJob) -> None:
        if job.state == "PENDING":
            say(self.out, f"Slurm job {self.job_id} pending" + (f" ({job.reason})" if job.reason != "None" else ""))
        elif job.state == "RUNNING":
            say(self.out, f"Slurm job {self.job_id} running on {job.nodelist}"
                          + (f" (attempt {job.restarts})" if job.restarts else ""))
        elif job.state not in ("CONFIGURING", "COMPLETING"):
            say(self.out, f"Slurm job {self.job_id} {job.state.lower()}"
                          + (f" ({job.reason})" if job.reason != "None" else ""))

    def _running(self, job: SlurmJob) -> None:
        attempt = self.current
        attempt.started = time.time()
        hosts = self.client.hostnames(job.nodelist)
        for rank, host in enumerate(hosts):
            node = NodePlan(host=host, address=host, node_rank=rank, nproc=self.nproc, argv=(), env={})
            attempt.records.append(NodeRecord(node, started=attempt.started))
            attempt.tails.append(_Tail(self.run.log_file(rank, attempt.number)))
        self.state = replace(self.state, hosts=hosts, attempt=attempt.number)
        self.run.write_state(self.state)

    def _pump(self, final: bool = False) -> None:
        """Print every node's new lines with its prefix, and the batch script's own (srun, harness)."""
        for record, tail in zip(self.current.records, self.current.tails, strict=True):
            for raw in tail.rest() if final else tail.lines():
                line, show = record.take(raw)
                if show:
                    self._print(f"[{record.node.label}] {line}")
        for line in self.batch.rest() if final else self.batch.lines():
            self.current.batch_lines.append(line)
            self._print(f"[slurm] {line}")

    def _print(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def _requeued(self, job: SlurmJob) -> None:
        self._pump(final=True)
        say(self.out, f"Slurm job {self.job_id} was requeued (restart {job.restarts}): the next attempt resumes "
                      f"from the newest checkpoint")
        self.attempts.append(self._attempt_record(None, requeued=True))
        self.current = _Attempt(job.restarts)

    def _ended(self, job: SlurmJob) -> Attempt | None:
        return None if self.current.started is None else self._attempt_record(job, requeued=False)

    def _attempt_record(self, job: SlurmJob | None, *, requeued: bool) -> Attempt:
        """The attempt's nodes and failures. srun reports the tasks that did not succeed, the first failure
        first; the nodes it ended after that (--kill-on-bad-exit) are not failures. job: None when requeued."""
        attempt = self.current
        ended = time.time()
        outcomes = task_outcomes(attempt.batch_lines)
        order = list(outcomes)
        state = job.state if job is not None else "REQUEUED"
        for record in attempt.records:
            rank = record.node.node_rank
            # srun reports every task that failed, so an unreported one succeeded, unless Slurm ended the job.
            record.outcome = outcomes.get(rank) or (Outcome(exit_code=0) if state in ("COMPLETED", "FAILED") else
                                                    Outcome(exit_code=None, error=f"ended with the job ({state})"))
            record.ended = ended + (order.index(rank) * 1e-3 if rank in order else 0.0)
        first = next((attempt.records[rank].ended for rank in order if rank < len(attempt.records)), None)
        found = attempt_failures([r for r in attempt.records if r.outcome and r.outcome.error is None], first)
        started = attempt.started or ended
        failures = [failure_of(f, started, ended) for f in found]
        if self.cancelled and self.reason is None:
            status = stopped_status(self.run)
        elif state == "COMPLETED" and not failures:
            status = RunStatus.SUCCEEDED
        else:
            status = RunStatus.FAILED
            if not failures and not requeued and self.reason is None:
                self.reason = f"Slurm ended job {self.job_id}: {state}" + \
                    (f" ({job.reason})" if job is not None and job.reason != "None" else "") + \
                    (f", exit code {job.exit_code}" if job is not None else "")
        return Attempt(
            attempt=attempt.number, hosts=[r.node.host for r in attempt.records], status=status, started_at=started,
            ended_at=ended, nodes=[node_result(r, self.run, attempt.number) for r in attempt.records],
            failures=failures, kind=attempt_kind(found) if failures else None, down=[], preflight_s=0.0,
        )


def launch(client: SlurmClient, spec: JobSpec, spec_path: Path, runs_root: Path, run_id: str,
           out: IO[str] = sys.stdout) -> int:
    """Submit spec as a Slurm batch job and follow it to its end; the harness's exit status. Nothing
    is submitted and no run directory exists when Slurm says the job can never start."""
    nproc = resolve_nproc(spec, [spec.resources.gpus] * spec.nnodes, ["each node (resources.gpus)"] * spec.nnodes)
    log_dir = run_dir(runs_root, run_id).path.resolve()
    script = batch_script(spec, str(spec_path), run_id=run_id, log_dir=log_dir)
    began = time.time()
    client.check(script)
    run = create_run_dir(runs_root, run_id)
    shutil.copyfile(spec_path, run.spec_copy)
    write_text_atomic(run.batch_script, script)
    job_id = client.submit(run.batch_script)
    state = RunState(run_id=run_id, name=spec.name, mode="slurm", status=RunStatus.RUNNING, started_at=began,
                     nnodes=spec.nnodes, world_size=spec.nnodes * nproc,
                     controller=ControllerId(os.getpid(), start_ticks(os.getpid())), hosts=[],
                     scheduler_job=str(job_id))
    run.write_state(state)
    say(out, f"run {run_id}: submitted Slurm job {job_id} ({spec.nnodes} node(s) x {nproc} process(es)); "
             f"logs in {run.path}/")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    follower = _Follower(client, run, state, job_id, out)
    try:
        last = follower.follow(stop)
    except BaseException as exc:
        run.write_state(replace(follower.state, status=RunStatus.ERROR, error=str(exc), ended_at=time.time()))
        if not follower.cancelled:
            say(out, f"Slurm job {job_id} is still in Slurm's hands: `scancel {job_id}` or `harness stop {run_id}`")
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    attempts = follower.attempts + ([last] if last is not None else [])
    return finish(run, follower.state, attempts, stop, follower.reason, out)
