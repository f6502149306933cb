"""A command run on a host, whatever carries it (an SSH channel, an srun step, a local shell): its
result, or its overrun."""

from __future__ import annotations

from typing import NamedTuple

from harness.errors import HarnessError
from harness.spec.inventory import Host


class RemoteTimeout(HarnessError):
    """A remote command overran its deadline; it was stopped, and what it printed is kept."""

    def __init__(self, host: Host, command: str, timeout: float, stdout: str, stderr: str) -> None:
        self.host = host
        self.command = command
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"{host.name}: command did not finish within {timeout:g}s and was stopped: {command[:120]}")


class CommandResult(NamedTuple):
    status: int
    stdout: str
    stderr: str
