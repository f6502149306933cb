"""A stand-in rank's process group: every collective a wait at node 0's coordinator (launcher.Coordinator) until
every rank has arrived, each recorded as torch's Flight Recorder records it and served as torch's worker server
serves it (POST /handler/fr_trace_json on a Unix socket), so that the harness reads it unchanged. Standard
library only: a rank costs a bare Python, not a torch import."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

RECORDED = 64  # entries kept, as TORCH_FR_BUFFER_SIZE keeps a rank's last ones
CONNECT_SECONDS = 120.0  # how long a rank tries to reach the coordinator (node 0 may start last)
GROUP = ["0", "default_pg"]


class _Group:
    def __init__(self, rank: int, world_size: int, connection: socket.socket) -> None:
        self.rank = rank
        self.world_size = world_size
        self.connection = connection
        self.replies = connection.makefile("rb")
        self.seq = 0
        self.recorded: deque[dict[str, Any]] = deque(maxlen=RECORDED)
        self.lock = threading.Lock()


_groups: list[_Group] = []  # the process group this rank joined (none before init_process_group)


def init_process_group(backend: str = "gloo", **_: Any) -> None:
    """Join the coordinator at MASTER_ADDR:MASTER_PORT as RANK of WORLD_SIZE."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            connection = socket.create_connection(address, timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    connection.settimeout(None)
    connection.sendall(f"hello {rank}\n".encode())
    _groups.append(_Group(rank, world_size, connection))
    if os.environ.get("TORCH_CPP_LOG_LEVEL", "").upper() == "INFO":  # as torch's store client says it joined
        now = time.time()
        print(f"[I{time.strftime('%m%d %H:%M:%S', time.localtime(now))}.{int(now % 1 * 1e6):06d} socket.cpp:955] "
              f"[c10d] The client socket has connected to [{address[0]}]:{address[1]} on SocketImpl(fd=3)",
              file=sys.stderr, flush=True)


def is_initialized() -> bool:
    return bool(_groups)


def get_rank() -> int:
    return _joined().rank


def get_world_size() -> int:
    return _joined().world_size


def all_reduce(value: float = 0.0, op: str = "sum") -> float:
    """Waits until every rank has entered this collective (the coordinator's word); returns value."""
    return _collective("all_reduce", value)


def barrier() -> None:
    _collective("barrier", 0.0)


def destroy_process_group() -> None:
    """Leave the group (a rank that ends without it is a dead one to its peers)."""
    if _groups:
        connection = _groups.pop().connection
        with contextlib.suppress(OSError):
            connection.sendall(b"bye\n")
        connection.close()


def _joined() -> _Group:
    if not _groups:
        raise RuntimeError("Default process group has not been initialized, please make sure to call "
                           "init_process_group.")
    return _groups[0]


def _collective(op: str, value: float) -> float:
    group = _joined()
    with group.lock:
        group.seq += 1
        entry = {"process_group": GROUP, "collective_seq_id": group.seq, "p2p_seq_id": 0, "is_p2p": False,
                 "profiling_name": f"gloo:{op}", "time_created_ns": time.time_ns(), "state": "scheduled",
                 "retired": False, "input_sizes": [[1]]}
        group.recorded.append(entry)
    group.connection.sendall(f"{group.seq}\n".encode())
    if group.replies.readline() != f"{group.seq}\n".encode():
        raise RuntimeError(f"[standin] Read error [{os.environ.get('MASTER_ADDR')}]: Connection reset by peer")
    with group.lock:
        entry.update(state="completed", retired=True)
    return value


def _trace() -> bytes:
    if not _groups:
        return b'{"entries": []}'
    group = _groups[0]
    with group.lock:
        return json.dumps({"entries": [dict(entry) for entry in group.recorded]}).encode()


class WorkerServer:
    """torch._C._distributed_c10d._WorkerServer's part that the harness reads: HTTP on a Unix socket, a thread
    of its own (torch's answers without the GIL; this one needs the rank's main thread to let it run, which a
    rank asleep or waiting does)."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        threading.Thread(target=self._serve, name="standin-worker-server", daemon=True).start()

    def _serve(self) -> None:
        while True:
            connection, _ = self.listener.accept()
            with connection:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = connection.recv(4096)
                    if not chunk:
                        break
                    request += chunk
                found = request.startswith(b"POST /handler/fr_trace_json ")
                body = _trace() if found else b"not found"
                status = b"200 OK" if found else b"404 Not Found"
                connection.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                                   + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
