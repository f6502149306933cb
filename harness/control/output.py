"""The run's one stream: every node's lines with the node's prefix on the terminal (control/terminal.py),
in the node's log as they came, and with their times in the run's record (record/stream.py). Each
node's output is taken a block at a time -- all that arrived since the last read -- so that the stream
costs per read, not per line, and keeps up with any job's output. One thread (Streams) reads every node a selector
can wait on (a local or srun agent's pipe, a pod's connection); the others (SSH) are read on a thread each."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path

from harness.control.live import Block, LiveNode
from harness.control.terminal import Terminal
from harness.node.protocol import RANKS_PREFIX, expanded
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
        to the next node meanwhile: Streams). A log that cannot be written is the record's trouble
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
                    self._show(block, prefix, live)
                else:  # said while no controller watched: in the logs and the record, counted, said once (controller)
                    live.unwatched_lines += block.logged.count("\n")
                    replayed += block.logged.count("\n")
            self._show(live.release(), prefix, live)

    def _show(self, block: Block, prefix: str, live: LiveNode) -> None:
        """The block's lines on the terminal: those its agent collapsed as every rank's where it shows each line."""
        if not block.shown_lines:
            return
        shown, count = block.shown, block.shown_lines
        if not self.terminal.collapse and RANKS_PREFIX in shown:
            shown = expanded(shown, live.node.ranks)
            count = shown.count("\n")
        self.terminal.job_lines(stamped(shown, prefix), count)

# One thread reads every node whose link a selector can wait on (a local agent's pipe, an srun step's, a pod's),
# instead of a thread per node: at 2,048 nodes those were 2,048 threads taking turns at one GIL, and the health loop,
# whose tick needs a good share of it, waited minutes for its turn. Each node's output is worked on as far as it has
# come (Output.steps), then the thread goes on to the next ready node. Links that no selector can wait on (an SSH
# channel, whose relink blocks) keep a thread of their own (Output.pump).


@dataclass
class _Driven:
    process: NodeProcess
    steps: Generator[None, None, None]
    done: threading.Event
    ended: Callable[[], None]


class Streams:
    """say: where a node's reading that failed is said (the others go on)."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._added: list[tuple[int, _Driven]] = []
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._read, name="harness-streams", daemon=True)
        self._thread.start()

    def add(self, process: NodeProcess, steps: Generator[None, None, None],
            ended: Callable[[], None] = lambda: None) -> threading.Event:
        """Read process (its readable() is not None) from now on, working on its output through steps; the event is
        set once its output ended and steps with it, and ended called (on this reading thread: it must not wait)."""
        fd = process.readable()
        assert fd is not None
        process.drive()
        driven = _Driven(process, steps, threading.Event(), ended)
        with self._lock:
            self._added.append((fd, driven))
        os.write(self._wake_write, b"+")
        return driven.done

    def close(self, timeout: float | None = None) -> None:
        """Stop reading (what is left unread stays so): every node's steps closed, their files with them."""
        with self._lock:
            self._closing = True
        os.write(self._wake_write, b".")
        self._thread.join(timeout)

    def _read(self) -> None:
        try:
            while True:
                for key, _ in self._selector.select():
                    if key.fd == self._wake_read:
                        os.read(self._wake_read, 4096)
                        if self._take_added():
                            return
                        continue
                    self._turn(key.fd, key.data)
        finally:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    self._end(key.fd, key.data)
            self._selector.close()
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _take_added(self) -> bool:
        """The nodes added meanwhile registered; True once closing."""
        with self._lock:
            added, self._added = self._added, []
            closing = self._closing
        for fd, driven in added:
            self._selector.register(fd, selectors.EVENT_READ, driven)
            self._advance(fd, driven)  # its files opened, and whatever it was fed before
        return closing

    def _turn(self, fd: int, driven: _Driven) -> None:
        try:
            data = driven.process.read_ready()
        except OSError:
            data = b""
        if data is None:  # nothing whole yet (a pod's sealed message in parts)
            return
        driven.process.feed(data)
        self._advance(fd, driven)

    def _advance(self, fd: int, driven: _Driven) -> None:
        try:
            next(driven.steps)
        except StopIteration:
            self._end(fd, driven)
        except Exception as exc:  # noqa: BLE001 - one node's reading fails, not every node's: said, and it ends
            self._say(f"reading {driven.process.node.label}'s output failed ({type(exc).__name__}: {exc}); the rest of "
                      f"it is not read")
            self._end(fd, driven)

    def _end(self, fd: int, driven: _Driven) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)
        driven.steps.close()
        driven.done.set()
        driven.ended()
