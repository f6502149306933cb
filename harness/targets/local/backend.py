"""Local backend: simulated nodes, each a torchrun agent on this machine under the node agent.

The nodes rendezvous on 127.0.0.1 exactly as a real cluster does, their torchruns and ranks in a network of the
launch's own (private_net.py: no other user of the machine reaches the job's store). Each agent is a child of the
controller with a pipe on its stdin: when the controller dies, even by SIGKILL, the kernel closes
that pipe and the agent stops its node, as an SSH host's agent does when its connection drops.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from harness.node.gpu import driver_gpu_count
from harness.node.proctable import kill_run_processes
from harness.node.store_port import free_port, is_free
from harness.plan.planner import NodePlan, Plan, local_spec, plan_local, simulated_hosts, take_healthy
from harness.spec.job import JobSpec
from harness.spec.secrets import secret_values
from harness.targets.agent_link import (
    AgentNode,
    ChildAgentNode,
    Standbys,
    agent_argv,
    agent_env,
    attach_all,
    relay_argv,
    start_all,
)
from harness.targets.base import CheckFailed, NodeProcess, WorkdirCheck
from harness.targets.local.private_net import PrivateNetwork


def local_gpu_ids(spec: JobSpec) -> list[str]:
    """The GPUs this machine shows the job (CUDA_VISIBLE_DEVICES respected, as CUDA reads it), for
    split_local_gpus. Asked of the driver (NVML), as torch's own NVML-based check does: importing torch
    here would cost the launch seconds."""
    if spec.backend == "gloo" and spec.nproc_per_node != "auto":
        return []  # nothing to decide
    count = driver_gpu_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(count)]
    shown: list[str] = []
    for device in (d.strip() for d in visible.split(",")):
        # CUDA reads the list up to its first entry that names no device (e.g. -1): that ends it.
        if not (device.startswith(("GPU-", "MIG-")) or (device.isdigit() and int(device) < count)):
            break
        shown.append(device)
    return shown[:count]


class LocalAgentNode(ChildAgentNode):
    """The agent as a child process of the controller."""

    def __init__(self, node: NodePlan, python: str, relay: bool = False) -> None:
        """relay: to the node's agent, which lost its controller (harness.node.link), instead of a new agent."""
        # Not the relay: it has no node identity, or its agent's sweep of the node would end it before its last word.
        super().__init__(node, relay_argv(python, node) if relay else agent_argv(python, node),
                         os.environ if relay else os.environ | agent_env(node))

    def _wait_agent(self) -> str:
        how = self._child_ended()
        return f"node agent (pid {self._proc.pid}) ended with {how} without reporting the node's end"

    def _agent_lost(self) -> None:
        """Killed by hand or by the OOM killer, the agent could not stop its node: sweep it from here, by the node's
        identity and by its standby's, which what a standby started keeps (agent_link.standing_by)."""
        for env in (self.node.env, self.started_as.env):
            kill_run_processes(env["HARNESS_RUN_ID"], env["NODE_RANK"], env["HARNESS_ATTEMPT"])


def _workdirs(plan: Plan) -> list[Path]:
    """The nodes' distinct working directories, made where missing (a node of its own starts empty)."""
    found = [Path(wd) for wd in dict.fromkeys(node.workdir or os.getcwd() for node in plan.nodes)]
    for workdir in found:
        workdir.mkdir(parents=True, exist_ok=True)
    return found


