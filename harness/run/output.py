"""The run's one stream: every node's lines with the node's prefix, each also appended to the node's
log, and the harness's own words between them, never two lines interleaved mid-line."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from harness.plan.planner import Node
from harness.run.live import LiveNode
from harness.targets.base import NodeProcess


class Output:
    """log_file: where each node's lines go (None: nowhere); quiet_cpp_info: torch's C++ INFO lines are
    the harness's own watch (plan.STORE_WATCH_ENV), so they go to the log only."""

    def __init__(self, out: IO[str] = sys.stdout, log_file: Callable[[Node], Path] | None = None,
                 quiet_cpp_info: bool = False) -> None:
        self.out = out
        self.log_file = log_file
        self.quiet_cpp_info = quiet_cpp_info
        self._lock = threading.Lock()

    def say(self, message: str) -> None:
        self._write(f"harness: {message}\n")

    def pump(self, process: NodeProcess, live: LiveNode) -> None:
        """Until the node's output ends: each line to its log, and to the stream unless live.take hides it."""
        prefix = f"[{live.node.label}] "
        with contextlib.ExitStack() as stack:
            log = None
            if self.log_file is not None:
                log = stack.enter_context(open(self.log_file(live.node), "a", encoding="utf-8"))
            for raw in process.output():
                line, show = live.take(raw, self.quiet_cpp_info)
                if log is not None:
                    log.write(line + "\n")
                    log.flush()
                if show:
                    self._write(prefix + line + "\n")

    def _write(self, text: str) -> None:
        with self._lock:
            self.out.write(text)
            self.out.flush()
