"""The port of a job's rendezvous store on its host. It runs on the master host itself (shipped by
harness.targets.boot, or imported on this machine), since only that host knows what is bound there, and who is
logged in. Standard library only.

    python store_port.py      prints one free port

A free port comes from below the kernel's ephemeral range, so that between this check and torchrun's
bind no outgoing connection (gloo's, sshd's) can be handed it; it is picked at random there, so that
two launches at the same moment rarely pick the same one.

torch's TCPStore has no authentication and listens on every address; a rank's connection to it and another user's
look alike to the store, but not to the kernel, which knows which user opens each local connection. Where the node
agent runs as root, it rejects every local connection to the store's port that is not the job's user's (iptables'
owner match on loopback, IPv4 and IPv6: keep_store), from before torchrun starts until the node ends; rules a
killed agent left are swept by the next agent on the host. Other machines are not kept out here: which of their
addresses are the job's is only known on their side (docs/security.md says what a host's firewall should admit).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import socket
import subprocess
import sys

LOWEST = 20000  # below: ports that services often claim by convention
TRIES = 200
TAG = "harness-store"  # rules' comment: `harness-store RUN_ID PID`, PID the agent that keeps them
TABLES = ("iptables", "ip6tables")


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


def _rule(port: int, uid: int, tag: str) -> list[str]:
    return ["OUTPUT", "-o", "lo", "-p", "tcp", "--dport", str(port), "-m", "owner", "!", "--uid-owner", str(uid),
            "-m", "comment", "--comment", tag, "-j", "REJECT", "--reject-with", "tcp-reset"]


def _run(table: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([table, "-w", *args], capture_output=True, text=True, timeout=30, check=False)


def _rules(table: str) -> list[str]:
    """The host's OUTPUT rules that an agent set (`-A OUTPUT ...` as iptables -S prints them)."""
    listed = _run(table, ["-S", "OUTPUT"])
    return [line for line in listed.stdout.splitlines() if f'--comment "{TAG} ' in line]


def _delete(table: str, rule: str) -> None:
    words = rule.split()
    args, i = [], 0
    while i < len(words):  # the comment is one argument, quoted by iptables -S
        if words[i].startswith('"'):
            end = next(j for j in range(i, len(words)) if words[j].endswith('"'))
            args.append(" ".join(words[i:end + 1]).strip('"'))
            i = end + 1
        else:
            args.append(words[i])
            i += 1
    _run(table, ["-D", *args[1:]])


def _alive(pid: str) -> bool:
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")


def sweep() -> None:
    """Remove the rules of agents that are gone (killed before they could)."""
    for table in TABLES:
        for rule in _rules(table):
            tag = rule.split(f'--comment "{TAG} ', 1)[1].split('"', 1)[0].split()
            if len(tag) == 2 and not _alive(tag[1]):
                _delete(table, rule)


def keep_store(run_id: str, port: int) -> str | None:
    """Keep the host's other users from the store's port; None when done, else why not (the store is then open to
    them, as under plain torchrun)."""
    if os.geteuid() != 0:
        return "the node agent does not run as root"
    if shutil.which("iptables") is None:
        return "iptables is not installed"
    sweep()
    tag = f"{TAG} {run_id} {os.getpid()}"
    for table in TABLES:
        if shutil.which(table) is None:
            continue
        added = _run(table, ["-I", *_rule(port, os.getuid(), tag)])
        if added.returncode != 0:
            if table == "iptables":
                said = added.stderr.strip().splitlines()
                return f"iptables refused the rule: {said[-1] if said else 'exit code ' + str(added.returncode)}"
            continue  # no IPv6 here: nothing listens there either
    return None


def release_store(run_id: str, port: int) -> None:
    """Remove what keep_store set: the store is gone with the node."""
    tag = f"{TAG} {run_id} {os.getpid()}"
    for table in TABLES:
        if shutil.which(table) is not None:
            _run(table, ["-D", *_rule(port, os.getuid(), tag)])


if __name__ == "__main__":
    sys.stdout.write(f"{free_port()}\n")
