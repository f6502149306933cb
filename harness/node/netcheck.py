"""Remote TCP reachability probe: temporary listeners, and real connections to them.

Runs on a host with the inventory's `python:` (stdlib only). argv[1] is the answer marker,
argv[2] the mode, argv[3] its JSON config; the answer is one JSON line after the marker.

listen  {"ports": [0, 29500], "lifetime": s, "keep": 29500?}: bind every port (0 = an ephemeral one, as gloo
        and NCCL pick them), and the same UDP port where it is free, answer which ports it got, then serve
        until stdin closes or the lifetime ends. A client that says hello gets "ok" back, proving the
        connection reached this listener; a datagram gets its size back. keep: that port kept from the host's
        other users as the job's agent keeps its store (store_port.keep_store), while it serves; the answer's
        "kept" is null, or why not.
connect {"targets": [{"id", "address", "port", "frame"?}], "timeout": s}: connect to every target at
        once and answer per target: ok, timeout (packets dropped), refused, no_route, no_reply or
        error. With "frame" (bytes, the sender's MTU), also send one datagram that fills such a frame
        with don't-fragment set: "frame" ok, lost (the path is narrower: a black hole) or error. With
        "as_other_user", the connection is opened by another user of the host (nobody, where this runs as
        root: "not_root" otherwise), as one who would reach the job's store.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from harness.node.store_port import keep_store, release_store

HELLO = b"harness-preflight\n"
REPLY = b"ok\n"
# <linux/in.h>, <linux/in6.h>: set don't-fragment and send up to the interface's MTU, whatever the route's cache says.
IP_MTU_DISCOVER, IPV6_MTU_DISCOVER, PMTUDISC_PROBE = 10, 23, 3
HEADERS = {socket.AF_INET: 28, socket.AF_INET6: 48}  # IP + UDP header bytes
# The largest datagram a frame can carry: IPv4's 16-bit total length, IPv6's payload length plus its header.
# Loopback's MTU (65536) is larger, and no datagram fills it.
LARGEST = {socket.AF_INET: 65535, socket.AF_INET6: 65535 + 40}
FRAME_TRIES = 3
NOBODY = 65534


def _bind(port: int, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """A dual-stack listener like torch's TCPStore; IPv4 only where the host has no IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, kind)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address: tuple[Any, ...] = ("::", port)
    except OSError:
        sock = socket.socket(socket.AF_INET, kind)
        address = ("0.0.0.0", port)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        if kind == socket.SOCK_STREAM:
            sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def _echo_sizes(sock: socket.socket) -> None:
    while True:
        try:
            data, peer = sock.recvfrom(65535)
            sock.sendto(str(len(data)).encode(), peer)
        except OSError:
            return


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
        port = sock.getsockname()[1]
        threading.Thread(target=_serve, args=(sock,), daemon=True).start()
        try:
            datagrams = _bind(port, socket.SOCK_DGRAM)
        except OSError:
            udp = False
        else:
            udp = True
            threading.Thread(target=_echo_sizes, args=(datagrams,), daemon=True).start()
        answers.append({"requested": requested, "port": port, "error": None, "udp": udp})
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            ephemeral = [int(n) for n in handle.read().split()]
    except OSError:
        ephemeral = None
    keep = config.get("keep")
    kept = keep_store("preflight", keep) if keep else None
    print(marker + json.dumps({"ports": answers, "ephemeral_range": ephemeral, "kept": kept}), flush=True)
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    stop.wait(config["lifetime"])
    if keep and kept is None:
        release_store("preflight", keep)


def _connect_as_other_user(target: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The connection opened by a forked child that is nobody: no interpreter to start, no module to import from
    files root may keep from nobody; the child only connects and writes its outcome."""
    result = {"id": target["id"], "status": "not_root", "detail": "only root may connect as another user"}
    if os.geteuid() != 0:
        return result
    "".encode("idna")  # the codec a connection to a str address needs, loaded while root may read it
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                socket.create_connection((target["address"], target["port"]), timeout=timeout).close()
                said = "ok"
            except ConnectionRefusedError:
                said = "refused"
            except TimeoutError:
                said = "timeout"
            except OSError as exc:
                said = f"error {exc}"
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, encoding="utf-8") as answer:
        said_words = answer.read().split(maxsplit=1) or ["error"]
    os.waitpid(pid, 0)
    result.update(status=said_words[0], detail=said_words[1] if len(said_words) > 1 else "")
    return result


def _connect(target: dict[str, Any], timeout: float) -> dict[str, Any]:
    if target.get("as_other_user"):
        return _connect_as_other_user(target, timeout)
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
    if target.get("frame") and result["status"] == "ok":
        result["frame"] = _frame(target["address"], target["port"], target["frame"], timeout)
    return result


def _frame(address: str, port: int, frame: int, timeout: float) -> dict[str, Any]:
    """One datagram as large as a frame of `frame` bytes, don't-fragment set, until its size comes back."""
    family, _, _, _, destination = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
    frame = min(frame, LARGEST[family])
    payload = b"\0" * (frame - HEADERS[family])
    answer = {"bytes": frame, "status": "lost", "detail": f"no answer within {timeout:g}s"}
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            if family == socket.AF_INET:
                sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, PMTUDISC_PROBE)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_MTU_DISCOVER, PMTUDISC_PROBE)
            sock.connect(destination)
            sock.settimeout(timeout / FRAME_TRIES)
            for _ in range(FRAME_TRIES):
                sock.send(payload)
                try:
                    if sock.recv(64) == str(len(payload)).encode():
                        return {"bytes": frame, "status": "ok", "detail": ""}
                except TimeoutError:
                    continue
        except OSError as exc:
            answer.update(status="error", detail=exc.strerror or str(exc))
    return answer


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
