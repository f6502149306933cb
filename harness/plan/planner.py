"""Spec (+ inventory) -> plan: for every node its host, node_rank, argv and env. Pure: no I/O.

This is the single source of truth for master address, port, node ranks and the env contract;
every renderer and backend consumes a Plan and nothing else.
"""

from __future__ import annotations

import ipaddress
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from harness.errors import HarnessError, UsageError
from harness.plan.setup_script import setup_script
from harness.spec.inventory import Host, Inventory
from harness.spec.job import JobSpec
from harness.spec.yamlsource import located

LOCAL_MASTER = "127.0.0.1"
# torchrun's own default port: where master_port is auto, what a plan shows until its target has picked a
# free port (`harness render --hosts`, a plan before its check), and what pods use (a network each).
TORCHRUN_PORT = 29500
TORCHRUN_MODULE = "torch.distributed.run"
# torchrun prefixes worker lines with the local rank by default; ${rank} is the global rank. It is set by
# environment, which every torchrun since 2.2 reads (the --log-line-prefix-template flag is newer).
LOG_LINE_PREFIX = "[rank${rank}]: "
LOG_LINE_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
# Where the harness supervises the nodes, torch's C++ INFO log tells it which ranks joined a process
# group (worker_output.joined_rank), so a run that never did is not reported as a distributed success.
STORE_WATCH_ENV = {"TORCH_CPP_LOG_LEVEL": "INFO"}
# ... and torch's Flight Recorder keeps each rank's last collectives (gloo's recorder and NCCL's: torch 2.15
# reads this for both and calls TORCH_NCCL_TRACE_BUFFER_SIZE deprecated), which the node agent reads through
# the rank hook: where each rank is on a hang, progress on GPUs, arrival times.
FLIGHT_RECORDER_ENV = {"TORCH_FR_BUFFER_SIZE": "512"}


@dataclass(frozen=True)
class Node:
    """One node of a job: where it runs and which ranks it holds. What the harness knows of a node
    that a scheduler started (NodePlan: one the harness starts itself)."""

    host: str
    address: str
    node_rank: int
    nproc: int

    @property
    def ranks(self) -> range:
        """Global ranks of this node's workers (uniform nproc, as torchrun's static rendezvous needs)."""
        return range(self.node_rank * self.nproc, (self.node_rank + 1) * self.nproc)

    @property
    def label(self) -> str:
        return f"node{self.node_rank}"


@dataclass(frozen=True)
class NodePlan(Node):
    """One torchrun agent: where it runs and exactly what it executes."""

    argv: tuple[str, ...]
    env: dict[str, str]
    workdir: str | None = None
    ssh: Host | None = field(default=None, compare=False)
    cleanup: tuple[str, ...] = ()  # run on the host after a forced stop (e.g. remove the node's container)
    interface: str | None = None  # pinned for gloo and NCCL (see interface_env)
    setup: str | None = None  # the job's setup: script, run in workdir with env before argv (setup_script.py)
    secrets: tuple[str, ...] = ()  # env names whose values the agent gets at the start (spec/secrets.py), not env
    # The node hosts the job's rendezvous store on this port, which its agent keeps from the host's other users
    # (node/store_port.py): the master host's node, where the job's processes are the agent's user's.
    store_port: int | None = None
    # Words before argv that put the node's torchrun, and so its ranks, where the target needs it, after its setup
    # (simulated nodes: the launch's own network, targets/local/private_net.py). Set by the target as it starts it.
    enter: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    run_id: str
    name: str
    master_addr: str
    master_port: int
    nnodes: int
    nproc_per_node: int
    nodes: tuple[NodePlan, ...]
    attempt: int = 0  # 0-based; a restart plans again with the next number (HARNESS_ATTEMPT)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def to_json(self) -> dict[str, object]:
        return {
            "run_id": self.run_id,
            "attempt": self.attempt,
            "name": self.name,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "nnodes": self.nnodes,
            "nproc_per_node": self.nproc_per_node,
            "world_size": self.world_size,
            "nodes": [
                {"host": n.host, "address": n.address, "node_rank": n.node_rank, "ranks": list(n.ranks),
                 "workdir": n.workdir, "interface": n.interface, "setup": n.setup, "argv": list(n.argv),
                 "env": dict(n.env), "secrets": list(n.secrets), "cleanup": list(n.cleanup)}
                for n in self.nodes
            ],
        }


