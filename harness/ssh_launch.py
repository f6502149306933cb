"""SSH backend: each planned node runs on its host under a small agent that obeys the controller.

The agent is harness/procs.py itself, sent as source and run with the host's Python, so hosts need
no harness install. One SSH session channel per node carries the node's output back, the
controller's TERM/KILL words there, and the node's exit code back again.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import paramiko

from harness.inventory import Host
from harness.plan import NodePlan
from harness.procs import EXIT_MARKER
from harness.render import shell_command
from harness.ssh import Connection
from harness.supervisor import Outcome

AGENT_SOURCE = (Path(__file__).parent / "procs.py").read_text()


def agent_command(node: NodePlan, grace: float) -> str:
    """The remote command line: the agent runs the node's shell command and supervises it."""
    assert node.ssh is not None
    return shlex.join([node.ssh.python, "-c", AGENT_SOURCE, node.env["HARNESS_RUN_ID"], str(node.node_rank),
                       str(grace), shell_command(node), shlex.join(node.cleanup)])


class SSHNode:
    """One torchrun agent on a remote host, reached through one SSH session channel."""

    def __init__(self, node: NodePlan, connection: Connection, grace: float) -> None:
        self.node = node
        self._connection = connection
        self._channel = connection.transport.open_session()
        self._channel.set_combine_stderr(True)
        self._channel.exec_command(agent_command(node, grace))
        self._exit_code: int | None = None
        self._output_done = threading.Event()
        self._send_lock = threading.Lock()

    def output(self) -> Iterator[str]:
        try:
            for raw in self._channel.makefile("rb"):
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if line.startswith(EXIT_MARKER):
                    self._exit_code = int(line.split()[-1])
                    continue
                yield line
        except (OSError, EOFError, paramiko.SSHException):
            return
        finally:
            self._output_done.set()

    def wait(self) -> Outcome:
        status = self._channel.recv_exit_status()
        self._output_done.wait(timeout=5)
        code = self._exit_code
        if code is None:
            where = f"{self.node.host} ({self.node.address})"
            return Outcome(exit_code=None, error=f"connection to {where} lost (ssh status {status})")
        return Outcome(exit_code=None, signal=-code) if code < 0 else Outcome(exit_code=code)

    def _send(self, word: str) -> None:
        with self._send_lock:
            try:
                if not self._channel.closed:
                    self._channel.sendall(f"{word}\n".encode())
            except (OSError, EOFError, paramiko.SSHException):
                pass

    def terminate(self) -> None:
        self._send("TERM")

    def kill(self) -> None:
        self._send("KILL")

    def close(self) -> None:
        self._connection.close()


def start_ssh_nodes(
    nodes: tuple[NodePlan, ...], connect: Callable[[Host], Connection], grace: float
) -> list[SSHNode]:
    """Connect to every host first (in parallel), then start the nodes: all or nothing."""
    clients: dict[int, Connection] = {}
    errors: list[BaseException] = []

    def open_one(node: NodePlan) -> None:
        assert node.ssh is not None
        try:
            clients[node.node_rank] = connect(node.ssh)
        except BaseException as exc:  # noqa: BLE001 - reported after every connection attempt ended
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(node,)) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    started: list[SSHNode] = []
    try:
        if errors:
            raise errors[0]
        for node in nodes:
            started.append(SSHNode(node, clients[node.node_rank], grace))
    except BaseException:
        for process in started:
            process.kill()
        for client in clients.values():
            client.close()
        raise
    return started
