"""Hosts reached through a subprocess of this process (remote.Link): inside a Slurm allocation each
command is an `srun` step on one node; for simulated nodes, a plain process on this machine.

The same probe and network scripts as over SSH, so version parity, GPUs, data, master port and the
data plane are proven between the allocation's nodes. Steps overlap (`--overlap`): a node's test
listener runs while the other nodes' connection tests run there too.
"""

from __future__ import annotations

import queue
import subprocess
import threading
from collections.abc import Sequence
from typing import IO

from harness.spec.inventory import Host
from harness.targets.host_command import CommandResult, RemoteTimeout, python_line, run_to_end
from harness.targets.slurm.srun import Allocation


class CommandProcess:
    """A command running behind the link's prefix: its stdout lines as they come, stdin to close, a deadline."""

    def __init__(self, link: CommandLink, command: str) -> None:
        self.link = link
        self.command = command
        self._proc = subprocess.Popen(
            [*link.prefix, "sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._readers = [threading.Thread(target=self._read, args=(self._proc.stdout, True), daemon=True),
                         threading.Thread(target=self._read, args=(self._proc.stderr, False), daemon=True)]
        for reader in self._readers:
            reader.start()

    @property
    def connection(self) -> CommandLink:
        return self.link

    def _read(self, stream: IO[str], is_stdout: bool) -> None:
        for line in stream:
            if is_stdout:
                self._lines.put(line.rstrip("\n"))
            else:
                self._stderr.append(line)
        if is_stdout:
            self._lines.put(None)

    def read_line(self, timeout: float) -> str | None:
        """The next stdout line (None at its end); RemoteTimeout, with the step stopped, if none comes."""
        try:
            return self._lines.get(timeout=timeout)
        except queue.Empty:
            raise self._timed_out(timeout) from None

    def write(self, data: bytes) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(data.decode())
        self._proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()

    def wait(self, timeout: float) -> CommandResult:
        try:
            status = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise self._timed_out(timeout) from None
        for reader in self._readers:
            reader.join(timeout=5)
        while not self._lines.empty():
            if (line := self._lines.get_nowait()) is not None:
                self._stdout.append(line + "\n")
        return CommandResult(status, "".join(self._stdout), "".join(self._stderr))

    def _timed_out(self, timeout: float) -> RemoteTimeout:
        self.close()
        return RemoteTimeout(self.link.host, self.command, timeout, "", "".join(self._stderr))

    def close(self) -> None:
        """SIGTERM: srun ends its step, on every node of it; a local command was exec'd by sh and ends."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


class CommandLink:
    """One host, as preflight's scripts reach it: `prefix sh -c COMMAND` (no prefix: this machine)."""

    def __init__(self, host: Host, prefix: Sequence[str] = ()) -> None:
        self._host = host
        self.prefix = list(prefix)

    @property
    def host(self) -> Host:
        return self._host

    @property
    def peer_ip(self) -> str:
        return self._host.address

    def start(self, command: str, *, timeout: float) -> CommandProcess:
        return CommandProcess(self, command)

    def run(self, command: str, *, stdin: bytes = b"", timeout: float) -> CommandResult:
        return run_to_end(CommandProcess(self, command), stdin, timeout)

    def python_command(self, args: Sequence[str]) -> str:
        return python_line(self._host.python, args)

    def close(self) -> None:
        """Nothing stays open between commands."""


def srun_link(allocation: Allocation, host: Host) -> CommandLink:
    """One node of the allocation: every command an srun step there."""
    return CommandLink(host, allocation.step(host.name, "--overlap", f"--job-name=preflight-{host.name}"))
