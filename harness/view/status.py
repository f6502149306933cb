"""`harness status`: the table of runs (./runs and the user's index of runs, or the one runs directory
given), or one run's nodes, from the run records."""

from __future__ import annotations

import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from harness.health.rank_stack import ranks_text
from harness.health.slowdown import Slowdown
from harness.node.proctable import run_processes
from harness.record.goodput import ending_parts, goodput_of
from harness.record.health_summary import TABLE_SECONDS, by_activity
from harness.record.index import RunsLookup, runs_lookup
from harness.record.liveness import live_status, unwatched_for
from harness.record.rundir import RunDir
from harness.record.schema import (
    Attempt,
    Failure,
    FailureKind,
    Goodput,
    HealthEventKind,
    LiveHealth,
    NodeHealth,
    Progress,
    RecordedNode,
    RecordError,
    RunState,
    RunStatus,
    RunSummary,
)

UNCUT = 1 << 16  # the width of lines that are not cut to a terminal's
NODES_LISTED = 16  # nodes status lists one by one; beyond, by state
NODE_GROUPS_SHOWN = 8  # lines of nodes alike in a job whose health.json sums up its nodes
STALE_SECONDS = 10.0  # health.json older than this, while the run runs, is said to be so


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.0f}h"


def runs_table(lookup: RunsLookup) -> str:
    """One line per run, oldest first; a run whose record cannot be read is listed with the reason. A WHERE
    column, when some run lives outside the runs directory (found through the index), says where each does. Other
    users' runs there are counted, never listed (record/trust.py)."""
    entries = lookup.runs()
    others = len(lookup.others())
    note = f"({others} run(s) of other users there are not listed: harness shows and acts on runs of your own only)\n" \
        if others else ""
    if not entries:
        return f"no runs in {lookup.searched}; {lookup.hint}\n" + note
    places = [lookup.elsewhere(entry.run) for entry in entries]
    where = any(places)
    lines = [f"{'RUN ID':<44} {'STATUS':<12} {'NODES':>5} {'STARTED':>8} {'DURATION':>9}" + ("  WHERE" * where)]
    now = time.time()
    for entry, place in zip(entries, places, strict=True):
        state = entry.state
        if state is None:
            line = f"{entry.run.run_id:<44} {RunStatus.UNREADABLE.value:<12} {'-':>5} {'-':>8} {'-':>9}"
        else:
            try:
                summary = entry.run.read_summary()
            except RecordError:  # a damaged summary: the state still says enough for the table
                summary = None
            duration = summary.duration_s if summary else (state.ended_at or now) - state.started_at
            line = (f"{entry.run.run_id:<44} {live_status(state, entry.run).value:<12} {state.nnodes:>5} "
                    f"{_age(now - state.started_at) + ' ago':>8} {duration:>8.1f}s")
        lines.append(line + (f"  {place or lookup.root}/" * where) + (f"  {entry.problem}" if entry.problem else ""))
    return "\n".join(lines) + "\n" + note


