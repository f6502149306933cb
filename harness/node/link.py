"""The node agent's link to its controller, and what the agent keeps while it has none; and, run as a program,
the way a new controller takes it back (docs/recovery.md: a job that outlives its controller).

The first link is the agent's stdin and stdout (a local pipe, an SSH channel, an srun step). When it ends
without the controller's words (the controller killed, its connection cut, its machine gone), the node runs
on: everything the agent would have said (the node's output, its health samples, its exit) goes to a spool
file in the agent's private directory, with the time it was said (AT messages), up to SPOOL_BYTES. A
controller takes the node back through the Unix socket `control` in that directory (mode 0700, and the
peer's uid checked: only the job's user), after an ATTACH word naming the run: it is sent an UNWATCHED
message, the spool, then WATCHED, and from then on the live output.

Nothing is said twice or lost on the way. Everything the agent says is one stream of bytes, and its last
RESEND_BYTES are kept: a lost controller may not have logged what was in flight (a pipe's, a socket's, an SSH
channel's buffers). Its controller records how far in the stream its logs are (harness.record.stream); a new
one names that place in its ATTACH word (`ATTACH RUN_ID FROM`), and is sent the stream from there: UNWATCHED
says where the replay starts (`from`) and WATCHED where the live stream goes on (`at`).

The new controller reaches the socket through this module run as a program on the agent's host, under the
job's user (locally, or through an SSH login, the proof SSH already asks for):

    python -I -S -c "$BOOT" harness-relay RUN_ID NODE_RANK ATTEMPT

It finds the agent's private directory by the file in it that names the node (IDENTITY), connects, says
ATTACH RUN_ID, and from then on passes its stdin to the agent and the agent's words back on its stdout: to
the controller it is the agent. No agent of that node here: a line that says so, and exit status 3.
Standard library only, as the agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import select
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from typing import BinaryIO

from harness.node.protocol import Kind, Word, message_line, parse_word, word_line

SPOOL_BYTES = 256 << 20  # what a node may say while unwatched; beyond, its output is counted, not kept
# What the agent keeps of what it sent: far more than a pipe, a socket and an SSH channel hold in flight.
RESEND_BYTES = 8 << 20
AT_EVERY = 0.5  # seconds between the spool's time marks: the record's times of spooled lines are this close
REPLAY_CHUNK = 1 << 20  # the spool is replayed in chunks: the node's output is never held up for the whole of it
HELLO_SECONDS = 5.0  # how long a new connection has to say its ATTACH word
AGENT_DIRECTORY = re.compile(r"^harness-agent-(\d+)-(\d+)-")  # an agent's private directory: its pid and start time
CONTROL = "control"  # the socket's name in the agent's private directory
NO_AGENT = 3  # the relay's exit status where no agent of the node is left
IDENTITY = "node"  # the file there that says whose node it is: `RUN_ID NODE_RANK ATTEMPT` (harness.node.relay)


class Link:
    """One controller's link: where its words come from and where the agent's output goes."""

    def __init__(self, read_fd: int, write_fd: int, sock: socket.socket | None = None) -> None:
        self.read_fd, self.write_fd, self.sock = read_fd, write_fd, sock
        self.resume_from: int | None = None  # where in the stream the controller's logs are (None: it does not say)
        self.broken = threading.Event()  # no more is sent on it
        os.set_blocking(write_fd, False)  # a stuck reader (a cut network) never blocks the node's output for good

    def send(self, data: bytes) -> bytes:
        """What could not be sent (empty: all was): the link broke before or while it was."""
        view = memoryview(data)
        while view and not self.broken.is_set():
            try:
                view = view[os.write(self.write_fd, view):]
            except BlockingIOError:
                select.select([], [self.write_fd], [], 0.2)
            except OSError:
                self.broken.set()
        return bytes(view)

    def close(self) -> None:
        """The controller's end is gone: its descriptors released (stdin and stdout become /dev/null)."""
        self.broken.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            return
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (self.read_fd, self.write_fd):
            os.dup2(null, fd)
        os.close(null)


