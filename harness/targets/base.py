"""The backend interface: what every backend implements, and the node process contract.

Two shapes of backend (docs/architecture.md):
- controller-supervised (`Backend`): the harness starts every node itself, each under the node
  agent, and supervises it (local processes, SSH hosts, later srun steps in an allocation);
- scheduler-owned: a batch system owns the processes (Kubernetes, sbatch), so there is no node
  to signal. Such a backend will offer `submit(spec, run_id) -> job id`, `describe(job id) ->
  phase + reason`, `logs(job id) -> lines` and `cancel(job id)`, and the controller follows the
  job's phase instead of supervising nodes. None exists yet (Kubernetes is render-only).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.errors import HarnessError
from harness.plan.planner import NodePlan, Plan
from harness.spec.job import JobSpec


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


class NodeProcess(Protocol):
    """One started node (a torchrun agent under the node agent), whatever backend runs it."""

    node: NodePlan

    def output(self) -> Iterator[str]:
        """Lines of the node's combined stdout/stderr until its output ends."""

    def wait(self) -> Outcome:
        """Block until the node has ended."""

    def terminate(self) -> None:
        """Ask the node's processes to stop (SIGTERM to its process group)."""

    def kill(self) -> None:
        """Force every process of the node to end (SIGKILL, a sweep by run id, the node's cleanup)."""


class CheckFailed(HarnessError):
    """The backend's pre-start check found a problem: nothing was started (exit status 1).
    hosts: the hosts the problem is on, which a spare may replace (none: the job itself is at fault)."""

    def __init__(self, message: str, hosts: frozenset[str] = frozenset()) -> None:
        super().__init__(message)
        self.hosts = hosts


class Backend(Protocol):
    """A controller-supervised backend. The run controller calls, in order:
    plan -> check -> start -> (supervision) -> close, and close also after a failure."""

    name: str  # recorded as the run's mode: "local", "ssh"

    def plan(self, spec: JobSpec, run_id: str, log_dir: Path | None = None, attempt: int = 0,
             down: frozenset[str] = frozenset()) -> Plan:
        """The exact per-node commands on this backend (pure apart from facts read once: GPUs, DNS), for
        attempt number `attempt`, on hosts other than `down` (spares take their place; NoSpareHosts
        when too few are left). A backend with one machine has no hosts to avoid."""

    def check(self, plan: Plan, spec: JobSpec) -> Plan:
        """Prove what is cheap to prove before anything starts; raise CheckFailed or UsageError. Returns
        the plan to start: this one, or with what the check found pinned (SSH: the network interface)."""

    def start(self, plan: Plan, spec: JobSpec) -> list[NodeProcess]:
        """Start every node, or none: if one cannot start, the ones already started are killed."""

    def close(self) -> None:
        """Release what start opened (connections); the nodes have ended by then. Called after every
        attempt: the next attempt starts afresh."""