def run_details(run: RunDir, width: int = UNCUT) -> str:
    """The run's status, then per node how it ended and where its log is (while it runs, each rank as the
    health watch sees it, cut to width), then the first failure and the health watch's verdicts."""
    state, summary = run.read_state(), run.read_summary()
    mode = f"{state.mode} job {state.scheduler_job}" if state.scheduler_job else state.mode
    status = live_status(state, run)
    lines = [f"run {run.run_id}: {_status_words(state, status, run)} ({mode}, {state.nnodes} node(s), world size "
             f"{state.world_size})"]
    if status is RunStatus.LOST and state.scheduler_job:
        lines.append(f"  its controller is gone, but the {state.mode} job may run on: `harness stop {run.run_id}` "
                     f"cancels it")
    if summary is None:
        if state.attempt:
            lines.append(f"  attempt {state.attempt} (restarted {state.attempt} time(s); `harness status` shows the "
                         f"earlier attempts once the run has ended)")
        lines += node_lines({rank: (host, unrecorded_end(state, status, rank), run.log_file(rank, state.attempt), "")
                             for rank, host in enumerate(state.hosts)})
        if status is RunStatus.RUNNING and state.metrics:
            lines.append(f"  metrics: {state.metrics}")
        if status is RunStatus.UNWATCHED and (since := unwatched_for(state, run)) is not None and \
                (held := run.read_health(state.attempt)) is not None and held.progress is not None:
            lines.append(f"  progress: {unwatched_progress_words(held.progress, since)}")
        if status is RunStatus.RUNNING and (health := run.read_health(state.attempt)) is not None:
            now = time.time()
            if health.progress is not None:
                lines.append(f"  progress: {progress_words(health.progress, running=True)}")
            lines.append(f"  time: {goodput_words(goodput_of(run, state, None, now, health))}")
            lines += node_state_lines(health)
            lines += rank_rows(health, now, width)
            lines += unlisted_lines(health, run, now)
            lines += [f"  {line}" for line in health_lines(health)]
        return "\n".join(lines) + "\n"
    if len(summary.attempts) > 1:
        lines += [_attempt_line(attempt, len(summary.world_sizes) > 1) for attempt in summary.attempts]
    failed = node_failures(summary.attempts[-1].failures if summary.attempts else [])
    lines += node_lines({n.node_rank: (n.host, recorded_end(n, failed.get(n.node_rank), summary.status),
                                       node_log(run, n), f" after {ended_after(n, failed.get(n.node_rank))} s")
                         for n in summary.nodes})
    failure = summary.first_failure
    if failure:
        lines.append(f"  first failure: node{failure.node_rank} ({failure.host}), "
                     + (f"rank {failure.rank}, " if failure.rank is not None else "") +
                     f"{failure.description} ({failure.kind.value}: {failure.evidence})")
        if failure.error:
            lines.append(f"  error: {failure.error}" + (f" at {failure.error_at}" if failure.error_at else ""))
        if failure.hint:
            lines.append(f"  hint: {failure.hint}")
    lines += _verdict_lines(summary)
    progress = next((a.progress for a in reversed(summary.attempts) if a.progress is not None), None)
    if progress is not None:
        lines.append(f"  progress: {progress_words(progress, running=False)}")
    lines.append(f"  time: {goodput_words(goodput_of(run, state, summary, time.time()))}")
    if (ending := ending_words(summary)) is not None:
        lines.append(f"  ending: {ending}")
    lines += [f"  warning: {warning}" for warning in summary.warnings]
    if summary.reason:
        lines.append(f"  not restarted: {summary.reason}")
    return "\n".join(lines) + "\n"


def progress_words(progress: Progress, running: bool) -> str:
    """`step 120/312 (38%), 16.8 steps/s, about 11 s left`; an ended run's steps done."""
    total = progress.total
    text = f"step {progress.last_step}" + (f"/{total} ({100 * progress.last_step / total:.0f}%)" if total else "")
    if not running:
        return text
    if progress.rate is not None:
        text += f", {progress.rate:.3g} steps/s"
    left = progress.left_s()
    if left is not None:
        text += f", about {_duration(left)} left"
    elif total and progress.rate == 0:
        text += ", not moving: no time left can be told"
    return text


def unwatched_progress_words(progress: Progress, since: float) -> str:
    """An unwatched run's steps: where they were when its controller was last seen, since seconds ago, and where the
    rate seen then puts them now (its nodes train on; their lines reach the record once a controller attaches):
    `step 40/200 (20%) when last watched 12 s ago; at 2.5 steps/s about step 70 now, about 52 s left`."""
    total = progress.total
    text = f"step {progress.last_step}" + (f"/{total} ({100 * progress.last_step / total:.0f}%)" if total else "") + \
        f" when last watched {since:.0f} s ago"
    if progress.rate:
        now = progress.last_step + progress.rate * since
        text += f"; at {progress.rate:.3g} steps/s about step {min(now, total or now):.0f} now"
        if (left := progress.left_s()) is not None:
            text += f", about {_duration(max(0.0, left - since))} left"
    return text


def ending_words(summary: RunSummary) -> str | None:
    """What `ending` waited for: `4.12 s the job ran after its last step line (its last save, evaluation, exit),
    0.20 s the harness (the sweep and the record)`; None where the record cannot split it."""
    parts = ending_parts(summary)
    if parts is None:
        return None
    last = summary.attempts[-1]
    job = "its nodes' stop after the failure" if last.failures else "the job after its last step line (its last " \
        "save, evaluation, exit)"
    return f"{parts[0]:.2f} s {job}, {parts[1]:.2f} s the harness (the sweep of what was left, the record)"


def goodput_words(goodput: Goodput) -> str:
    """`52.1 s, goodput 71%: training 37.0 s, start-up 9.1 s, ending 6.0 s` (the buckets that happened)."""
    spent = ", ".join(f"{bucket} {seconds:.1f} s" for bucket, seconds in goodput.seconds.items() if seconds >= 0.05)
    return f"{goodput.wall_s:.1f} s, goodput {100 * goodput.goodput:.0f}%" + (f": {spent}" if spent else "")


