"""The IP address other machines reach a node at: MASTER_ADDR must be an IP, because hostnames
resolve differently per node (127.0.1.1 entries, IPv6-only answers). One rule for SSH hosts and for
the nodes of a Slurm allocation; each caller words the error for where the address came from."""

from __future__ import annotations

import ipaddress
import socket


class Unresolvable(Exception):
    """The address is neither an IP nor a name the resolver here answers for (the resolver's reason)."""


def resolve_ip(address: str, *, ipv4_only: bool = False) -> tuple[str, bool]:
    """(the IP, whether it was looked up): an IP stays as written; a name becomes the resolver's
    first answer here, IPv4 before IPv6. Check `is_loopback(ip)`: such an address reaches only itself."""
    try:
        return str(ipaddress.ip_address(address)), False
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, socket.AF_INET if ipv4_only else socket.AF_UNSPEC,
                                   socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise Unresolvable(getattr(exc, "strerror", None) or str(exc)) from None
    return sorted({str(info[4][0]) for info in infos}, key=lambda ip: ":" in ip)[0], True


def is_loopback(address: str) -> bool:
    """Whether address is a loopback IP (127.0.0.0/8, ::1, a zone index allowed); a name is not."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False