class LocalBackend:
    """nnodes simulated nodes on this machine; the job's script paths are relative to the cwd. python:
    the harness's own interpreter, which runs every node agent (py-spy, for the ranks' stacks, is beside
    it) and, unless the job's simulated.python names another, every node's torchrun."""

    name = "local"
    standbys_await_check = False

    def __init__(self, python: str = sys.executable, check: WorkdirCheck | None = None) -> None:
        self.python = python
        self._check = check
        self._standbys = Standbys()
        self._network = PrivateNetwork(python)
        self._private = True  # the job's choice (simulated.network), taken at its first plan
        self._open: str | None = None  # what is said of a store open to the machine's users, once known
        self._say: Callable[[str], None] = lambda line: None

    def announce_to(self, say: Callable[[str], None]) -> None:
        """A store open to the machine's users is said in the run's stream (base.Announcing), once it has one: the
        first plan comes before it."""
        self._say = say
        if self._open is not None:
            say(self._open)

    def _own_network(self, spec: JobSpec) -> PrivateNetwork | None:
        """The launch's network for the job's nodes; None where they share this machine's (said once)."""
        self._private = spec.simulated.network == "private"
        if self._private and self._network.available():
            return self._network
        if self._open is None:
            why = self._network.reason if self._private else "simulated.network is host"
            self._open = (f"the job's rendezvous store is open to every user of this machine ({why}): torch's store "
                          f"has no authentication (docs/security.md#torchs-rendezvous-store)")
            self._say(self._open)
        return None

    def pool(self, spec: JobSpec) -> list[str]:
        return simulated_hosts(spec.nnodes)

    def machines(self) -> dict[str, str]:
        return {}  # one machine: its simulated nodes are never kept out

    def plan(self, spec: JobSpec, run_id: str, attempt: int = 0, down: frozenset[str] = frozenset()) -> Plan:
        """The job's simulated nodes other than down (nodes whose agent was lost): there are no spares, so
        the attempt runs on fewer of them as restarts.min_nnodes allows."""
        names = take_healthy(spec, simulated_hosts(spec.nnodes), down, what="simulated node", pool="the job's")
        python = spec.simulated.interpreter(os.getcwd(), self.python)
        network = self._own_network(spec)
        if spec.master_port == "auto":  # picked anew for every attempt: the last one's may still be held
            spec = spec.at_port(network.free_port() if network else free_port())
        return plan_local(spec, run_id=run_id, python=python, gpu_ids=local_gpu_ids(spec),
                          local_cpus=len(os.sched_getaffinity(0)), attempt=attempt, cwd=os.getcwd(), hosts=names)

    def check(self, plan: Plan, spec: JobSpec) -> Plan:
        """A missing script, module or data path fails before any node starts, not as N identical
        tracebacks: the check handed in (preflight's fast checks), in every node's working directory (a
        relative script is the launch directory's). A master_port that something holds fails here too,
        not as torch's EADDRINUSE traceback after a peer seemed lost."""
        network = self._own_network(spec)
        if spec.rdzv == "c10d" and network is None:
            why = self._network.reason or "simulated.network is host"
            raise CheckFailed(f"rdzv: c10d needs the job's own network, and {why}: torch's c10d rendezvous loads "
                              f"pickles from its store, which any user of this machine could then write; nothing "
                              f"was started -> fix: rdzv: static (the default; it loads none)")
        if spec.master_port != "auto" and not (network.is_free if network else is_free)(port := spec.master_port):
            where = "in the job's network (an earlier attempt's store)" if network else "on this machine"
            raise CheckFailed(f"master_port {port} is in use {where} (`ss -ltnp 'sport = :{port}'` names what "
                              f"listens there), nothing was started -> fix: leave master_port out (or set it to "
                              f"auto) to have a free port picked, or set another")
        if self._check is not None:
            checked = local_spec(spec, os.getcwd())
            for workdir in _workdirs(plan):
                self._check(checked, workdir)
        return plan

    def start(self, plan: Plan, spec: JobSpec) -> list[NodeProcess]:
        _workdirs(plan)
        return start_all(self._in_network(plan.nodes), self._agent, spec, self._standbys, secret_values(spec),
                         held=True)

    def _in_network(self, nodes: tuple[NodePlan, ...]) -> list[NodePlan]:
        """Each node's torchrun, and so its ranks, in the launch's network; its agent and the job's setup: stay in
        this machine's, so that a setup may download what the job needs (jobs/cifar.yaml's `harness prepare`)."""
        if not (self._private and self._network.available()):
            return list(nodes)
        return [replace(node, enter=self._network.entry(node.argv[0])) for node in nodes]

    def _agent(self, node: NodePlan) -> AgentNode:
        return LocalAgentNode(node, self.python)

    def attach(self, plan: Plan, spec: JobSpec, resume: Mapping[int, int]) -> list[NodeProcess]:
        return attach_all(plan.nodes, lambda node: LocalAgentNode(node, self.python, relay=True), resume)

    def stand_by(self, spec: JobSpec, run_id: str, attempt: int, down: frozenset[str],
                 plan: Plan | None = None) -> None:
        """A standby for each simulated node that attempt would run (plan's: each as its node)."""
        planned = plan or self.plan(spec, run_id, attempt=attempt, down=down)
        _workdirs(planned)
        self._standbys.stand_by(self._in_network(planned.nodes), self._agent, spec, secret_values(spec),
                                as_planned=plan is not None)

    def stand_down(self) -> None:
        self._standbys.stand_down()
        self._network.close()

    def close(self) -> None:
        """Nothing to release: each agent's pipes close when it ends (standbys stay for the next attempt)."""
