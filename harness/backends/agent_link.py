"""The controller's end of the node agent protocol (node_agent.py), whatever carries the bytes.

A backend starts the agent with `agent_argv` (a local pipe, an SSH channel) and wraps the stream
in an AgentNode subclass; the supervisor then sees one NodeProcess contract on every backend.
"""

from __future__ import annotations

import contextlib
import shlex
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from harness.backends.base import NodeProcess, Outcome
from harness.backends.node_agent import EXIT_MARKER
from harness.plan import NodePlan
from harness.shell import shell_command

AGENT_SOURCE = (Path(__file__).parent / "node_agent.py").read_text(encoding="utf-8")
OUTPUT_DRAIN_SECONDS = 5.0  # after the agent ended, how long its last lines may take to be read


def agent_argv(python: str, node: NodePlan, grace: float) -> list[str]:
    """The agent under `python -I -S`: no site-packages, so it can only ever use the standard library."""
    return [python, "-I", "-S", "-c", AGENT_SOURCE, node.env["HARNESS_RUN_ID"], str(node.node_rank), f"{grace:g}",
            shell_command(node), shlex.join(node.cleanup)]


def agent_env(node: NodePlan) -> dict[str, str]:
    """The agent carries its run's identity too, so that a sweep by run id also finds a stuck agent."""
    return {"HARNESS_RUN_ID": node.env["HARNESS_RUN_ID"], "NODE_RANK": node.env["NODE_RANK"]}


def start_all(nodes: Iterable[NodePlan], start: Callable[[NodePlan], AgentNode]) -> list[NodeProcess]:
    """Every node or none: if one cannot start, the ones already started are killed."""
    started: list[NodeProcess] = []
    try:
        for node in nodes:
            started.append(start(node))
    except BaseException:
        for process in started:
            process.kill()
        raise
    return started


class AgentNode(ABC):
    """One node as the supervisor sees it: lines in, TERM/KILL words out, the exit code from the agent."""

    def __init__(self, node: NodePlan) -> None:
        self.node = node
        self._exit_code: int | None = None
        self._output_done = threading.Event()
        self._send_lock = threading.Lock()

    @abstractmethod
    def _lines(self) -> Iterable[bytes]:
        """The agent's raw stdout lines until it ends (raising OSError/EOFError when the link breaks)."""

    @abstractmethod
    def _send(self, data: bytes) -> None:
        """Write to the agent's stdin (raising OSError when the agent is gone)."""

    @abstractmethod
    def _wait_agent(self) -> str:
        """Block until the agent has ended; say how it ended, for when it reported no exit code."""

    @abstractmethod
    def _agent_lost(self) -> None:
        """The agent ended without reporting, so it may not have stopped its node: what the backend can do."""

    def output(self) -> Iterator[str]:
        try:
            for raw in self._lines():
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if line.startswith(EXIT_MARKER):
                    self._exit_code = int(line.split()[-1])
                    continue
                yield line
        except (OSError, EOFError):
            return
        finally:
            self._output_done.set()

    def wait(self) -> Outcome:
        lost = self._wait_agent()
        self._output_done.wait(timeout=OUTPUT_DRAIN_SECONDS)
        if self._exit_code is None:
            self._agent_lost()
            return Outcome(exit_code=None, error=lost)
        return Outcome.from_returncode(self._exit_code)

    def _word(self, word: str) -> None:
        with self._send_lock, contextlib.suppress(OSError, EOFError):  # an ended agent needs no word
            self._send(f"{word}\n".encode())

    def terminate(self) -> None:
        self._word("TERM")

    def kill(self) -> None:
        self._word("KILL")