def planned_port(spec: JobSpec) -> int:
    """master_port as a plan holds it: auto is TORCHRUN_PORT until the target picks a free port and plans
    again with it (JobSpec.at_port)."""
    return TORCHRUN_PORT if spec.master_port == "auto" else spec.master_port


def resolve_nproc(spec: JobSpec, gpus: list[int | None], where: list[str]) -> int:
    if spec.nproc_per_node != "auto":
        return spec.nproc_per_node
    unknown = [w for w, g in zip(where, gpus, strict=True) if g is None]
    if unknown:
        raise UsageError(
            f"nproc_per_node is 'auto' but the GPU count of {', '.join(unknown)} is unknown; "
            f"set `gpus:` for those hosts (or under `defaults:`) in the inventory, or a number in the job"
        )
    counts = {max(g or 0, 1) for g in gpus}
    if len(counts) > 1:
        detail = ", ".join(f"{w}={g}" for w, g in zip(where, gpus, strict=True))
        raise UsageError(
            f"nproc_per_node 'auto' needs the same GPU count on every node, got {detail}; "
            f"set nproc_per_node to a number that every node can run"
        )
    return counts.pop()


def torchrun_flags(
    spec: JobSpec, *, run_id: str, master_addr: str, nproc: int, node_rank: int | str, attempt: int = 0,
    master_port: int | str | None = None,
) -> list[str]:
    """torchrun's own flags for one node (without the interpreter or the entrypoint).

    `--tee=3` is what makes torchrun apply the rank prefix (LOG_LINE_PREFIX_ENV): it echoes each
    worker's tee'd log lines. Where those files go is the node agent's choice, not the plan's (its private
    directory, through PET_LOG_DIR: harness/node/agent.py), so that no rank writes to the run's record.
    torchrun's own restarts stay off (`--max-restarts=0`): they restart one node's workers, which a
    static rendezvous cannot take back; the harness restarts the whole job instead (spec `restarts`),
    each attempt with a rendezvous id of its own. master_port: the spec's (None), or where the port is only
    known on the nodes, a placeholder the renderer turns into an expansion (sbatch).
    """
    port = planned_port(spec) if master_port is None else master_port
    args = [f"--nnodes={spec.nnodes}", f"--nproc-per-node={nproc}"]
    if spec.rdzv == "static":
        args += [f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={port}"]
    else:
        args += [
            "--rdzv-backend=c10d", f"--rdzv-endpoint={master_addr}:{port}",
            f"--rdzv-id={run_id}" + (f"-{attempt}" if attempt else ""),
            f"--rdzv-conf=join_timeout={int(spec.timeouts.rendezvous)}",
        ]
    return [*args, "--max-restarts=0", "--tee=3"]


def entrypoint_args(spec: JobSpec) -> list[str]:
    """What torchrun runs after its flags: the module or script, then its arguments.

    torchrun runs script args through string.Template (its ${local_rank} macro): `$$` keeps a `$`, and
    local_rank_arg is the one place the macro is meant.
    """
    entry = spec.entrypoint
    target = ["-m", entry.module] if entry.module is not None else [str(entry.script)]
    local_rank = [f"{entry.local_rank_arg}=${{local_rank}}"] if entry.local_rank_arg else []
    return target + local_rank + [arg.replace("$", "$$") for arg in entry.args]


def torchrun_args(
    spec: JobSpec, *, run_id: str, master_addr: str, nproc: int, node_rank: int | str, attempt: int = 0,
) -> list[str]:
    """torchrun's flags for one node, then the entrypoint (without the interpreter)."""
    return torchrun_flags(spec, run_id=run_id, master_addr=master_addr, nproc=nproc, node_rank=node_rank,
                          attempt=attempt) + entrypoint_args(spec)


def interface_env(interface: str | None) -> dict[str, str]:
    """Pin gloo and NCCL to one interface. Unpinned, gloo advertises what the hostname resolves to
    (127.0.1.1 on Debian) and NCCL takes the first interface that is not lo or docker*. NCCL reads its
    variable as a prefix (eth1 would match eth10); `=` makes it exact."""
    return {} if interface is None else {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}"}


def node_env(spec: JobSpec, *, run_id: str, master_addr: str, nproc: int, node_rank: int | str,
             attempt: int | str = 0, interface: str | None = None, supervised: bool = False,
             master_port: int | str | None = None) -> dict[str, str]:
    """The env contract of DESIGN.md: identical on every backend, user env first, ours last (the
    interface pin and, for nodes the supervisor reads, STORE_WATCH_ENV and FLIGHT_RECORDER_ENV before the
    user's env: a job that sets GLOO_SOCKET_IFNAME, TORCH_CPP_LOG_LEVEL or a buffer size itself keeps
    it). master_port: as torchrun_flags takes it."""
    contract = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(planned_port(spec) if master_port is None else master_port),
        "NNODES": str(spec.nnodes),
        "NODE_RANK": str(node_rank),
        "NPROC_PER_NODE": str(nproc),
        "HARNESS_RUN_ID": run_id,
        "HARNESS_ATTEMPT": str(attempt),
        "HARNESS_BACKEND": spec.backend,
        LOG_LINE_PREFIX_ENV: LOG_LINE_PREFIX,
    }
    defaults = {"PYTHONUNBUFFERED": "1"}  # output reaches the supervisor as it happens, not at exit
    # torchrun's defaults for its own flags; not the node rank under c10d, where torchrun ignores one and says so
    # into the job's stream
    twins = ("MASTER_ADDR", "MASTER_PORT", "NNODES", *(("NODE_RANK",) if spec.rdzv == "static" else ()),
             "NPROC_PER_NODE")
    pet = {f"PET_{k}": contract[k] for k in twins}
    watch = STORE_WATCH_ENV | FLIGHT_RECORDER_ENV if supervised else {}
    return defaults | watch | interface_env(interface) | dict(spec.env) | contract | pet


