"""Runs that survive failures, the rules: what a failure is, whether to restart and after how long,
restarts in the spec, and spares in place of down hosts (real restarts: tests/integration/test_recovery.py)."""

from __future__ import annotations

import signal
from collections import deque

import pytest

from harness.control.live import LiveNode
from harness.control.recovery import (
    DISK_HINT,
    OOM_HINT,
    attempt_failures,
    attempt_kind,
    backoff_seconds,
    no_restart_reason,
    repeated_failure,
)
from harness.control.results import failure_of, summary_error
from harness.errors import SpecError
from harness.plan.planner import NodePlan, NoSpareHosts, job_hosts
from harness.record.schema import Attempt, Failure, FailureKind, RunStatus
from harness.spec.inventory import load_inventory
from harness.spec.job import MAX_BACKOFF, Restarts, load_job
from harness.targets.base import Outcome

# --- what a failure is -------------------------------------------------------------------------------

# torchrun's own report for a worker that failed by itself (rank 1 here), as it prints it.
ROOT_CAUSE = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_16:38:57
  host      : localhost
  rank      : {rank} (local_rank: 0)
  exitcode  : {code} (pid: 5990)
  error_file: <N/A>"""
GLOO_PEER = ("[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:23772: "
             "Connection reset by peer.")


def record(node_rank: int, outcome: Outcome, ended: float, lines: list[str] = (), *, rank: int | None = None,
           code: int | None = None) -> LiveNode:
    node = NodePlan(host=f"h{node_rank + 1}", address="10.0.0.1", node_rank=node_rank, nproc=1, argv=("x",), env={})
    tail = list(lines) + (ROOT_CAUSE.format(rank=rank, code=code).splitlines() if rank is not None else [])
    return LiveNode(node, started=0.0, ended=ended, outcome=outcome, tail=deque(tail))


def test_a_killed_worker_is_infra_and_the_peer_error_it_caused_is_a_consequence():
    """The peer's gloo error often arrives first; the cause is still the rank killed by SIGKILL."""
    peer = record(0, Outcome(1), ended=1.0, lines=[GLOO_PEER], rank=0, code=1)
    killed = record(1, Outcome(1), ended=1.2, rank=1, code=-9)
    failures = attempt_failures([peer, killed], stopping_since=1.0)
    assert [(f.live.node.node_rank, f.kind, f.consequence) for f in failures] == [
        (1, FailureKind.INFRA, False), (0, FailureKind.PROGRAM, True)]
    assert failures[0].evidence == "rank 1 killed by SIGKILL"
    assert attempt_kind(failures) is FailureKind.INFRA


def test_a_rank_gloo_aborts_after_its_peer_failed_is_a_consequence_not_infra():
    """Seen on a busy machine: rank 1 exits 1 on purpose; gloo aborts rank 0 (SIGABRT) 30 ms later, before
    the supervisor's stop. The program failed; rank 0's abort is what followed."""
    failed = record(1, Outcome(1), ended=1.0, lines=["[rank1]: rank 1 failing on purpose at step 3"], rank=1, code=1)
    aborted = record(0, Outcome(1), ended=1.03, lines=[GLOO_PEER, "[rank0]: terminate called without an active "
                                                                  "exception"], rank=0, code=-signal.SIGABRT)
    failures = attempt_failures([aborted, failed], stopping_since=1.05)
    assert [(f.live.node.node_rank, f.kind, f.consequence) for f in failures] == [
        (1, FailureKind.PROGRAM, False), (0, FailureKind.PROGRAM, True)]
    assert failures[1].evidence.startswith("rank 0 killed by SIGABRT after losing a peer: ")
    assert attempt_kind(failures) is FailureKind.PROGRAM


def test_a_node_the_stop_ended_after_gloo_aborted_its_rank_is_a_consequence():
    """The same race, later: the supervisor's TERM ended node 0's torchrun (SIGTERM) after gloo had aborted
    its rank 0; torchrun's report names rank 0. The stop's own signal is no infra failure."""
    failed = record(1, Outcome(1), ended=1.0, lines=["[rank1]: rank 1 failing on purpose at step 3"], rank=1, code=1)
    lines = [GLOO_PEER, "[rank0]: terminate called without an active exception"]
    stopped = record(0, Outcome(None, signal=signal.SIGTERM), ended=1.04, lines=lines, rank=0, code=-signal.SIGABRT)
    failures = attempt_failures([stopped, failed], stopping_since=1.01)
    assert [(f.live.node.node_rank, f.kind, f.consequence) for f in failures] == [
        (1, FailureKind.PROGRAM, False), (0, FailureKind.PROGRAM, True)]
    assert attempt_kind(failures) is FailureKind.PROGRAM
    killed = record(0, Outcome(None, signal=signal.SIGKILL), ended=0.5, rank=0, code=-signal.SIGKILL)
    assert attempt_failures([killed], stopping_since=1.01)[0].evidence == "torchrun killed by SIGKILL"


