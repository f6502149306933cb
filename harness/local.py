"""Local backend: each planned node is a torchrun agent process on this machine."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from typing import Iterator

from harness.plan import NodePlan
from harness.procs import kill_run_processes
from harness.supervisor import Outcome

_PR_SET_PDEATHSIG = 1


def _stop_with_parent() -> None:
    """In the child: get SIGTERM when the harness dies, so a SIGKILLed controller leaves nothing running."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalNode:
    """One torchrun agent in a session of its own (its process group is the unit we signal)."""

    def __init__(self, node: NodePlan) -> None:
        self.node = node
        self._proc = subprocess.Popen(
            node.argv,
            env=os.environ | node.env,
            cwd=node.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_stop_with_parent,
            text=True,
            errors="replace",
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def output(self) -> Iterator[str]:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            yield line.rstrip("\n")

    def wait(self) -> Outcome:
        code = self._proc.wait()
        return Outcome(exit_code=None, signal=-code) if code < 0 else Outcome(exit_code=code)

    def _signal_group(self, sig: int) -> None:
        if self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)
        kill_run_processes(self.node.env["HARNESS_RUN_ID"], self.node.env["NODE_RANK"])


def start_local_nodes(nodes: tuple[NodePlan, ...]) -> list[LocalNode]:
    """All or nothing: if one node cannot start, the ones already started are killed."""
    started: list[LocalNode] = []
    try:
        for node in nodes:
            started.append(LocalNode(node))
    except BaseException:
        for process in started:
            process.kill()
        raise
    return started
