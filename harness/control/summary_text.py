"""What the controller says on the terminal at a run's end: how each attempt went, and how the run ended
(its first failure: the exception, where, the hint, the last lines)."""

from __future__ import annotations

from harness.control.terminal import Terminal
from harness.record.rundir import RunDir
from harness.record.schema import RunStatus, RunSummary


def report(out: Terminal, summary: RunSummary, run: RunDir) -> None:
    resized = len(summary.world_sizes) > 1
    if len(summary.attempts) > 1:
        for attempt in summary.attempts:
            recovered = f", recovered in {attempt.recover_s:.2f} s" if attempt.recover_s is not None else ""
            how = f"failed on {attempt.failures[0].describe(verdict_said=True)}" if attempt.failures else \
                attempt.status.value
            how += f"; ended by {attempt.ended_by}" if attempt.ended_by else ""
            out.say(f"attempt {attempt.attempt} on {attempt.where(resized)}{recovered}: {how}")
    failure = summary.first_failure
    if summary.status is RunStatus.SUCCEEDED:
        sizes = f", world size {' -> '.join(map(str, summary.world_sizes))}" if resized else ""
        warned = "".join(f", but {warning}" for warning in summary.warnings)
        out.say(f"run {summary.run_id} succeeded in {summary.duration_s} s{sizes}{warned}; logs in {run.path}/")
    elif failure is not None:
        if failure.error is not None:  # what the user must change first: the exception and their own frame
            out.say(f"run {summary.run_id} FAILED: {failure.error}")
            if failure.error_at is not None:
                out.write(f"    at {failure.error_at}\n" + (f"        {failure.error_source}\n"
                                                           if failure.error_source else ""))
            out.say(f"first failure on {failure.describe(verdict_said=True)}")
        else:
            out.say(f"run {summary.run_id} FAILED: first failure on {failure.describe(verdict_said=True)}")
        if failure.hint:
            out.say(f"hint: {failure.hint}")
        if summary.reason:
            out.say(f"not restarted: {summary.reason}")
        if failure.error is None and failure.last_lines:  # else its traceback is above, its exception just said
            out.say(f"last lines of node{failure.node_rank}" + (f", rank {failure.rank}:" if failure.rank is not None
                                                                 else ":"))
            for line in failure.last_lines[-10:]:
                out.write(f"    {line}\n")
        last = summary.attempts[-1].attempt
        out.say(f"full logs: {run.log_file(failure.node_rank, last)}; summary: {run.summary_file}")
    elif summary.reason:
        out.say(f"run {summary.run_id} FAILED: {summary.reason}")
    else:
        out.say(f"run {summary.run_id} {summary.status.value}: every node stopped; logs in {run.path}/")
    out.flush()