class ControllerLink:
    """The agent's one way to say anything: to the controller while it has one, to the spool while it has none.
    first: the link it was started with; directory: the agent's private directory (None: it has none, so nothing
    can take the node back)."""

    def __init__(self, run_id: str, first: Link, directory: str | None) -> None:
        self.run_id = run_id
        self._lock = threading.Lock()
        self.current: Link | None = first
        self.lost_at: float | None = None  # when the last link was lost, while there is none
        self._spool_path = os.path.join(directory, "spool") if directory else None
        self._spool: BinaryIO | None = None
        self._spooled = self._dropped = 0
        self._marked = 0.0
        self._said = 0  # the length of the stream: everything said, to a controller or the spool
        self._spool_from = 0  # where the spool starts in the stream (where the last link was lost)
        self._recent: deque[tuple[int, bytes]] = deque()  # the stream's last RESEND_BYTES: (where, what)
        self._recent_bytes = 0
        self.incoming: queue.Queue[Link] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self._listener: socket.socket | None = None
        if directory is not None:
            with contextlib.suppress(OSError):  # a path too long for a socket: nothing can take the node back
                self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listener.bind(os.path.join(directory, CONTROL))
                self._listener.listen(4)
                threading.Thread(target=self._accept, daemon=True).start()

    @property
    def reachable(self) -> bool:
        """Whether a new controller can take the node back."""
        return self._listener is not None

    def write(self, data: bytes) -> None:
        """The node's output or a message, in one piece, to whoever listens; never raises."""
        with self._lock:
            self._remember(data)
            if self.current is not None:
                data = self.current.send(data)
                if not data:
                    return
                self._lose(unsent=len(data))
            self._keep(data)

    def _remember(self, data: bytes) -> None:
        """data, said: kept with the last RESEND_BYTES said (under the lock)."""
        self._recent.append((self._said, data))
        self._said += len(data)
        self._recent_bytes += len(data)
        while self._recent_bytes - len(self._recent[0][1]) >= RESEND_BYTES:
            self._recent_bytes -= len(self._recent.popleft()[1])

    def _resend(self, start: int | None) -> tuple[int, bytes]:
        """The stream from start (None: the spool's start) up to the spool's start, as far as it is kept: where
        what is sent again begins, and what (under the lock)."""
        first = self._recent[0][0] if self._recent else self._said
        begin = min(max(start if start is not None else self._spool_from, first), self._spool_from)
        return begin, b"".join(data[max(0, begin - at):self._spool_from - at] for at, data in self._recent
                               if at + len(data) > begin and at < self._spool_from)

    def _keep(self, data: bytes) -> None:
        """Into the spool, after a time mark when the last is AT_EVERY old (under the lock)."""
        if self._spool_path is None:
            self._dropped += len(data)
            return
        now = time.time()
        if now - self._marked >= AT_EVERY:
            data = message_line(Kind.AT, f"{now:.3f}") + data
            self._marked = now
        if self._spooled + len(data) > SPOOL_BYTES:
            self._dropped += len(data)
            return
        try:
            if self._spool is None:
                self._spool = open(self._spool_path, "ab")  # noqa: SIM115 - open while unwatched
            self._spool.write(data)
            self._spool.flush()
            self._spooled += len(data)
        except OSError:  # a full disk: counted, as beyond the limit
            self._dropped += len(data)

    def _lose(self, unsent: int = 0) -> None:
        """The current link is gone, the last `unsent` bytes said not sent on it (under the lock)."""
        if self.current is not None:
            self.current.close()
            self.current = None
            self.lost_at = time.time()
            self._marked = 0.0
            self._spool_from = self._said - unsent

    def lose(self, link: Link) -> None:
        """The link's controller is gone (its end of file, its silence, or a newer controller): the spool from now."""
        link.broken.set()
        with self._lock:
            if self.current is link:
                self._lose()

    def wait_word(self, link: Link, timeout: float) -> bytes | None:
        """What the link said (b"": its end of file); None: nothing within timeout, or a newer controller waits
        in self.incoming."""
        deadline = time.monotonic() + timeout
        while True:
            readable, _, _ = select.select([link.read_fd, self._wake_r], [], [], max(0.0, deadline - time.monotonic()))
            if self._wake_r in readable:
                os.read(self._wake_r, 64)
            if not readable or not self.incoming.empty():
                return None
            if link.read_fd in readable:
                try:
                    return os.read(link.read_fd, 4096)
                except OSError:
                    return b""

    def await_controller(self, deadline: float) -> Link | None:
        """The next controller's link, by the deadline (time.time()); None: none came."""
        while (left := deadline - time.time()) > 0:
            try:
                return self.incoming.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
        return None

    def attach(self, link: Link) -> bool:
        """A new controller's link: what its logs lack of what was sent before the loss, the spool, then the live
        output. False: that link broke during the replay (the node stays unwatched)."""
        with self._lock:
            begin, resent = self._resend(link.resume_from)
            header = {"lost_at": self.lost_at, "bytes": self._spooled, "dropped": self._dropped, "from": begin}
        if link.send(message_line(Kind.UNWATCHED, json.dumps(header)) + resent):
            return False
        offset = 0
        while True:
            with self._lock:
                chunk = self._read_spool(offset)
                if not chunk:
                    if link.send(message_line(Kind.WATCHED, json.dumps({"at": self._said}))):
                        return False
                    self._reset_spool()
                    self.current, self.lost_at = link, None
                    return True
            if link.send(chunk):
                return False
            offset += len(chunk)

    def _read_spool(self, offset: int) -> bytes:
        if self._spool is None or self._spool_path is None:
            return b""
        with open(self._spool_path, "rb") as spool:
            spool.seek(offset)
            return spool.read(REPLAY_CHUNK)

    def _reset_spool(self) -> None:
        if self._spool is not None and self._spool_path is not None:
            with contextlib.suppress(OSError):
                self._spool.close()
                os.unlink(self._spool_path)
        self._spool, self._spooled, self._dropped = None, 0, 0

    def delivered(self) -> bool:
        """Whether everything said so far reached a controller."""
        with self._lock:
            return self.current is not None and not self.current.broken.is_set()

    def _accept(self) -> None:
        """Connections on the control socket: the job's user's, that name this run, become incoming links."""
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._hello, args=(sock,), daemon=True).start()

    def _hello(self, sock: socket.socket) -> None:
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        sock.settimeout(HELLO_SECONDS)
        line = b""
        with contextlib.suppress(OSError):
            while not line.endswith(b"\n") and len(line) < 512:
                if not (byte := sock.recv(1)):
                    break
                line += byte
        word, argument = parse_word(line) or (None, "")
        run_id, _, resume_from = argument.partition(" ")
        if uid != os.getuid() or word is not Word.ATTACH or run_id != self.run_id or \
                not (resume_from == "" or resume_from.isdigit()):
            sock.close()
            return
        sock.settimeout(None)
        link = Link(sock.fileno(), sock.fileno(), sock)
        link.resume_from = int(resume_from) if resume_from else None
        self.incoming.put(link)
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()




