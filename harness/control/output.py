"""The run's one stream: every node's lines with the node's prefix on the terminal (control/terminal.py),
in the node's log as they came, and with their times in the run's record (record/stream.py). Each
node's output is taken a block at a time -- all that arrived since the last read -- so that the stream
costs per read, not per line, and keeps up with any job's output."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Generator
from pathlib import Path

from harness.control.live import Block, LiveNode
from harness.control.terminal import Terminal
from harness.plan.planner import Node
from harness.record.stream import StreamRecord, stamp, stamped
from harness.spec.progress import LinePatterns
from harness.targets.base import NodeProcess


class Output:
    """log_file: where each node's lines go (None: nowhere); record: the run's timed record (None: none);
    quiet_cpp_info: torch's C++ INFO lines are the harness's own watch (plan.STORE_WATCH_ENV), so they go
    to the log only; progress: the pattern of the job's step lines (health.progress); checkpoint: of its lines
    that say a checkpoint was saved (health.checkpoint)."""

    def __init__(self, terminal: Terminal, log_file: Callable[[Node], Path] | None = None,
                 record: StreamRecord | None = None, attempt: int = 0, quiet_cpp_info: bool = False,
                 progress: LinePatterns | None = None, checkpoint: re.Pattern[str] | None = None) -> None:
        self.terminal = terminal
        self.log_file = log_file
        self.record = record
        self.attempt = attempt
        self.quiet_cpp_info = quiet_cpp_info
        self.progress = progress
        self.checkpoint = checkpoint

    def say(self, message: str) -> None:
        self.terminal.say(message)

    def pump(self, process: NodeProcess, live: LiveNode) -> None:
        """Until the node's output ends: each block to the node's log, the record and the terminal (on a thread of
        the node's own)."""
        for _ in self.steps(process, live):
            pass

    def steps(self, process: NodeProcess, live: LiveNode) -> Generator[None, None, None]:
        """pump's work, as far as the node's output has come each time it yields (a driven node's: its reader goes on
        to the next node meanwhile, control/streams.py). A log that cannot be written is the record's trouble
        (record/disk.py): the node's output is read on whatever."""
        prefix = f"[{live.node.label}] "
        with contextlib.ExitStack() as stack:
            log = timed = mark = None
            if self.log_file is not None and self.record is not None:
                log = stack.enter_context(self.record.disk.appended(self.log_file(live.node),
                                                                    f"{live.node.label}'s log"))
            if self.record is not None:
                timed = stack.enter_context(self.record.open_node(self.attempt, live.node.node_rank))
                mark = stack.enter_context(self.record.open_mark(self.attempt, live.node.node_rank))
            # A replay after live lines is a link lost and made again (SSH): said once, when the node is live again.
            live_seen, replay, replayed = False, process.unwatched, 0
            for text in process.output():
                if text is None:
                    yield None
                    continue
                said = process.said_at  # the time its node said it, where its agent kept it while unwatched
                at = said if said is not None else time.time()
                block = live.take_block(text, at, self.quiet_cpp_info, self.progress)
                if self.checkpoint is not None:
                    live.note_saves(block.streamed, at, self.checkpoint)
                if log is not None:
                    log.write(block.logged)
                if timed is not None and block.streamed:
                    timed.write(stamped(block.streamed, f"{stamp(at)} {prefix}"))
                if mark is not None:
                    mark.write(process.position, [log.end if log is not None else None,
                                                  timed.end if timed is not None else None])
                if said is None:
                    if live_seen and process.unwatched is not replay:
                        self.say(f"{live.node.label} on {live.node.host}: its link was lost and is made again; the "
                                 f"{replayed} line(s) it said meanwhile are in its logs, not shown here")
                    live_seen, replay, replayed = True, process.unwatched, 0
                    self._show(block, prefix)
                else:  # said while no controller watched: in the logs and the record, counted, said once (controller)
                    live.unwatched_lines += block.logged.count("\n")
                    replayed += block.logged.count("\n")
            self._show(live.release(), prefix)

    def _show(self, block: Block, prefix: str) -> None:
        if block.shown_lines:
            self.terminal.job_lines(stamped(block.shown, prefix), block.shown_lines)
