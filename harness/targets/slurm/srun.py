"""Inside a Slurm allocation (salloc, or a batch script that runs the harness): every node an `srun`
step on one node of the allocation, under the node agent and the normal supervisor.

The allocation is the inventory: its nodes in Slurm's order, the first the master, nodes beyond nnodes
spares. srun carries the agent's stdin and stdout as an SSH channel does, so a controller that dies
closes the agent's stdin and the agent stops its node; `harness stop`, Ctrl-C, restarts and the run
record are the controller's, as on every controller-supervised backend.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.plan.planner import NodePlan, Plan, plan_hosts, take_healthy
from harness.spec.inventory import Host
from harness.spec.job import JobSpec
from harness.spec.secrets import secret_values
from harness.targets.address import Unresolvable, is_loopback, resolve_ip
from harness.targets.agent_link import ChildAgentNode, agent_argv, agent_env, start_all
from harness.targets.base import CheckFailed, NodeProcess
from harness.targets.host_command import CommandResult, NoFreePort, free_port_on
from harness.targets.slurm.client import SlurmClient

# Why an srun step starts cold: a standby would be a step of its own, holding the node's CPUs for the whole attempt.
NO_STANDBY = "under Slurm a standby would be a step of its own holding the node's CPUs (srun --overlap)"

SRUN_KILL_SECONDS = 5.0  # after the KILL word, how long srun may take to end with its step before it is killed


def slurm_machine(node: str) -> str:
    """A Slurm node as the hosts kept out name its machine (record/hosts_out.py): the node's name is the machine,
    cluster-wide; a requeue and the next submission exclude it (sbatch --exclude)."""
    return f"{node} (slurm)"


def in_allocation(env: Mapping[str, str]) -> bool:
    """Whether this process runs inside a Slurm job (salloc, sbatch): then its nodes are ours to use."""
    return bool(env.get("SLURM_JOB_ID")) and bool(env.get("SLURM_JOB_NODELIST"))


def _ipv4(name: str, address: str) -> str:
    """The node's IPv4 address, from Slurm's NodeAddr or, when that is a name, from the resolver."""
    try:
        ip, _ = resolve_ip(address, ipv4_only=True)
    except Unresolvable as exc:
        raise UsageError(f"Slurm node {name}: its address {address!r} does not resolve here ({exc}); "
                         f"fix its DNS or /etc/hosts entry") from None
    if is_loopback(ip):
        raise UsageError(f"Slurm node {name} resolves to {ip}, a loopback address the other nodes cannot reach; "
                         f"fix its /etc/hosts or DNS entry")
    return ip


class SrunAgentNode(ChildAgentNode):
    """The agent as the one task of an srun step on its node; srun is the controller's child."""

    def __init__(self, node: NodePlan, allocation: Allocation, python: str) -> None:
        # The agent's identity goes to the task only: srun itself, on this machine, must not look like a
        # process of the node to a sweep (the agent sweeps its node's processes when it ends).
        identity = ",".join(f"{key}={value}" for key, value in agent_env(node).items())
        srun = allocation.step(node.host, f"--job-name={node.env['HARNESS_RUN_ID']}-node{node.node_rank}",
                               f"--export=ALL,{identity}")
        super().__init__(node, [*srun, *agent_argv(python, node)], os.environ)

    def _wait_agent(self) -> str:
        how = self._child_ended()
        return f"srun step on {self.node.host} ended ({how}) without the node's end: the node or its step is gone"

    def _agent_lost(self) -> None:
        """srun has ended already; Slurm ends what is left of its step."""

    def kill(self) -> None:
        """Also end srun, unless it ends by itself first: when its node is lost (slurmstepd gone), srun may wait
        for it forever. A live agent kills its node on the KILL word and says so before its step ends: killing
        srun at once would lose that word, and a node our own stop ended would read as a host lost."""
        super().kill()
        threading.Thread(target=self._end_srun, daemon=True).start()

    def _end_srun(self) -> None:
        try:
            self._proc.wait(timeout=SRUN_KILL_SECONDS)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # a live agent then sees its stdin close and stops its node


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in: its id, its nodes in Slurm's order, and their addresses."""

    job_id: str
    nodes: list[str]
    addresses: dict[str, str]  # NodeAddr: often the name itself

    @classmethod
    def from_env(cls, env: Mapping[str, str], client: SlurmClient | None = None) -> Allocation:
        client = client or SlurmClient()
        nodes = client.hostnames(env["SLURM_JOB_NODELIST"])
        return cls(env["SLURM_JOB_ID"], nodes, client.node_addresses(nodes))

    def hosts(self, names: list[str], spec: JobSpec | None) -> list[Host]:
        """The nodes as hosts: the job's python and workdir (default: this directory, which a Slurm
        cluster shares with its nodes), its GPUs per node."""
        python = spec.slurm.python if spec else "python3"
        workdir = (spec.slurm.workdir if spec else None) or str(Path.cwd())
        gpus = spec.resources.gpus if spec else None
        return [Host(name=name, address=_ipv4(name, self.addresses.get(name, name)), python=python, workdir=workdir,
                     gpus=gpus) for name in names]

    def step(self, node: str, *options: str) -> list[str]:
        """The srun command line that runs one task on node, as a step of this allocation."""
        return ["srun", f"--jobid={self.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--quiet",
                *options]

    def too_small(self, nnodes: int) -> UsageError | None:
        if len(self.nodes) >= nnodes:
            return None
        return UsageError(f"allocation {self.job_id} has {len(self.nodes)} node(s) ({', '.join(self.nodes)}) but the "
                          f"job needs nnodes={nnodes}; ask for them (salloc --nodes={nnodes}) or lower nnodes")