def test_a_peer_lost_to_the_stop_that_followed_a_hangs_verdict_is_no_failure():
    """A hang's verdict stops every node; one node's end breaks a peer's gloo connection before the TERM reaches
    that peer, which exits 1 "after losing a peer". The hang is the attempt's one failure: the peer lost its
    connection to the stop. Stopped on a node's own failure instead, that peer is its consequence, as before."""
    peer = record(0, Outcome(1), ended=2.1, lines=[GLOO_PEER], rank=0, code=1)
    aborted = record(2, Outcome(1), ended=2.2, lines=[GLOO_PEER.replace("rank0", "rank2")], rank=2,
                     code=-signal.SIGABRT)
    stopped = record(1, Outcome(None, signal=signal.SIGTERM), ended=2.3)
    assert attempt_failures([peer, aborted, stopped], stopping_since=2.0, verdict=True) == []
    failures = attempt_failures([peer, aborted, stopped], stopping_since=2.0)
    assert [(f.live.node.node_rank, f.consequence) for f in failures] == [(0, True), (2, True)]
    early = record(0, Outcome(1), ended=1.5, lines=[GLOO_PEER], rank=0, code=1)  # before the stop: its own
    assert [f.live.node.node_rank for f in attempt_failures([early], stopping_since=2.0, verdict=True)] == [0]


def test_a_lost_host_is_infra_and_marks_the_host_down():
    lost = record(1, Outcome(None, error="connection to h2 (10.0.0.2) lost (ssh status -1)"), ended=2.0)
    [failure] = attempt_failures([lost], stopping_since=None)
    assert (failure.kind, failure.host_down, failure.evidence) == (FailureKind.INFRA, True, lost.outcome.error)


def test_an_exception_is_a_program_failure():
    raised = record(1, Outcome(1), ended=1.0, lines=["[rank1]: ValueError: bad batch"], rank=1, code=1)
    [failure] = attempt_failures([raised], stopping_since=None)
    assert (failure.kind, failure.evidence) == (FailureKind.PROGRAM, "rank 1 exit code 1")
    assert attempt_kind([failure]) is FailureKind.PROGRAM


