"""One thread reads every node whose link a selector can wait on (a local agent's pipe, an srun step's), instead
of a thread per node: at 2,048 nodes those were 2,048 threads taking turns at one GIL, and the health loop, whose
tick needs a good share of it, waited minutes for its turn. Each node's output is worked on as far as it has come
(Output.steps), then the thread goes on to the next ready node. Links that no selector can wait on (an SSH channel,
a pod's connection) keep a thread of their own."""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

from harness.targets.base import NodeProcess


@dataclass
class _Driven:
    process: NodeProcess
    steps: Generator[None, None, None]
    done: threading.Event


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

    def add(self, process: NodeProcess, steps: Generator[None, None, None]) -> threading.Event:
        """Read process (its readable() is not None) from now on, working on its output through steps; the event is
        set once its output ended and steps with it."""
        fd = process.readable()
        assert fd is not None
        process.drive()
        driven = _Driven(process, steps, threading.Event())
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
