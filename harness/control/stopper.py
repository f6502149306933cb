"""Stopping a run: Ctrl-C and SIGTERM to the controller become one stop request (stop_on_signals), and
every node of an attempt is stopped: TERM now, KILL to whatever is left after the grace period, and KILL
to every agent at the end, which sweeps stragglers (workers that outlived their torchrun). A failed node
must not leave the survivors hanging in a collective until NCCL or gloo time out."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from harness.control.live import LiveNode
from harness.targets.base import NodeProcess

POLL_SECONDS = 0.05


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Ctrl-C and SIGTERM (`harness stop` sends it) set stop, the one handler of both: the run then ends as a
    stop, not an error (`harness stop`'s marker tells stopped from interrupted: results.stopped_status)."""
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class Stopper:
    """grace: SIGTERM-to-SIGKILL seconds; nodes: the attempt's started nodes (the supervisor's list, filled
    as it starts them). since: when the stop began (None: not stopping)."""

    def __init__(self, grace: float, nodes: list[tuple[NodeProcess, LiveNode]]) -> None:
        self.grace = grace
        self.since: float | None = None
        self._nodes = nodes
        self._killers: list[threading.Thread] = []

    def stop_all(self) -> None:
        """SIGTERM every running node now; SIGKILL whatever is left after the grace period (in background)."""
        if self.since is None:
            self.since = time.time()
        for process, live in self._nodes:
            if live.outcome is None:
                live.stopping()
                process.terminate()
        killer = threading.Thread(target=self._kill_after_grace, daemon=True)
        killer.start()
        self._killers.append(killer)

    def _kill_after_grace(self) -> None:
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline:
            if all(live.outcome is not None for _, live in self._nodes):
                return
            time.sleep(POLL_SECONDS)
        for process, live in self._nodes:
            if live.outcome is None:
                process.kill()

    def sweep(self) -> None:
        """Every node has ended: KILL to every agent sweeps what its node left behind."""
        for process, _ in self._nodes:
            process.kill()
        for killer in self._killers:
            killer.join(timeout=2)
