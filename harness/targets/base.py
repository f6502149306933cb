"""The two target interfaces, and the node process contract. One run controller drives both
(harness.control.controller; docs/architecture.md):

- controller-supervised (`Backend`): the harness starts every node itself, each under the node
  agent, and supervises it (simulated nodes, SSH hosts, srun steps inside an allocation);
- scheduler-owned (`Scheduler`): a batch system owns the processes (sbatch), and its job's batch step
  runs the harness's controller on the srun target inside the allocation; the user's controller
  submits, follows what `describe` says and the run's record, and cancels -- the verbs of TorchX's
  Scheduler.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from harness.errors import HarnessError
from harness.node.protocol import Message
from harness.plan.planner import NodePlan, Plan
from harness.spec.job import JobSpec

# The check a local target passes before it starts anything (preflight's fast checks, handed in by whoever
# builds the target: targets never import preflight; SSH hosts' is targets.ssh.backend.HostsCheck). It
# raises CheckFailed; nothing is started.
WorkdirCheck = Callable[[JobSpec, Path], None]
"""The job's files as seen from one working directory of this machine (simulated nodes)."""


@dataclass(frozen=True)
class Outcome:
    """How a node ended: an exit code, or the signal that killed it, or a lost connection/agent."""

    exit_code: int | None
    signal: int | None = None
    error: str | None = None

    @classmethod
    def from_returncode(cls, code: int) -> Outcome:
        """subprocess's convention: a negative code is the signal that ended the process."""
        return cls(exit_code=None, signal=-code) if code < 0 else cls(exit_code=code)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def describe(self) -> str:
        if self.error:
            return self.error
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name}"
        return f"exit code {self.exit_code}"


class Messages(Protocol):
    """Where a node agent's messages go as its output is read: a queue of its own, until the supervisor routes
    every node's to its one listener (control/supervisor.py's heard_as)."""

    def put(self, item: Message, /) -> None: ...


class NodeProcess(Protocol):
    """One started node (a torchrun agent under the node agent), whatever backend runs it."""

    node: NodePlan
    messages: Messages  # the node agent's messages (harness.node.protocol)
    warm: bool  # a standby's: its torchrun and workers were started, imports done, before its attempt (stand_by)
    cold: str  # why it started afresh instead ("": warm, or no reason known)
    # Taken back by `harness attach` (targets/agent_link.py's AgentNode): when its node said the block output() last
    # gave, while its agent replays what it kept unwatched (None: live); that replay's header; set once it is over.
    said_at: float | None
    unwatched: dict[str, float | None] | None
    replayed: threading.Event
    position: int  # where in its agent's stream the blocks output() gave end (record.stream.LoggedMark)

    def output(self) -> Iterator[str | None]:
        """The node's combined stdout/stderr until its output ends, in blocks of whole lines (each ending
        with a newline) as they arrive; None where a driven node has been fed nothing more yet (drive)."""

    def readable(self) -> int | None:
        """A descriptor that a selector may wait on for the node's output (None: it is read on a thread of its own)."""

    def read_ready(self) -> bytes | None:
        """What the node's link holds, once readable() is (b"": it ended; None: nothing whole yet)."""

    def drive(self) -> None:
        """output() takes what feed() gives it from now on, read by the controller's one reading thread."""

    def feed(self, data: bytes) -> None: ...

    def wait(self) -> Outcome:
        """Block until the node has ended."""

    def terminate(self) -> None:
        """Ask the node's processes to stop (SIGTERM to its process group)."""

    def kill(self) -> None:
        """Force every process of the node to end (SIGKILL, a sweep by run id, the node's cleanup)."""

    def request_stacks(self, tag: str) -> None:
        """Ask the node for every rank's stacks: answered as STACKS messages, then STACKS_DONE with TAG."""