def test_nodes_the_supervisor_stopped_are_not_failures():
    """After the stop began, a node without a worker failure of its own only obeyed the stop (torchrun
    ends with a SignalException on TERM; a KILL after the grace leaves no report at all)."""
    cause = record(1, Outcome(1), ended=1.0, lines=["[rank1]: ValueError: x"], rank=1, code=1)
    stopped = record(0, Outcome(1), ended=1.5, lines=[
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 5960 got signal: 15"])
    killed = record(2, Outcome(None, signal=signal.SIGKILL), ended=4.0)
    # The stop's TERM reaches the whole process group; torchrun saw its worker end by it before its own.
    termed = record(3, Outcome(1), ended=1.4, lines=[GLOO_PEER.replace("rank0", "rank3")], rank=3,
                    code=-signal.SIGTERM)
    failures = attempt_failures([stopped, cause, killed, termed], stopping_since=1.0)
    assert [f.live.node.node_rank for f in failures] == [1]
    assert attempt_kind(failures) is FailureKind.PROGRAM


def test_a_signal_before_the_stop_and_a_rendezvous_timeout_are_infra():
    killed = record(0, Outcome(None, signal=signal.SIGKILL), ended=0.5)
    timeout = record(1, Outcome(1), ended=0.6, rank=1, code=1, lines=[
        "[rank1]: torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined."])
    failures = attempt_failures([killed, timeout], stopping_since=None)
    assert [(f.kind, f.evidence.split(":")[0]) for f in failures] == [
        (FailureKind.INFRA, "torchrun killed by SIGKILL"), (FailureKind.INFRA, "rendezvous timed out")]


def test_only_lost_peers_means_a_peer_vanished():
    """Every node reports a lost peer and none a cause: the cause left no trace (a host cut off)."""
    failures = attempt_failures([record(0, Outcome(1), ended=1.0, lines=[GLOO_PEER], rank=0, code=1)], None)
    assert attempt_kind(failures) is FailureKind.INFRA


# gloo's own words when ranks pair different collectives (torch 2.15, two ranks, all_reduce of 3 vs 5 floats).
GLOO_MISMATCH = [
    "[rank1]: terminate called after throwing an instance of 'gloo::EnforceNotMet'",
    "[rank1]:   what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:464] "
    "op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size. Is there a "
    "distributed collective mismatch in your code?",
]
TRACEBACK = ["[rank1]: Traceback (most recent call last):",
             '[rank1]:   File "/job/train.py", line 12, in step',
             "[rank1]:     batch = next(loader)",
             "[rank1]: ValueError: bad batch"]
# The kernel's record of an OOM kill in a memory cgroup (/dev/kmsg's message, as harness.node.oom returns it).
OOM_LINE = ("Memory cgroup out of memory: Killed process 18307 (python3) total-vm:528572kB, anon-rss:72192kB, "
            "file-rss:6648kB, shmem-rss:0kB, UID:0 pgtables:212kB oom_score_adj:0")


@pytest.mark.parametrize("lines", [
    ["[rank1]: rank 1 up", *GLOO_MISMATCH],
    # torchrun reads a worker's stdout and stderr from two files: a stdout line can fall between the two
    # lines libstdc++ writes to stderr for one exception (a CI run met this).
    [GLOO_MISMATCH[0], "[rank1]: rank 1 up", GLOO_MISMATCH[1]],
], ids=["in-order", "stdout-between"])
def test_a_collective_mismatch_is_the_programs_failure_named_as_such(lines: list[str]) -> None:
    """gloo aborts the rank (SIGABRT): not infra; its peer, which lost it, is the consequence."""
    aborted = record(1, Outcome(1), ended=1.0, lines=lines, rank=1, code=-signal.SIGABRT)
    peer = record(0, Outcome(1), ended=1.02, lines=[GLOO_PEER], rank=0, code=1)
    found = attempt_failures([peer, aborted], stopping_since=1.01)
    assert [(f.live.node.node_rank, f.kind, f.consequence) for f in found] == [
        (1, FailureKind.PROGRAM, False), (0, FailureKind.PROGRAM, True)]
    assert found[0].evidence.startswith("rank 1 killed by SIGABRT: a collective mismatch: [enforce fail at ")
    assert found[0].evidence.endswith("Is there a distributed collective mismatch in your code?")
    assert attempt_kind(found) is FailureKind.PROGRAM
    failure = failure_of(found[0], started_at=0.0, now=1.1)
    assert failure.error is not None and failure.error.startswith("gloo::EnforceNotMet: [enforce fail at ")
    assert failure.description == "killed by SIGABRT" and summary_error(failure, None) == failure.error


def test_the_users_exception_is_program_even_when_a_signal_ended_the_rank():
    """SIGABRT after a traceback (gloo's threads abort a dying interpreter) follows from the exception;
    SIGKILL comes from outside (a person, the OOM killer): the kill is the cause."""
    aborted = record(1, Outcome(1), ended=1.0, lines=TRACEBACK, rank=1, code=-signal.SIGABRT)
    [failure] = attempt_failures([aborted], stopping_since=None)
    assert (failure.kind, failure.evidence) == (
        FailureKind.PROGRAM, "rank 1 raised ValueError: bad batch at /job/train.py:12, in step, then was killed by "
                             "SIGABRT")
    killed = record(1, Outcome(1), ended=1.0, lines=TRACEBACK, rank=1, code=-signal.SIGKILL)
    assert attempt_failures([killed], stopping_since=None)[0].kind is FailureKind.INFRA


def test_a_rank_the_oom_killer_ended_is_named_with_the_kernels_line_and_a_hint():
    node = record(1, Outcome(1), ended=1.0, lines=["[rank1]: step 3"], rank=1, code=-signal.SIGKILL)
    node.oom[1] = OOM_LINE
    [found] = attempt_failures([node], stopping_since=None)
    assert (found.kind, found.evidence) == (FailureKind.INFRA, f"rank 1 killed by the kernel's OOM killer: {OOM_LINE}")
    failure = failure_of(found, started_at=0.0, now=1.1)
    assert failure.hint == OOM_HINT and "lower the batch size" in failure.hint
    node.oom.clear()  # no record of the kernel's: an ordinary kill
    assert attempt_failures([node], stopping_since=None)[0].evidence == "rank 1 killed by SIGKILL"


@pytest.mark.parametrize("said", [
    "[rank1]: RuntimeError: [enforce fail at inline_container.cc:671] . unexpected pos 1664 vs 1568",
    "[rank1]: OSError: [Errno 28] No space left on device: '/ckpt/step-3.pt'",
    "[rank1]: OSError: [Errno 30] Read-only file system: '/ckpt/step-3.pt'",
    "[rank1]: harness.payload.checkpoint.DiskError: [Errno 28] checkpoint: cannot save step 2 in /ckpt: its file "
    "system is full (0 B free of 1.0 MiB; the checkpoint takes 206 KiB)",
])
def test_a_rank_whose_disk_is_full_or_read_only_is_infra_with_a_hint_whatever_the_words(said: str) -> None:
    node = record(1, Outcome(1), ended=1.0, lines=["[rank1]: Traceback (most recent call last):", said], rank=1,
                  code=1)
    [found] = attempt_failures([node], stopping_since=None)
    assert (found.kind, found.evidence, found.hint) == (
        FailureKind.INFRA, f"rank 1 exit code 1: a disk it writes to is full or read-only: {said[9:]}", DISK_HINT)


def test_a_failed_runs_summary_error_is_never_empty():
    raised = failure_of(attempt_failures([record(1, Outcome(1), ended=1.0, lines=TRACEBACK, rank=1, code=1)],
                                         None)[0], 0.0, 1.0)
    assert summary_error(raised, "restarts are off") == "ValueError: bad batch"
    killed = failure_of(attempt_failures([record(1, Outcome(1), ended=1.0, rank=1, code=-9)], None)[0], 0.0, 1.0)
    assert summary_error(killed, None) == "rank 1 killed by SIGKILL"
    assert summary_error(None, "attempt 1 could not start: host(s) down") == "attempt 1 could not start: host(s) down"


def _attempt(kind: FailureKind, failure: Failure | None = None) -> Attempt:
    return Attempt(attempt=0, hosts=["h1"], status=RunStatus.FAILED, started_at=0, ended_at=1, nodes=[],
                   failures=[failure] if failure else [], kind=kind, down=[], preflight_s=0)


def _failure(kind: FailureKind, evidence: str, error: str | None = None, error_at: str | None = None) -> Failure:
    return Failure(node_rank=1, host="h2", ranks=[1], rank=1, rank_exit_code=1, exit_code=1, description="exit code 1",
                   after_s=1.0, last_lines=[], kind=kind, evidence=evidence, error=error, error_at=error_at)


HANG = "hang: rank 1 (node1, h2) in time.sleep at train.py:42 in load_batch; rank 0 waits in all_reduce at train.py:55"
MISMATCH = ("rank 1 killed by SIGABRT: a collective mismatch: [enforce fail at gloo/transport/tcp/pair.cc:464] "
            "op.preamble.length <= op.nbytes. 8 vs 4.")


@pytest.mark.parametrize(("on", "first", "second", "expected"), [
    # the same hang twice, under on: [infra, hang]: a third attempt hangs there again
    ("[infra, hang]", _failure(FailureKind.HANG, HANG), _failure(FailureKind.HANG, HANG),
     f"the same failure at the same place twice: {HANG}"),
    ("[infra, hang]", _failure(FailureKind.HANG, HANG), _failure(FailureKind.HANG, HANG.replace(":42", ":43")), None),
    # the same exception at the same frame of the user's code (its message may differ: sizes, addresses)
    ("any", _failure(FailureKind.PROGRAM, "rank 1 exit code 1", "ValueError: bad batch 7", "train.py:12, in step"),
     _failure(FailureKind.PROGRAM, "rank 1 exit code 1", "ValueError: bad batch 9", "train.py:12, in step"), None),
    ("[infra, hang]",
     _failure(FailureKind.INFRA, "rank 1 killed by SIGSEGV", "ValueError: bad batch 7", "train.py:12, in step"),
     _failure(FailureKind.INFRA, "rank 1 killed by SIGSEGV", "ValueError: bad batch 9", "train.py:12, in step"),
     "the same failure at the same place twice: ValueError at train.py:12, in step"),
    # evidence naming a place in source code
    ("infra", _failure(FailureKind.INFRA, MISMATCH), _failure(FailureKind.INFRA, MISMATCH),
     f"the same failure at the same place twice: {MISMATCH}"),
    # a kill names no place: it may well not happen again
    ("infra", _failure(FailureKind.INFRA, "rank 1 killed by SIGKILL"), _failure(FailureKind.INFRA,
                                                                                "rank 1 killed by SIGKILL"), None),
])
def test_the_same_failure_at_the_same_place_twice_is_not_restarted_again(on, first, second, expected):
    """Under on: any the program's failures are retried by request; the place is still found."""
    restarts = Restarts(max=3, on=on.strip("[]").split(", ") if on.startswith("[") else on)
    attempts = [_attempt(first.kind, first), _attempt(second.kind, second)]
    assert no_restart_reason(restarts, attempts) == expected
    if on == "any":
        assert repeated_failure(attempts) == "ValueError at train.py:12, in step"


@pytest.mark.parametrize(("restarts", "kinds", "expected"), [
    (Restarts(), [FailureKind.INFRA], "restarts are off"),
    (Restarts(max=2), [FailureKind.INFRA], None),
    (Restarts(max=2), [FailureKind.PROGRAM], "the program failed (not the infrastructure), and restarts.on is infra: "
                                             "a job spec with `restarts: {on: any}` (`--save-job` writes one) retries "
                                             "every kind"),
    (Restarts(max=2, on="any"), [FailureKind.PROGRAM], None),
    (Restarts(max=2), [FailureKind.INFRA, FailureKind.INFRA], None),
    (Restarts(max=2), [FailureKind.INFRA] * 3, "every restart is used up (restarts.max: 2)"),
])
def test_restart_decision(restarts, kinds, expected):
    reason = no_restart_reason(restarts, [_attempt(k) for k in kinds])
    assert reason == expected or (expected is not None and reason is not None and reason.startswith(expected))


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_seconds(Restarts(backoff=5), n) for n in range(3)] == [5, 10, 20]
    assert backoff_seconds(Restarts(backoff=200), 3) == MAX_BACKOFF


# --- the spec and the spares -------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("max_restarts: 2\n", "job.yaml:4:1: max_restarts: max_restarts (torchrun's per-node restarts) is not used"),
    ("restarts: {max: -1}\n", "restarts.max: Input should be greater than or equal to 0"),
    ("restarts: {on: crash}\n", "restarts.on: expected one of infra, hang, program, slow or any, or a list of them, e.g. [infra, hang], got 'crash'"),
    ("restarts: {backoff: .inf}\n", "restarts.backoff: expected a finite number of seconds"),
    ("restarts: {max: 1, retries: 2}\n", "restarts.retries: unknown key 'retries'"),
])
def test_bad_restarts_are_located(write_yaml, text, expected):
    with pytest.raises(SpecError) as caught:
        load_job(write_yaml("name: a\nnnodes: 2\nentrypoint: {module: m}\n" + text))
    assert expected in str(caught.value)


HOSTS = "hosts:\n" + "".join(f"  - {{name: h{i}, address: 10.0.0.{i}}}\n" for i in range(1, 5))


def test_spares_take_the_place_of_down_hosts_in_file_order(write_yaml):
    spec = load_job(write_yaml("name: a\nnnodes: 2\nentrypoint: {module: m}\n"))
    inventory = load_inventory(write_yaml(HOSTS, "hosts.yaml"))
    assert [h.name for h in job_hosts(spec, inventory)] == ["h1", "h2"]
    assert [h.name for h in job_hosts(spec, inventory, frozenset({"h2"}))] == ["h1", "h3"]
    assert [h.name for h in job_hosts(spec, inventory, frozenset({"h1", "h3"}))] == ["h2", "h4"]  # a new master
    with pytest.raises(NoSpareHosts, match=r"host\(s\) down: h1, h2, h3, and no spare left: .* 1 of the "
                                           r"inventory's 4 is left, not known to be down \(h4\)"):
        job_hosts(spec, inventory, frozenset({"h1", "h2", "h3"}))