def split_local_gpus(spec: JobSpec, gpu_ids: Sequence[str]) -> tuple[int, list[str | None]]:
    """nproc per simulated node, and each node's CUDA_VISIBLE_DEVICES (None: no split).

    The simulated nodes share one machine, so a GPU job gives each node its own devices: without
    that, every node's local rank 0 would take device 0, and NCCL refuses two ranks on one GPU.
    `auto` is the node's share. gloo may share devices, so it is only split when the share allows.
    """
    gpu_job = spec.backend == "nccl" or (spec.backend == "auto" and bool(gpu_ids))
    if spec.backend == "nccl" and not gpu_ids:
        raise UsageError("backend nccl needs CUDA GPUs and this machine has none: set `backend: gloo` (or auto) "
                         "to run the simulated nodes on CPU, or launch on GPU hosts with --hosts")
    share = len(gpu_ids) // spec.nnodes
    nproc = spec.nproc_per_node if spec.nproc_per_node != "auto" else max(share, 1)
    if gpu_job and nproc > share:
        raise UsageError(
            f"{spec.nnodes} simulated nodes x {nproc} GPU rank(s) need {spec.nnodes * nproc} GPUs and this machine "
            f"has {len(gpu_ids)}; one GPU cannot host two NCCL ranks: lower nnodes or nproc_per_node, "
            f"or set `backend: gloo` to run on CPU"
        )
    if not gpu_ids or nproc > share:
        return nproc, [None] * spec.nnodes
    return nproc, [",".join(gpu_ids[k * nproc:(k + 1) * nproc]) for k in range(spec.nnodes)]


def _visible_devices(devices: str | None) -> dict[str, str]:
    return {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}


def local_spec(spec: JobSpec, cwd: str) -> JobSpec:
    """The spec as simulated nodes run it: with workdirs of their own, a relative script is still the
    launch directory's (cwd)."""
    return spec.script_under(cwd) if spec.simulated.workdir is not None else spec