def _duration(seconds: float) -> str:
    """11 s, 4 min 10 s, 2 h 05 min."""
    if seconds < 100:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60) if seconds >= 3600 else int(seconds // 60)
    if seconds < 3600:
        return f"{minutes} min {seconds - 60 * minutes:.0f} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def node_failures(failures: list[Failure]) -> dict[int, Failure]:
    """Each node's first failure of an attempt (a hang's verdict comes first), by node rank."""
    failed: dict[int, Failure] = {}
    for failure in failures:
        failed.setdefault(failure.node_rank, failure)
    return failed


def node_log(run: RunDir, node: RecordedNode) -> Path:
    """The node's log as found from here: the record keeps it as the launch saw it (relative to its directory)."""
    return run.path / Path(node.log).name


def node_lines(nodes: dict[int, tuple[str, str, Path, str]]) -> list[str]:
    """Per node (its host, how it is, its log, how long it ran), one line each; of more than NODES_LISTED, one
    line per state naming its nodes as ranges, the first host and the logs' place (hundreds of nodes stay a few
    lines)."""
    if len(nodes) <= NODES_LISTED:
        return [f"  node{rank} on {host}: {how}{ran}; log {log}" for rank, (host, how, log, ran) in nodes.items()]
    alike: dict[str, list[int]] = {}
    for rank, (_, how, _, _) in nodes.items():
        alike.setdefault(how, []).append(rank)
    lines = []
    for how, ranks in alike.items():
        host, _, log, ran = nodes[ranks[0]]
        if len(ranks) == 1:
            lines.append(f"  node{ranks[0]} on {host}: {how}{ran}; log {log}")
            continue
        lines.append(f"  {ranks_text(ranks, 'node')} ({len(ranks)}, on {host}...): {how}; logs "
                     f"{log.parent}/node<N>.log")
    return lines


def health_lines(health: LiveHealth | None) -> list[str]:
    """What the controller's health loop says of the running attempt: slow ranks, a hang being stopped."""
    if health is None:
        return []
    lines = [f"slow: rank {rank}: its peers wait for it {waited:g}% of the time"
             for rank, waited in sorted(health.slow.items())]
    return lines + slowed_lines(health) + ([health.hang] if health.hang else [])


def slowed_lines(health: LiveHealth) -> list[str]:
    """What the slowness of the rank named slow first costs the job's pace now: `slowed: rank 1 (node1 on sim1) for
    25 s: the job runs at 0.51x its pace before 05:40:13 (39.2 -> 19.9 steps/s)`."""
    slowed = health.slowed
    if slowed is None:
        return []
    row = health.ranks.get(slowed.rank)
    who = f"rank {slowed.rank}" + (f" ({row.node} on {row.host})" if row is not None else "")
    lasted = f" for {health.t - slowed.since:.0f} s" if health.t is not None else ""
    return [f"slowed: {who}{lasted}: {Slowdown(slowed.since, slowed.pace_before, slowed.pace_now).words()}"]


def node_state_lines(health: LiveHealth) -> list[str]:
    """A job whose health.json sums up its nodes (schema.SUMMED_PAST): its nodes by how their ranks are, one line for
    the nodes alike (computing and waiting as one: a rank goes from one to the other within a step), the most nodes
    first, NODE_GROUPS_SHOWN lines at most: `nodes 0-2039 (2040, on sim0...): 8 computing or waiting; steps
    118-121`."""
    if not health.nodes:
        return []
    alike: dict[str, list[NodeHealth]] = {}
    for states, nodes in _alike(health).items():
        how = ", ".join(f"{count} {kind}" for kind, count in by_activity(dict(states)).most_common())
        alike.setdefault(how, []).extend(nodes)
    groups = sorted(alike.items(), key=lambda group: -len(group[1]))
    lines = [f"  ranks by node ({len(health.nodes)} nodes, {health.world_size} ranks):"]
    for how, nodes in groups[:NODE_GROUPS_SHOWN]:
        first = min(nodes, key=lambda node: node.node_rank)
        who = f"node{first.node_rank} ({first.host})" if len(nodes) == 1 else \
            f"{ranks_text([node.node_rank for node in nodes], 'node')} ({len(nodes)}, on {first.host}...)"
        least = min((n.least_step for n in nodes if n.least_step is not None), default=None)
        most = max((n.most_step for n in nodes if n.most_step is not None), default=None)
        steps = "" if least is None or most is None else f"; step {least}" if least == most else \
            f"; steps {least}-{most}"
        lines.append(f"    {who}: {how or 'no rank seen'}{steps}")
    if len(groups) > NODE_GROUPS_SHOWN:
        left = groups[NODE_GROUPS_SHOWN:]
        lines.append(f"    ... and {sum(len(nodes) for _, nodes in left)} node(s) more, of {len(left)} other kind(s) "
                     f"(health.json counts each node's states)")
    return lines


def _alike(health: LiveHealth) -> dict[tuple[tuple[str, int], ...], list[NodeHealth]]:
    """The nodes by their ranks' states (NodeHealth.states): a few kinds of nodes among thousands."""
    alike: dict[tuple[tuple[str, int], ...], list[NodeHealth]] = {}
    for node in health.nodes:
        alike.setdefault(tuple(sorted(node.states.items())), []).append(node)
    return alike


def unlisted_lines(health: LiveHealth, run: RunDir, now: float) -> list[str]:
    """For a job whose health.json lists only its odd ranks: how many are not listed, and where every rank's row is."""
    if not health.nodes:
        return []
    left = health.world_size - len(health.ranks)
    usual = Counter[str]()
    for states, nodes in _alike(health).items():
        usual.update({kind: count * len(nodes) for kind, count in by_activity(dict(states)).items()})
    odd = f" ({health.odd_left} of them odd past the {len(health.ranks)} listed)" if health.odd_left else ""
    like = f": {usual.most_common(1)[0][0]}, as most are" if usual else ""
    table = f"every {TABLE_SECONDS:g} s" + ("" if health.table_at is None else
                                            f", last {_age(max(0.0, now - health.table_at))} ago")
    return [f"  {left} of {health.world_size} ranks not listed{odd}{like}; every rank's row: {run.health_table} "
            f"({table}); a rank's lines: `harness logs {run.run_id} --rank N`"]


def rank_rows(health: LiveHealth, now: float, width: int) -> list[str]:
    """One row per rank health.json lists (every rank, or past schema.SUMMED_PAST only the odd ones): its state as
    the health loop sees it, CPU use, GPU use where any rank's is known, step and rate where the job prints them, and
    its last line with how long ago it came, cut to the width. RANK and NODE widen for rank 10000 and node1000 on."""
    if not health.ranks and not health.nodes:
        return []
    gpus = any(row.gpu_util is not None or row.gpu_memory is not None for row in health.ranks.values())
    wide = max((len(str(rank)) for rank in health.ranks), default=4)
    named = max((len(row.node) for row in health.ranks.values()), default=7)
    rank_w, node_w = max(4, wide), max(7, named)
    head = f"  {'RANK':>{rank_w}} {'NODE':<{node_w}} {'HOST':<12} {'STATE':<24} {'CPU':>5}" + \
        (f" {'GPU':>4} {'GPU MEM':>8}" if gpus else "") + f" {'STEP':>7} {'STEP/S':>7}  LAST LINE"
    rows = [head] if health.ranks else []
    for rank, row in sorted(health.ranks.items()):
        cpu = "-" if row.cpu is None else f"{100 * row.cpu:.0f}%"
        gpu = "-" if row.gpu_util is None else f"{row.gpu_util:.0f}%"
        memory = "-" if row.gpu_memory is None else f"{row.gpu_memory / 2**30:.1f}GiB"
        step = "-" if row.step is None else str(row.step)
        rate = "-" if row.step_rate is None else f"{row.step_rate:.3g}"
        line = "-" if row.last_line is None else \
            f"{_age(max(0.0, now - (row.last_line_at or now)))} ago: {row.last_line}"
        text = (f"  {rank:>{rank_w}} {row.node:<{node_w}.{node_w}} {row.host:<12.12} {row.state:<24.24} {cpu:>5}"
                + (f" {gpu:>4} {memory:>8}" if gpus else "") + f" {step:>7} {rate:>7}  {line}")
        rows.append(text[:width])
    stale = now - (health.t or now)
    if stale > STALE_SECONDS:
        rows.append(f"  (the watch last wrote this {stale:.0f} s ago: its controller may be busy or gone)")
    return rows


def _verdict_lines(summary: RunSummary) -> list[str]:
    """The health watch's verdicts during the run (a hang is also its attempt's first failure)."""
    return [f"  at {time.strftime('%H:%M:%S', time.localtime(event.at))}"
            + (f" (attempt {attempt.attempt})" if len(summary.attempts) > 1 else "") + f": {event.text}"
            for attempt in summary.attempts for event in attempt.health]


def ended_after(node: RecordedNode, failure: Failure | None) -> float:
    """The seconds after its attempt's start that a node's end says: its failure's (the one figure the stream and
    the record give it: a hang's is when it was found), else when the node ended."""
    return failure.after_s if failure is not None else node.duration_s


def recorded_end(node: RecordedNode, failure: Failure | None, status: RunStatus) -> str:
    """How a node of an ended run ended: its failing rank's own code (torchrun's is 1), or the harness's
    stop when it did not fail by itself."""
    if failure is not None and failure.kind is FailureKind.SLOW:
        return f"stopped for its slowness: rank {failure.rank} slowed the job (restarts.on: slow)"
    if failure is not None:
        return "failed: " + (f"rank {failure.rank} " if failure.rank is not None else "") + failure.description
    if node.exit_code == 0:
        return "succeeded (exit 0)"
    why = {RunStatus.STOPPED: "by `harness stop`", RunStatus.INTERRUPTED: "on Ctrl-C or SIGTERM to the controller"}
    how = node.error or f"torchrun's {node.describe()}"
    return f"stopped {why.get(status, 'by the harness after the first failure')} ({how})"


def _status_words(state: RunState, status: RunStatus, run: RunDir) -> str:
    """The run's status; an unwatched run's with how long and how to take it back."""
    since = unwatched_for(state, run) if status is RunStatus.UNWATCHED else None
    if since is None:
        return status.value
    return (f"running, unwatched for {since:.0f} s (its controller is gone; its nodes run on, held up to "
            f"{state.grace:g} s: `harness attach {run.run_id}`)")


def unrecorded_end(state: RunState, status: RunStatus, node_rank: int) -> str:
    """A node of a run without a summary: running while its controller is, else what this machine's
    process table shows of it (a local run's nodes run here; a remote node's agent stops it once the
    controller's connection closes)."""
    if status is RunStatus.RUNNING:
        return "running"
    if status is RunStatus.UNWATCHED:
        return "running, held by its node agent until a controller takes it back"
    if state.mode != "local":
        return f"{status.value}: its controller is gone, so its end is not recorded (its node agent stops it when " \
               f"the controller's connection closes)"
    left = run_processes(state.run_id, str(node_rank), str(state.attempt))
    if left:
        return f"{len(left)} process(es) of it still running without a controller: `harness stop {state.run_id}` " \
               f"ends them"
    if status is RunStatus.LOST:
        return "lost (its controller was killed; no process of it is left)"
    if status is RunStatus.STOPPED:
        return "stopped by `harness stop` after its controller was lost; no process of it is left"
    return f"ended with its controller ({status.value}); no process of it is left"


def _attempt_line(attempt: Attempt, resized: bool) -> str:
    slow = attempt.kind is FailureKind.SLOW and bool(attempt.failures)
    text = f"  attempt {attempt.attempt} on {attempt.where(resized)}: " + \
        (_slow_stop_words(attempt) if slow else attempt.status.value)
    if attempt.failures and attempt.kind is not None and not slow:
        cause = attempt.failures[0]
        text += f" ({attempt.kind.value}: node{cause.node_rank} on {cause.host}, {cause.evidence})"
    if attempt.ended_by:
        text += f"; ended by {attempt.ended_by}"
    if attempt.down:
        text += f"; took {', '.join(attempt.down)} out" if slow else f"; lost {', '.join(attempt.down)}"
    if attempt.restart is not None:
        text += f"\n    {attempt.restart.describe()}"
    return text


def _slow_stop_words(attempt: Attempt) -> str:
    """`stopped for sim1's slowness (rank 1 on node1: the job at 0.51x its pace before)`: the harness's own stop, the
    weighing that chose it said in full among the verdicts."""
    cause = attempt.failures[0]
    weighed = next((e for e in attempt.health if e.kind is HealthEventKind.WEIGHED and e.acted), None)
    ratio = None if weighed is None or weighed.since is None else \
        Slowdown(weighed.since, weighed.pace_before, weighed.pace_now).ratio
    pace = "" if ratio is None else f": the job at {ratio:.2f}x its pace before"
    return f"stopped for {cause.host}'s slowness (rank {cause.rank} on node{cause.node_rank}{pace})"


def status_text(runs_dir: str | None, run_id: str | None) -> str:
    """runs_dir: --runs-dir, None when not given."""
    lookup = runs_lookup(runs_dir)
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else UNCUT  # a pipe gets whole lines
    return runs_table(lookup) if run_id is None else run_details(lookup.find(run_id), width)
