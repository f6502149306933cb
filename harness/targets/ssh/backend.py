"""SSH backend: one node per inventory host, each under the node agent on its host.

The agent is sent on its stdin (harness.targets.boot) and run with the host's own Python, so hosts need
no harness install.
One SSH session channel per node carries the node's output back, the controller's TERM/KILL words
there, and the node's exit code back again; a dropped connection closes the agent's stdin, and the
agent stops its node. `container:` wraps every node in `docker run` or `podman run` (container.py).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import paramiko

from harness.errors import short_repr
from harness.node.link import NO_AGENT
from harness.node.protocol import Word, word_line
from harness.plan.planner import NodePlan, Plan, job_hosts, plan_hosts
from harness.plan.shell import remote_command
from harness.spec.inventory import Host, Inventory
from harness.spec.job import JobSpec
from harness.spec.secrets import secret_values
from harness.spec.yamlsource import located
from harness.targets.address import Unresolvable, is_loopback, resolve_ip
from harness.targets.agent_link import (
    READ_BYTES,
    AgentNode,
    Standbys,
    agent_argv,
    agent_env,
    agent_silence,
    attach_all,
    relay_argv,
    relay_program,
    start_all,
)
from harness.targets.base import CheckFailed, NodeProcess
from harness.targets.host_command import FAN_OUT, NoFreePort, RemoteTimeout, free_port_on
from harness.targets.ssh.container import in_containers
from harness.targets.ssh.transport import Connection, SSHConnectError, connect

KEEPALIVE_INTERVAL = 2.0  # seconds between liveness questions to each host; timeouts.connect is the answer limit
STOP_HELD_SECONDS = 30.0  # how long a node whose link was given up is given to end, once its agent got the KILL
RELINK_PAUSE = 1.0  # seconds between tries to link a node again while its host does not answer
HostsCheck = Callable[[list[Host], JobSpec, dict[str, Connection]], Mapping[str, str]]
"""The check SSH hosts pass before a plan starts on them (preflight's fast checks, handed in by whoever
builds the backend: targets never import preflight): hosts about to run the job, the launch's open
connections (reused, and the ones it opens added) -> the network interface found per host name (to pin
in the plan). Raises CheckFailed; nothing is started."""


def resolve_master_ip(inventory: Inventory, master: Host) -> str:
    """MASTER_ADDR must be an IP: hostnames resolve differently per node (127.0.1.1, IPv6-only). A loopback
    IP only where every host is written as one: all of them this machine (sshd on 127.0.0.1 and 127.0.0.2)."""
    where = inventory.key_path(master, "address")
    try:
        ip, looked_up = resolve_ip(master.address)
    except Unresolvable as exc:
        raise located(inventory.path, where, f"master address {short_repr(master.address)} does not resolve "
                                             f"({exc}); write its IP address") from None
    one_machine = all(is_loopback(host.address) for host in inventory.hosts)
    if not is_loopback(ip) or (not looked_up and one_machine):
        return ip
    if not looked_up:
        raise located(inventory.path, where, f"the master's address {ip} is loopback; the other hosts cannot "
                                             f"reach it there, write the master's routable IP")
    raise located(inventory.path, where, f"master address {short_repr(master.address)} resolves to loopback "
                                         f"{ip} here; the other hosts cannot reach that, write the master's "
                                         f"routable IP")


def ended_on_host(channel: paramiko.Channel) -> bool:
    """Whether the session ended on the host (its agent's end), not with the link: once a session's command ended,
    sshd sends its output's end of file, then its exit status, or `exit-signal` where a signal ended it, which
    paramiko does not read (its exit status stays -1), then closes the channel. A link that broke closes the
    channel with neither: the end of file is the host's word that the agent's output ended, which it does only
    as the agent ends (its children never hold its stdout). Blocks until the status or the close came."""
    return channel.recv_exit_status() != -1 or bool(channel.eof_received)


def relink_window(spec: JobSpec) -> float:
    """How long a node's lost link is tried again before its host counts as down: as long as its agent waits for a
    silent controller (agent_silence), within the time it holds the node (supervision.grace). Longer would keep a
    dead host from its spare; a link back within it is as if it never broke."""
    return min(spec.supervision.grace, agent_silence(spec.timeouts.connect))


class SSHAgentNode(AgentNode):
    """The agent on a remote host, reached through one SSH session channel; where that link is lost (the host's
    connection cut, its keepalive unanswered) while the agent holds its node, through a new login and the relay
    (harness.node.link), its stream sent again from where this controller's logs end: a cut shorter than
    relink_seconds is as if it never was."""

    def __init__(self, node: NodePlan, connection: Connection, relay: bool = False,
                 reconnect: Callable[[], Connection] | None = None, relink_seconds: float = 0.0) -> None:
        """relay: to the node's agent, which lost its controller (harness.node.link), instead of a new agent;
        reconnect: a new connection to the host, to link again or to stop a node whose link this one gave up (None:
        none is tried); relink_seconds: how long a lost link is tried again (0: not at all)."""
        super().__init__(node)
        self._reconnect = reconnect
        self._relink_seconds = relink_seconds if reconnect is not None else 0.0
        self._stopping = False
        self._pumped = False  # its output is read (a standby's is not, until it is taken)
        self._connection = connection
        self._relinked_over: Connection | None = None  # the connection of a new link: this node's own to close
        self._first_loss: str | None = None  # why the first link was lost, once a new one was tried
        self._channel = self._open(connection, relay)

    def _open(self, connection: Connection, relay: bool) -> paramiko.Channel:
        assert self.node.ssh is not None
        channel = connection.transport.open_session()
        channel.set_combine_stderr(True)
        argv = relay_argv(self.node.ssh.python, self.node) if relay else agent_argv(self.node.ssh.python, self.node)
        channel.exec_command(remote_command(argv, env=None if relay else agent_env(self.node)))
        return channel

    def output(self) -> Iterator[str | None]:
        self._pumped = True
        yield from super().output()

    def _chunks(self) -> Iterator[bytes]:
        while True:
            with contextlib.suppress(paramiko.SSHException):  # the link broke: what it carried is sent again
                while chunk := self._channel.recv(READ_BYTES):
                    yield chunk
            if not self._relink():
                return
            self.relinked = True

    def _relink(self) -> bool:
        """After the link ended without the agent's exit (its connection lost): a new one, tried for
        relink_seconds, the agent's stream to come again from self.position. False: the agent ended, a stop was
        asked, or no new link came."""
        if ended_on_host(self._channel):
            return False
        self._first_loss = self._first_loss or self._connection.lost or "its connection closed"
        deadline = time.monotonic() + self._relink_seconds
        while not self._stopping and time.monotonic() < deadline:
            assert self._reconnect is not None
            try:
                connection = self._reconnect()
            except Exception:  # noqa: BLE001 - whatever the transport raises, the host is not back yet
                time.sleep(RELINK_PAUSE)
                continue
            try:
                channel = self._open(connection, relay=True)
                with self._send_lock:  # the relay's program first, before any word for the agent
                    channel.sendall(relay_program(self.node, self.position))
                    if self._relinked_over is not None:
                        self._relinked_over.close()
                    self._connection = self._relinked_over = connection
                    self._channel = channel
                return True
            except (OSError, paramiko.SSHException):
                connection.close()
        return False

    def _send(self, data: bytes) -> None:
        if self._channel.closed:
            raise EOFError("channel closed")
        try:
            self._channel.sendall(data)
        except paramiko.SSHException as exc:
            raise EOFError(str(exc)) from exc

    def running(self) -> bool:
        return not (self._channel.closed or self._channel.exit_status_ready())

    def terminate(self) -> None:
        self._stopping = True
        super().terminate()

    def kill(self) -> None:
        self._stopping = True
        super().kill()

    def _agent_lost(self) -> None:
        """The link is gone: the run counts the host as down (a restart uses a spare in its place). Its agent, if
        it lives, holds the node for supervision.grace, then stops it itself; a new login stops it now, where the
        host answers (in the background: an unreachable one takes timeouts.connect to give up)."""
        if self._reconnect is not None:
            threading.Thread(target=self._stop_held, daemon=True).start()

    def _stop_held(self) -> None:
        """KILL, through the relay (harness.node.link), to the node's agent; what it says back is nobody's."""
        assert self._reconnect is not None
        with contextlib.suppress(Exception):  # best effort: whatever fails, the agent's grace still ends the node
            connection = self._reconnect()
            try:
                channel = self._open(connection, relay=True)
                channel.sendall(relay_program(self.node, None) + word_line(Word.KILL))
                deadline = time.monotonic() + STOP_HELD_SECONDS
                channel.settimeout(1.0)
                while not channel.exit_status_ready() and time.monotonic() < deadline:
                    with contextlib.suppress(TimeoutError, socket.timeout):
                        if not channel.recv(READ_BYTES):
                            break
            finally:
                connection.close()

    def _wait_agent(self) -> str:
        if self._relink_seconds > 0 and self._pumped:
            self._output_done.wait()  # it ends once the agent has, or once no new link came
        status = self._channel.recv_exit_status()
        if self._relinked_over is not None:
            self._relinked_over.close()
        where = f"{self.node.host} ({self.node.address})"
        if self._relinked_over is None and status == -1 and self._channel.eof_received:
            return (f"node agent on {where} killed before it reported the node's end (its output ended, and sshd sent "
                    f"no exit status: a signal's end)")
        why = self._connection.lost or ("its agent was gone once the link was made again" if status == NO_AGENT and
                                        self._relinked_over is not None else f"ssh status {status}" if status != -1
                                        else "the session ended without an exit status: its agent or sshd was killed")
        if self._relinked_over is not None:
            why = f"{self._first_loss}; linked again, then {why}"
        return f"connection to {where} lost ({why})"


@dataclass(frozen=True)
class SSHOptions:
    """How to reach the hosts: host keys (never trusted silently)."""

    known_hosts: str | Path | None = None
    accept_new_host_keys: bool = False


class SSHBackend:
    """Nodes on the inventory's hosts, master first, over one SSH connection per host: the check opens it,
    the master's serves the port pick, and the nodes start on them; it is closed after the attempt unless a
    standby for the next one runs over it (the next check then reuses it). Connections may be
    lent by the caller (preflight's collective reuses its own); lent ones are left open at close.
    check: what the hosts must pass before a plan starts on them (preflight's fast checks; None: start
    without)."""

    name = "ssh"
    standbys_await_check = True

    def __init__(self, inventory: Inventory, options: SSHOptions = SSHOptions(),
                 connections: dict[str, Connection] | None = None, check: HostsCheck | None = None) -> None:
        self.inventory = inventory
        self.options = options
        self._check = check
        self._lent = dict(connections or {})
        self._opened: dict[str, Connection] = {}
        self._standbys = Standbys()

    def plan(self, spec: JobSpec, run_id: str, attempt: int = 0, down: frozenset[str] = frozenset()) -> Plan:
        return self.pinned_plan(spec, run_id, job_hosts(spec, self.inventory, down), attempt)

    def pool(self, spec: JobSpec) -> list[str]:
        return [host.name for host in self.inventory.ordered_hosts()]

    def machines(self) -> dict[str, str]:
        return {host.name: f"{host.address_key}:{host.port}" for host in self.inventory.hosts}

    def pinned_plan(self, spec: JobSpec, run_id: str, hosts: list[Host], attempt: int = 0,
                    interfaces: Mapping[str, str] | None = None, master_ip: str | None = None) -> Plan:
        """The plan on hosts (master first) with the interfaces preflight found pinned where neither the
        inventory nor the job names one (interfaces: host name -> interface). master_ip: the master's
        address already resolved (else it is resolved here)."""
        master_ip = master_ip or resolve_master_ip(self.inventory, hosts[0])
        plan = plan_hosts(spec, hosts, run_id=run_id, master_ip=master_ip, attempt=attempt, interfaces=interfaces)
        return in_containers(plan, spec) if spec.container is not None else plan

    def check(self, plan: Plan, spec: JobSpec) -> Plan:
        """The check on the plan's hosts; the plan comes back with the network interface it found per
        host pinned, and with master_port auto a port that the master host finds free."""
        hosts = [node.ssh for node in plan.nodes if node.ssh is not None]
        interfaces = self._check(hosts, spec, self._opened) if self._check is not None else None
        if spec.master_port == "auto":
            spec = spec.at_port(self._free_port(hosts[0], spec.timeouts.connect))
        return self.pinned_plan(spec, plan.run_id, hosts, plan.attempt, interfaces, plan.master_addr)

    def _free_port(self, master: Host, timeout: float) -> int:
        """Asked of the master host itself; its connection stays open for start. A master that cannot
        answer fails the check on that host, so that a spare may take its place."""
        try:
            if master.name not in self._lent and master.name not in self._opened:
                self._opened[master.name] = connect(master, known_hosts=self.options.known_hosts,
                                                    accept_new_host_keys=self.options.accept_new_host_keys,
                                                    timeout=timeout)
            return free_port_on((self._lent | self._opened)[master.name], timeout)
        except (SSHConnectError, NoFreePort) as exc:
            raise CheckFailed(str(exc), frozenset({master.name})) from None
        except (RemoteTimeout, OSError, paramiko.SSHException) as exc:
            raise CheckFailed(f"{master.name}: could not pick a free master_port there: {exc}",
                              frozenset({master.name})) from None

    def _connect_all(self, nodes: tuple[NodePlan, ...], timeout: float) -> dict[str, Connection]:
        """A connection per host, opened in parallel; the first error once every attempt has ended."""
        errors = self._connect(nodes, timeout)
        if errors:
            raise errors[0]
        return self._lent | self._opened

    def _connect(self, nodes: tuple[NodePlan, ...], timeout: float) -> list[BaseException]:
        """Open the connections nodes' hosts lack, FAN_OUT at a time; what failed."""
        errors: list[BaseException] = []

        def open_one(node: NodePlan) -> None:
            assert node.ssh is not None
            try:
                self._opened[node.host] = connect(node.ssh, known_hosts=self.options.known_hosts,
                                                  accept_new_host_keys=self.options.accept_new_host_keys,
                                                  timeout=timeout)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after every attempt ended
                errors.append(exc)

        missing = [node for node in nodes if node.host not in self._lent and node.host not in self._opened]
        if missing:
            with ThreadPoolExecutor(max_workers=min(len(missing), FAN_OUT)) as pool:
                pool.map(open_one, missing)
        return errors

    def start(self, plan: Plan, spec: JobSpec) -> list[NodeProcess]:
        connections = self._connect_all(plan.nodes, spec.timeouts.connect)
        for connection in self._opened.values():
            connection.keep_alive(KEEPALIVE_INTERVAL, spec.timeouts.connect)
        return start_all(plan.nodes, lambda node: self._agent_node(node, connections[node.host], spec), spec,
                         self._standbys, secret_values(spec), held=True)

    def _agent_node(self, node: NodePlan, connection: Connection, spec: JobSpec, relay: bool = False) -> SSHAgentNode:
        """node's agent over connection, linked again where that link is lost for as long as each side waits for the
        other (relink_window)."""
        return SSHAgentNode(node, connection, relay=relay, reconnect=self._reconnect(node, spec),
                            relink_seconds=relink_window(spec))

    def _reconnect(self, node: NodePlan, spec: JobSpec) -> Callable[[], Connection] | None:
        """A new connection to node's host, for a node held after its link was lost (None: its agent holds nothing)."""
        if spec.supervision.grace <= 0 or node.ssh is None:
            return None
        host = node.ssh

        def reconnect() -> Connection:
            connection = connect(host, known_hosts=self.options.known_hosts,
                                 accept_new_host_keys=self.options.accept_new_host_keys, timeout=spec.timeouts.connect)
            connection.keep_alive(KEEPALIVE_INTERVAL, spec.timeouts.connect)
            return connection
        return reconnect

    def attach(self, plan: Plan, spec: JobSpec, resume: Mapping[int, int]) -> list[NodeProcess]:
        connections = self._connect_all(plan.nodes, spec.timeouts.connect)
        for connection in self._opened.values():
            connection.keep_alive(KEEPALIVE_INTERVAL, spec.timeouts.connect)
        return attach_all(plan.nodes, lambda node: self._agent_node(node, connections[node.host], spec, relay=True),
                          resume)

    def stand_by(self, spec: JobSpec, run_id: str, attempt: int, down: frozenset[str],
                 plan: Plan | None = None) -> None:
        """A standby on every host of the inventory that is not down, spares included: whichever of them the
        next attempt runs on starts warm (plan: the first attempt's, checked: one on each of its hosts, as its node).
        A host that cannot be reached now simply has none."""
        if spec.container is not None:
            return  # the node's torchrun is the container's, started by its engine
        hosts = [host for host in self.inventory.ordered_hosts() if host.name not in down]
        nodes = (plan or self.pinned_plan(spec.at_nnodes(len(hosts)), run_id, hosts, attempt)).nodes
        self._connect(nodes, spec.timeouts.connect)
        connections = self._lent | self._opened
        for connection in self._opened.values():
            connection.keep_alive(KEEPALIVE_INTERVAL, spec.timeouts.connect)
        self._standbys.stand_by([node for node in nodes if node.host in connections],
                                lambda node: self._agent_node(node, connections[node.host], spec), spec,
                                secret_values(spec), as_planned=plan is not None)

    def stand_down(self) -> None:
        self._standbys.stand_down()

    def close(self) -> None:
        """Close the connections that carry no standby."""
        keep = self._standbys.hosts()
        for name in [name for name in self._opened if name not in keep]:
            self._opened.pop(name).close()
