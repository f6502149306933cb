"""Run the node-side scripts (harness.node: probe, netcheck) on a host and read their JSON answer.

A script travels as the first line of its stdin (harness.targets.boot), so the host needs no harness
install, its command line stays short, and the rest of its stdin is its own (netcheck's listener
serves until stdin closes). The answer is the one stdout line after a marker, so whatever else the
host prints (warnings, banners) does not matter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Protocol, TypeVar

from harness.errors import HarnessError
from harness.spec.inventory import Host
from harness.targets.boot import shipped
from harness.targets.host_command import FAN_OUT, CommandResult, RemoteTimeout

MARKER = "HARNESS_PREFLIGHT_ANSWER="
TORCH_TIMEOUT_FACTOR = 6  # steps that import torch (full probe, collective) get this many `timeout`s
T = TypeVar("T")


class Process(Protocol):
    """A script started on a host (ssh.RemoteProcess, subprocess_link.CommandProcess)."""

    @property
    def connection(self) -> Link: ...

    def read_line(self, timeout: float) -> str | None: ...

    def write(self, data: bytes) -> None: ...

    def close_stdin(self) -> None: ...

    def wait(self, timeout: float) -> CommandResult: ...

    def close(self) -> None: ...


class Link(Protocol):
    """How preflight runs commands on a host: an SSH connection, or srun steps inside a Slurm allocation."""

    @property
    def host(self) -> Host: ...

    @property
    def peer_ip(self) -> str: ...

    def run(self, command: str, *, stdin: bytes = b"", timeout: float) -> CommandResult: ...

    def start(self, command: str, *, timeout: float) -> Process: ...

    def python_command(self, args: Sequence[str]) -> str:
        """The shell line that runs this host's Python on BOOT (harness.targets.boot) with args."""

    def close(self) -> None: ...


class ScriptError(HarnessError):
    """A remote script did not answer: the host's python is missing, crashed, or ran out of time."""


def _command(connection: Link, script: ModuleType, args: list[str]) -> tuple[str, bytes]:
    """The command line (it names the script, for `ps`) and the stdin line that carries the script."""
    name = script.__name__.removeprefix("harness.node.")
    return connection.python_command([f"harness-{name}"]), shipped(name, [MARKER, *args])


def answer_in(text: str) -> dict[str, Any] | None:
    """The JSON answer in a script's output, if it printed one (torchrun may prefix the line)."""
    for line in text.splitlines():
        start = line.find(MARKER)
        if start >= 0:
            return json.loads(line[start + len(MARKER):])
    return None


def on_hosts(work: Callable[[str], T], names: Iterable[str]) -> dict[str, T | Exception]:
    """work(name) for every host at once; a host's exception becomes its result, not everyone's."""
    names = list(names)

    def guarded(name: str) -> T | Exception:
        try:
            return work(name)
        except Exception as exc:  # noqa: BLE001 - reported per host by the caller
            return exc

    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=min(len(names), FAN_OUT)) as pool:
        return dict(zip(names, pool.map(guarded, names), strict=True))


def failure(connection: Link, result: CommandResult) -> ScriptError:
    """Why a script gave no answer, in one line: the last thing it said on stderr and its exit status."""
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    said = lines[-1] if lines else "no output"
    hint = " (is `python:` in the inventory right?)" if result.status in (126, 127) else ""
    return ScriptError(f"{connection.host.python} on {connection.host.name} exited {result.status}: {said}{hint}")


def run_script(connection: Link, script: ModuleType, args: list[str], *, timeout: float) -> dict[str, Any]:
    """Run script to completion and return its answer, or raise ScriptError saying why there is none."""
    try:
        command, program = _command(connection, script, args)
        result = connection.run(command, stdin=program, timeout=timeout)
    except RemoteTimeout as exc:
        raise ScriptError(f"{connection.host.name}: {script.__name__} gave no answer within {timeout:g}s") from exc
    answer = answer_in(result.stdout)
    if answer is None:
        raise failure(connection, result)
    return answer


def start_script(connection: Link, script: ModuleType, args: list[str], *, timeout: float) -> Process:
    """Start a script that answers and then keeps running (until its stdin closes)."""
    command, program = _command(connection, script, args)
    process = connection.start(command, timeout=timeout)
    process.write(program)
    return process


def first_answer(process: Process, *, timeout: float) -> dict[str, Any]:
    """Read a started script's answer line, or raise ScriptError with what it said instead."""
    connection = process.connection
    deadline = time.monotonic() + timeout
    try:
        while (line := process.read_line(max(0.0, deadline - time.monotonic()))) is not None:
            answer = answer_in(line)
            if answer is not None:
                return answer
    except RemoteTimeout as exc:
        raise ScriptError(f"{connection.host.name}: no answer within {timeout:g}s") from exc
    raise failure(connection, process.wait(timeout))
