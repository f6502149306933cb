"""Remote TCP reachability probe: temporary listeners, and real connections to them.

Runs on a host with the inventory's `python:` (stdlib only). argv[1] is the answer marker,
argv[2] the mode, argv[3] its JSON config; the answer is one JSON line after the marker.

listen  {"ports": [0, 29500], "lifetime": s}: bind every port (0 = an ephemeral one, as gloo and
        NCCL pick them), answer which ports it got, then serve until stdin closes or the lifetime
        ends. A client that says hello gets "ok" back, proving the connection reached this listener.
connect {"targets": [{"id", "address", "port"}], "timeout": s}: connect to every target at once and
        answer per target: ok, timeout (packets dropped), refused, no_route, no_reply or error.
"""

from __future__ import annotations

import errno
import json
import socket
import sys
import threading
import time
from typing import Any

HELLO = b"harness-preflight\n"
REPLY = b"ok\n"


def _bind(port: int) -> socket.socket:
    """A dual-stack listener like torch's TCPStore; IPv4 only where the host has no IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address: tuple[Any, ...] = ("::", port)
    except OSError:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = ("0.0.0.0", port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(sock: socket.socket) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=_answer, args=(conn,), daemon=True).start()


def _read(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _answer(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(5)
        try:
            if _read(conn, len(HELLO)) == HELLO:
                conn.sendall(REPLY)
        except OSError:
            pass


def listen(config: dict[str, Any], marker: str) -> None:
    answers = []
    for requested in config["ports"]:
        try:
            sock = _bind(requested)
        except OSError as exc:
            answers.append({"requested": requested, "port": None,
                            "error": "in use" if exc.errno == errno.EADDRINUSE else str(exc)})
            continue
        answers.append({"requested": requested, "port": sock.getsockname()[1], "error": None})
        threading.Thread(target=_serve, args=(sock,), daemon=True).start()
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            ephemeral = [int(n) for n in handle.read().split()]
    except OSError:
        ephemeral = None
    print(marker + json.dumps({"ports": answers, "ephemeral_range": ephemeral}), flush=True)
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    stop.wait(config["lifetime"])


def _connect(target: dict[str, Any], timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    result = {"id": target["id"], "status": "ok", "detail": ""}
    try:
        sock = socket.create_connection((target["address"], target["port"]), timeout=timeout)
    except TimeoutError:
        result.update(status="timeout", detail=f"no answer within {timeout:g}s")
    except ConnectionRefusedError as exc:
        result.update(status="refused", detail=str(exc))
    except OSError as exc:
        unreachable = exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
        result.update(status="no_route" if unreachable else "error", detail=str(exc))
    else:
        with sock:
            try:
                sock.sendall(HELLO)
                answered = _read(sock, len(REPLY)) == REPLY
            except OSError:
                answered = False
        if not answered:
            result.update(status="no_reply", detail="connected, but not to our listener (another service or a proxy?)")
    result["ms"] = round((time.monotonic() - started) * 1000, 1)
    return result


def connect(config: dict[str, Any], marker: str) -> None:
    results: list[dict[str, Any]] = []
    threads = [threading.Thread(target=lambda t=t: results.append(_connect(t, config["timeout"])))
               for t in config["targets"]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(marker + json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    {"listen": listen, "connect": connect}[sys.argv[2]](json.loads(sys.argv[3]), sys.argv[1])