class SrunBackend:
    """nnodes of the allocation's nodes, each an srun step; spares are the allocation's other nodes."""

    name = "srun"
    standbys_await_check = True

    def __init__(self, allocation: Allocation) -> None:
        self.allocation = allocation

    def pool(self, spec: JobSpec) -> list[str]:
        return list(self.allocation.nodes)

    def machines(self) -> dict[str, str]:
        return {name: slurm_machine(name) for name in self.allocation.nodes}

    def plan(self, spec: JobSpec, run_id: str, attempt: int = 0, down: frozenset[str] = frozenset()) -> Plan:
        nodes = self.allocation.nodes
        if (error := self.allocation.too_small(spec.nnodes)) is not None:
            raise error
        names = take_healthy(spec, nodes, down, what="node", pool=f"allocation {self.allocation.job_id}'s",
                             fix="ask for more nodes (salloc --nodes) or lower nnodes")
        hosts = self.allocation.hosts(names, spec)
        return plan_hosts(spec, hosts, run_id=run_id, master_ip=hosts[0].address, attempt=attempt)

    def check(self, plan: Plan, spec: JobSpec) -> Plan:
        """Nothing more to prove cheaply: Slurm granted these nodes, and srun reports what it cannot start.
        The interface stays as planned (network.interface, or unpinned: `harness preflight` reports it).
        master_port auto: a port the master node finds free, asked in a step there."""
        if spec.master_port != "auto":
            return plan
        hosts = [node.ssh for node in plan.nodes if node.ssh is not None]
        try:
            port = free_port_on(_Step(self.allocation, hosts[0]), spec.timeouts.connect)
        except (NoFreePort, subprocess.TimeoutExpired, OSError) as exc:
            raise CheckFailed(str(exc), frozenset({hosts[0].name})) from None
        return plan_hosts(spec.at_port(port), hosts, run_id=plan.run_id, master_ip=plan.master_addr,
                          attempt=plan.attempt)

    def start(self, plan: Plan, spec: JobSpec) -> list[NodeProcess]:
        return start_all(plan.nodes, lambda node: SrunAgentNode(node, self.allocation, node.argv[0]), spec,
                         secrets=secret_values(spec), no_standby=NO_STANDBY)

    def stand_by(self, spec: JobSpec, run_id: str, attempt: int, down: frozenset[str],
                 plan: Plan | None = None) -> None:
        """None here (NO_STANDBY): each attempt's steps start afresh."""

    def stand_down(self) -> None:
        """No standby to end."""

    def attach(self, plan: Plan, spec: JobSpec, resume: Mapping[int, int]) -> list[NodeProcess]:
        """Not here: the batch step is the controller and the allocation's owner at once; Slurm ends the steps with
        it (docs/slurm.md)."""
        raise UsageError("the steps of a Slurm batch job are not taken back: Slurm ends them with its batch step")

    def close(self) -> None:
        """Nothing to release: each srun ends with its step."""


@dataclass(frozen=True)
class _Step:
    """A command run to its end as a step on one node of the allocation (beside any running step)."""

    allocation: Allocation
    host: Host

    def run(self, command: str, *, stdin: bytes = b"", timeout: float) -> CommandResult:
        step = self.allocation.step(self.host.name, "--overlap", f"--job-name=harness-{self.host.name}")
        done = subprocess.run([*step, "sh", "-c", command], input=stdin, capture_output=True, timeout=timeout)
        return CommandResult(done.returncode, done.stdout.decode(errors="replace"),
                             done.stderr.decode(errors="replace"))
