"""A command run on a host, whatever carries it (an SSH channel, an srun step, a local shell): its
result, or its overrun; and the one such command every target needs, a free port picked on the master host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from harness.errors import HarnessError
from harness.plan.shell import remote_command
from harness.spec.inventory import Host
from harness.targets.boot import BOOT, shipped

# Hosts reached at once, at most (SSH connections opened, preflight's checks run): 2,048 handshakes at once take the
# controller's cores past the connect timeout (each host's sshd sees one; its MaxStartups, 10:30:100, is per daemon).
FAN_OUT = 64


class RemoteTimeout(HarnessError):
    """A remote command overran its deadline; it was stopped, and what it printed is kept."""

    def __init__(self, host: Host, command: str, timeout: float, stdout: str, stderr: str) -> None:
        self.host = host
        self.command = command
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"{host.name}: command did not finish within {timeout:g}s and was stopped: {command[:120]}")


class NoFreePort(HarnessError):
    """The master host could not name a free port for the rendezvous."""


class CommandResult(NamedTuple):
    status: int
    stdout: str
    stderr: str


class Started(Protocol):
    """A command started on a host, whatever carries it."""

    def write(self, data: bytes) -> None: ...

    def close_stdin(self) -> None: ...

    def wait(self, timeout: float) -> CommandResult: ...

    def close(self) -> None: ...


def run_to_end(process: Started, stdin: bytes, timeout: float) -> CommandResult:
    """Feed a started command its whole stdin and wait for its end (RemoteTimeout once stopped)."""
    try:
        if stdin:
            process.write(stdin)
        process.close_stdin()
        return process.wait(timeout)
    finally:
        process.close()


def python_line(python: str, args: Sequence[str]) -> str:
    """The shell line that runs python on BOOT (harness.targets.boot): the program comes on its stdin,
    args only label it for `ps`."""
    return remote_command([python, "-c", BOOT, *args])


class Runs(Protocol):
    """What runs a command on one host: an SSH connection, an srun step's link, ..."""

    @property
    def host(self) -> Host: ...

    def run(self, command: str, *, stdin: bytes = b"", timeout: float) -> CommandResult: ...


def free_port_on(link: Runs, timeout: float) -> int:
    """A port nobody holds on link's host, picked there (harness.node.store_port): `master_port: auto`."""
    result = link.run(python_line(link.host.python, ["store_port"]), stdin=shipped("store_port", []), timeout=timeout)
    answer = result.stdout.strip().splitlines()[-1:] if result.status == 0 else []
    if not answer or not answer[0].isdigit():
        why = (result.stderr.strip().splitlines() or [f"exit status {result.status}"])[-1]
        raise NoFreePort(f"{link.host.name}: could not pick a free master_port there: {why}")
    return int(answer[0])