def local_workdirs(spec: JobSpec, cwd: str) -> list[str]:
    """Each simulated node's working directory: the launch directory, or its own below it."""
    template = spec.simulated.workdir
    if template is None:
        return [cwd] * spec.nnodes
    return [posixpath.normpath(posixpath.join(cwd, template.format(node_rank=k))) for k in range(spec.nnodes)]


def simulated_hosts(nnodes: int) -> list[str]:
    """The names of a job's simulated nodes, as an inventory's hosts are named: a node lost in one
    attempt is down for the next, and the attempt runs on the others (restarts.min_nnodes)."""
    return [f"sim{k}" for k in range(nnodes)]


def plan_local(
    spec: JobSpec, *, run_id: str, python: str, gpu_ids: Sequence[str] = (), local_cpus: int = 1,
    attempt: int = 0, cwd: str | None = None, hosts: Sequence[str] | None = None,
) -> Plan:
    """nnodes torchrun agents on this machine, rendezvousing on 127.0.0.1 like a real cluster.

    The simulated nodes share this machine's cores, so each worker gets its share of OMP threads
    (torchrun sets 1 only for nodes with several workers), and its GPUs (gpu_ids: the devices this
    machine shows, see split_local_gpus); a job's env still wins. cwd: the launch directory, every node's workdir
    (or the base of their own, spec.simulated.workdir; a relative script stays the launch directory's).
    hosts: the simulated nodes' names in node-rank order (default: simulated_hosts), one node each:
    fewer than spec.nnodes when the job goes on without lost ones (restarts.min_nnodes).
    """
    names = list(hosts) if hosts is not None else simulated_hosts(spec.nnodes)
    spec = spec.at_nnodes(len(names))
    if spec.container is not None:
        raise UsageError("container: true runs nodes in the image over SSH (--hosts); simulated nodes run "
                         "here directly (or run harness itself in the image, see docs/containers.md)")
    nproc, devices = split_local_gpus(spec, gpu_ids)
    workdirs: list[str | None] = [None] * spec.nnodes if cwd is None else list(local_workdirs(spec, cwd))
    if cwd is not None:
        spec = local_spec(spec, cwd)
    setup = setup_script(spec.setup, spec.data_paths, rank_hook=True)
    nodes = tuple(
        NodePlan(
            host=names[rank], address=LOCAL_MASTER, node_rank=rank, nproc=nproc, workdir=workdirs[rank],
            argv=(python, "-m", TORCHRUN_MODULE,
                  *torchrun_args(spec, run_id=run_id, master_addr=LOCAL_MASTER, nproc=nproc, node_rank=rank,
                                attempt=attempt)),
            env={"OMP_NUM_THREADS": str(max(1, local_cpus // (spec.nnodes * nproc)))}
            | _visible_devices(devices[rank])
            | node_env(spec, run_id=run_id, master_addr=LOCAL_MASTER, nproc=nproc, node_rank=rank, attempt=attempt,
                       supervised=True),
            setup=setup, secrets=tuple(spec.secrets),
        )
        for rank in range(spec.nnodes)
    )
    return Plan(run_id, spec.name, LOCAL_MASTER, planned_port(spec), spec.nnodes, nproc, nodes, attempt)


class NoSpareHosts(HarnessError):
    """Hosts are down and the inventory has no healthy spare left to take their place."""


def job_hosts(spec: JobSpec, inventory: Inventory, down: frozenset[str] = frozenset()) -> list[Host]:
    """The first nnodes hosts that are not down, master first: hosts past nnodes are spares, taken in
    file order when a host is down; with none left, as few as restarts.min_nnodes (take_healthy). An
    inventory with too few hosts is an error at its `hosts:` key."""
    hosts = inventory.ordered_hosts()
    if len(hosts) < spec.nnodes:
        raise located(inventory.path, ("hosts",), f"the job needs nnodes={spec.nnodes} hosts but the inventory "
                                                  f"lists {len(hosts)}; add hosts or lower nnodes")
    by_name = {host.name: host for host in hosts}
    names = take_healthy(spec, list(by_name), down, what="host", pool="the inventory's",
                         fix=f"add hosts to {inventory.path} or lower nnodes")
    return [by_name[name] for name in names]


def take_healthy(spec: JobSpec, names: list[str], down: frozenset[str], *, what: str, pool: str,
                 fix: str | None = None) -> list[str]:
    """The first nnodes names that are not down, in order: the ones past nnodes are spares, taken in
    order when one is down. With too few left, all of them, as long as they are at least the job's
    fewest_nnodes (restarts.min_nnodes): the attempt runs on fewer nodes (JobSpec.at_nnodes). Else
    NoSpareHosts, saying what is down and what is left of the pool (what: "host"; pool: whose names).
    The ones left are only not known to be down (a spare is never checked before it is needed), so the
    message does not call them healthy."""
    left = [name for name in names if name not in down]
    nnodes, fewest = spec.nnodes, spec.fewest_nnodes
    if len(left) >= fewest:
        return left[:nnodes]
    needs = f"nnodes={nnodes} {what}s" + (f", at least restarts.min_nnodes={fewest}" if fewest < nnodes else "")
    fixes = [fix] if fix else []
    if left:
        fixes.append("set restarts.min_nnodes to go on with fewer" if fewest == nnodes else
                     "lower restarts.min_nnodes")
    raise NoSpareHosts(
        f"{what}(s) down: {', '.join(sorted(down))}, and no spare left: the job needs {needs}, {len(left)} of "
        f"{pool} {len(names)} {'is' if len(left) == 1 else 'are'} left, not known to be down "
        f"({', '.join(left) or 'none'}); {', or '.join(fixes)}"
    )


def pinned_interface(spec: JobSpec, host: Host, found: Mapping[str, str]) -> str | None:
    """The host's `interface:` in the inventory, else the job's network.interface, else what preflight
    found routing to the peers (found: host name -> interface), else none."""
    return host.interface or spec.network.interface or found.get(host.name)


def plan_hosts(spec: JobSpec, hosts: list[Host], *, run_id: str, master_ip: str, attempt: int = 0,
               interfaces: Mapping[str, str] | None = None, shared_hosts: bool = True) -> Plan:
    """One node per host, hosts[0] the master: fewer than spec.nnodes when the job goes on without lost
    hosts (restarts.min_nnodes). master_ip is its address already resolved to an IP; interfaces: what
    preflight found (see pinned_interface); shared_hosts: other users may log in to the hosts (not pods: the job's
    store is kept from them, NodePlan.store_port)."""
    try:
        ipaddress.ip_address(master_ip)
    except ValueError:
        raise UsageError(f"master address must be an IP address, got {master_ip!r}") from None
    spec = spec.at_nnodes(len(hosts))
    nproc = resolve_nproc(spec, [h.gpus for h in hosts], [h.name for h in hosts])
    setup = setup_script(spec.setup, spec.data_paths, rank_hook=True)
    return Plan(run_id, spec.name, master_ip, planned_port(spec), spec.nnodes, nproc, tuple(
        _host_node(spec, host, rank, nproc, run_id, master_ip, attempt, pinned_interface(spec, host, interfaces or {}),
                   setup, guard_store=shared_hosts and rank == 0)
        for rank, host in enumerate(hosts)
    ), attempt)


def _host_node(spec: JobSpec, host: Host, rank: int, nproc: int, run_id: str, master_ip: str,
               attempt: int, interface: str | None, setup: str | None, guard_store: bool) -> NodePlan:
    """torchrun with the host's Python (argv[0]); the SSH backend may wrap it in a container."""
    args = torchrun_args(spec, run_id=run_id, master_addr=master_ip, nproc=nproc, node_rank=rank, attempt=attempt)
    env = node_env(spec, run_id=run_id, master_addr=master_ip, nproc=nproc, node_rank=rank, attempt=attempt,
                   interface=interface, supervised=True)
    return NodePlan(host=host.name, address=host.address, node_rank=rank, nproc=nproc,
                    argv=(host.python, "-m", TORCHRUN_MODULE, *args), env=env, workdir=host.workdir, ssh=host,
                    interface=interface, setup=setup, secrets=tuple(spec.secrets),
                    store_port=planned_port(spec) if guard_store else None)