def control_socket(run_id: str, node_rank: str, attempt: str, parent: str) -> str | None:
    """The control socket of this user's agent of the node in parent (None: there is none)."""
    wanted = f"{run_id} {node_rank} {attempt}"
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):
                if AGENT_DIRECTORY.match(name) and os.stat(path).st_uid == os.getuid():
                    with open(os.path.join(path, IDENTITY), encoding="utf-8") as handle:
                        if handle.read().strip() == wanted and os.path.exists(os.path.join(path, CONTROL)):
                            return os.path.join(path, CONTROL)
    return None


def _copy(read_fd: int, write: socket.socket | int) -> None:
    """Until read_fd's end (the agent is told that of the controller's words: the controller is gone)."""
    with contextlib.suppress(OSError):
        while chunk := os.read(read_fd, 1 << 16):
            if isinstance(write, socket.socket):
                write.sendall(chunk)
            else:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(write, view):]
    if isinstance(write, socket.socket):
        with contextlib.suppress(OSError):
            write.shutdown(socket.SHUT_WR)


def main(argv: list[str]) -> None:
    """argv: the run, node rank and attempt of the agent to reach; then where in its stream the controller's logs
    are (empty: the controller does not know)."""
    run_id, node_rank, attempt, resume_from = (*argv[:4], "")[:4]
    path = control_socket(run_id, node_rank, attempt, tempfile.gettempdir())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if path is None:
            raise FileNotFoundError
        sock.connect(path)
        sock.sendall(word_line(Word.ATTACH, f"{run_id} {resume_from}".strip()))
    except OSError:
        sys.stdout.write(f"harness relay: no node agent of run {run_id} node {node_rank} attempt {attempt} on "
                         f"this host (its node ended, or no controller took it back within supervision.grace)\n")
        sys.stdout.flush()
        os._exit(NO_AGENT)
    threading.Thread(target=_copy, args=(0, sock), daemon=True).start()  # the controller's words
    _copy(sock.fileno(), 1)  # the agent's output, until the agent closes its end
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