class CheckFailed(HarnessError):
    """The backend's pre-start check found a problem: nothing was started (exit status 1).
    hosts: the hosts the problem is on, which a spare may replace (none: the job itself is at fault); unfit:
    those of them whose machine failed (not the job's set-up on it), with the reason."""

    def __init__(self, message: str, hosts: frozenset[str] = frozenset(), unfit: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.hosts = hosts
        self.unfit = unfit or {}  # host -> why the machine itself is unfit (unreachable, a GPU): kept out after


@runtime_checkable
class Announcing(Protocol):
    """A target with words of its own while the run runs (the pod link's refusals), which the controller hands the
    run's stream once it exists: said as the harness's, and kept in the record."""

    def announce_to(self, say: Callable[[str], None]) -> None: ...


class Backend(Protocol):
    """A controller-supervised backend. The run controller calls, in order:
    plan -> check -> start -> (supervision, stand_by) -> close, and close also after a failure; stand_down at
    the run's end. A controller that takes a run back calls plan -> attach instead of check -> start for the
    attempt that runs."""

    name: str  # recorded as the run's mode: "local", "ssh"
    # Whether the first attempt's standbys wait for its check to pass: they run over what the check opens (SSH's
    # connections). Else they start with it, their imports done while it runs.
    standbys_await_check: bool

    def plan(self, spec: JobSpec, run_id: str, attempt: int = 0, down: frozenset[str] = frozenset()) -> Plan:
        """The exact per-node commands on this backend (pure apart from facts read once: GPUs, DNS), for
        attempt number `attempt`, on hosts other than `down` (spares take their place; NoSpareHosts
        when too few are left). A backend with one machine has no hosts to avoid."""

    def pool(self, spec: JobSpec) -> list[str]:
        """The names the next attempt's nodes are taken from, in the order the planner takes them (take_healthy): the
        job's hosts, then its spares. A slow host is weighed against an attempt without it (health/slowdown.py)."""

    def machines(self) -> dict[str, str]:
        """Host name -> the machine it is (address:port), for every host a failure may keep out of later runs
        (record/hosts_out.py); empty where there is nothing to keep out (one machine; Slurm's nodes, for now)."""

    def check(self, plan: Plan, spec: JobSpec) -> Plan:
        """Prove what is cheap to prove before anything starts; raise CheckFailed or UsageError. Returns
        the plan to start: this one, or with what the check found pinned (SSH: the network interface)."""

    def start(self, plan: Plan, spec: JobSpec) -> list[NodeProcess]:
        """Start every node, or none: if one cannot start, the ones already started are killed."""

    def stand_by(self, spec: JobSpec, run_id: str, attempt: int, down: frozenset[str],
                 plan: Plan | None = None) -> None:
        """While an attempt runs, start the next one's nodes as far as they can go without its plan: on each host
        it may use (not down), torchrun and its workers with their imports done, waiting (node/standby.py). plan:
        the first attempt's, before it starts (while it is checked, or once it passed: standbys_await_check): a
        standby for each of its nodes, as that node. start then takes the one on each of its hosts. Nothing is
        raised: a host without a standby starts afresh."""

    def stand_down(self) -> None:
        """End every standby: the run is over."""

    def attach(self, plan: Plan, spec: JobSpec, resume: Mapping[int, int]) -> list[NodeProcess]:
        """Take back the plan's nodes, which run on held by their agents after their controller was lost
        (`harness attach`; supervision.grace): a link to each agent (harness.node.link), which sends its stream
        again from resume[node_rank] (where the run's logs of it end). A node whose agent is gone ends at once,
        lost."""

    def close(self) -> None:
        """Release what start opened (connections); the nodes have ended by then. Called after every
        attempt; what a standby uses stays open for the next one."""


@dataclass(frozen=True)
class Submission:
    """What a scheduler is asked to run, exactly as it will be submitted (a dry run is this value)."""

    text: str  # e.g. the sbatch script
    file_name: str  # kept under this name in the run directory, and submitted from there
    nnodes: int
    world_size: int
    others: dict[str, str] = field(default_factory=dict)  # further files the job reads from the run directory
    notes: tuple[str, ...] = ()  # what the run says before it submits (e.g. the nodes it excludes, and why)
    # Variables the submission adds to the submitting environment, which the scheduler hands the job: values no file
    # of the job may hold (env values whose names look secret, spec/secrets.py). Never shown.
    environment: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def files(self) -> dict[str, str]:
        """Every file to write into the run directory before submission, by name."""
        return {self.file_name: self.text, **self.others}


@dataclass(frozen=True)
class JobStatus:
    """A submitted job as its scheduler describes it, in the scheduler's own words where it has them."""

    state: str  # PENDING, RUNNING, COMPLETED, ...
    reason: str | None  # why it waits, or how it ended; None when nothing holds it
    attempt: int  # the scheduler's restarts (requeues) so far
    hosts: tuple[str, ...]  # its nodes in node-rank order, once it has them
    where: str  # the same in the scheduler's own notation (n[1-2]), as users know it
    finished: bool
    succeeded: bool
    never_starts: str | None = None  # why a pending job can never start
    exit_code: str | None = None


@runtime_checkable
class Scheduler(Protocol):
    """A scheduler-owned target: its job's first step runs the harness's controller in the allocation,
    which writes the run's record. The user's controller calls prepare -> submit, then describe until the
    job has finished (cancel on a stop), reading the record as it grows."""

    name: str  # recorded as the run's mode: "slurm"

    def prepare(self, spec: JobSpec, source: str, run_id: str, run_path: Path) -> Submission:
        """The submission, checked with the scheduler (it can ever run); nothing is submitted. Raises
        CheckFailed or UsageError."""

    def submit(self, submission: Submission, path: Path) -> str:
        """Submit the submission kept at path; the job's id."""

    def describe(self, job_id: str) -> JobStatus: ...

    def own_log(self, run_path: Path, job_id: str) -> Path:
        """Where the job's first step writes its output (the controller's terminal, or why it never ran)."""

    def stop(self, job_id: str) -> None:
        """SIGTERM to the controller in the job: it stops the nodes and writes the record."""

    def cancel(self, job_id: str) -> None: ...
