"""The user's terminal during a run: one thread writes to it, so that a slow terminal (a paused SSH
session, a pager, a slow pipe) never holds up the nodes' output, whose every line the run's record
keeps (record/stream.py). The harness's own words always reach the terminal; the job's lines may be
left out when the terminal falls too far behind, and the terminal is then told how many and where they are."""

from __future__ import annotations

import threading
from collections import deque
from typing import IO

from harness.record.stream import StreamRecord

BACKLOG_BYTES = 8 << 20  # the job's text waiting for the terminal beyond which its lines are left out here


class Terminal:
    """out: the user's stream. record: where the harness's own words are kept too, once the run's
    directory exists; logs_command: the command that shows the lines left out."""

    def __init__(self, out: IO[str], backlog_bytes: int = BACKLOG_BYTES) -> None:
        self.out = out
        self.record: StreamRecord | None = None
        self.logs_command = "harness logs RUN_ID"
        self._backlog_bytes = backlog_bytes
        self._queue: deque[str] = deque()
        self._queued = 0  # bytes of the job's text in the queue
        self._left_out = 0  # the job's lines not written here since the last notice
        self._ready = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_out, name="terminal", daemon=True)
        self._writer.start()

    def say(self, message: str) -> None:
        """A line of the harness's own: `harness: MESSAGE`."""
        self.write(f"harness: {message}\n")

    def write(self, text: str) -> None:
        """The harness's own text, whole lines: never left out, kept in the record. (The run's end report
        writes through this, as to a file.)"""
        if self.record is not None:
            self.record.harness(text)
        with self._ready:
            self._queue.append(text)
            self._ready.notify()

    def flush(self) -> None:
        """Writing is the writer thread's: nothing to wait for here (close() waits for all of it)."""

    def job_lines(self, text: str, count: int) -> None:
        """count of the job's lines in text; left out when the terminal is BACKLOG_BYTES behind."""
        with self._ready:
            if self._queued + len(text) > self._backlog_bytes:
                self._left_out += count
                return
            self._queued += len(text)
            self._queue.append(text)
            self._ready.notify()

    def close(self) -> None:
        """Once everything queued is written (a run's last words must reach the user)."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._writer.join()

    def _write_out(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue and not self._left_out:
                    break
                text = "".join(self._queue)
                self._queue.clear()
                self._queued = 0
                left_out, self._left_out = self._left_out, 0
            try:
                self.out.write(text)
                if left_out:
                    self.out.write(f"harness: this terminal fell behind the job: {left_out} of its lines are not "
                                   f"shown here (all are kept: `{self.logs_command}`)\n")
                self.out.flush()
            except (OSError, ValueError):  # a closed terminal: the record still keeps every line
                continue
