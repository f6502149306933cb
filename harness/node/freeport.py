"""A TCP port that nobody holds on this host, for a job's rendezvous (`master_port: auto`). It runs on
the master host itself (shipped by harness.targets.boot, or imported on this machine), since only that
host knows what is bound there. Standard library only.

    python freeport.py      prints one free port

The port comes from below the kernel's ephemeral range, so that between this check and torchrun's
bind no outgoing connection (gloo's, sshd's) can be handed it; it is picked at random there, so that
two launches at the same moment rarely pick the same one.
"""

from __future__ import annotations

import errno
import random
import socket
import sys

LOWEST = 20000  # below: ports that services often claim by convention
TRIES = 200


def ephemeral_start() -> int:
    """Where the kernel starts handing out ports for outgoing connections (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def is_free(port: int) -> bool:
    """Whether a listener could bind port on every address now. SO_REUSEADDR as torch's TCPStore sets
    it: a port left in TIME_WAIT by an earlier attempt is free, one that something listens on is not."""
    families = [socket.AF_INET] + ([socket.AF_INET6] if socket.has_ipv6 else [])
    for family in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("::" if family == socket.AF_INET6 else "", port))
                sock.listen(1)
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):  # no IPv6 here
                continue
            return False
    return True


def free_port() -> int:
    """A free port below the ephemeral range, or one the kernel hands out when that range is too small."""
    top = ephemeral_start()
    if top - LOWEST >= TRIES:
        for port in random.sample(range(LOWEST, top), TRIES):
            if is_free(port):
                return port
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.stdout.write(f"{free_port()}\n")
