"""The simulated nodes' own network. torch's rendezvous store (TCPStore) has no authentication and listens on
every address: on a shared machine any user who reads the job's port from /proc could join the store, poison
or break it, and under `rdzv: c10d` set a pickle that torchrun's dynamic rendezvous loads, running code as the
job's user. So every agent of a launch runs in a network namespace of the controller's making, where loopback
is the only interface and nothing outside the job has an address: the store, gloo's pairs and NCCL's bootstrap
are the job's alone. A user other than root gets a user namespace too, mapping only their own uid (what
`unshare --user --map-current-user` makes): no privilege is gained, and the agents keep the user's uid.

One holder process per controller keeps the namespace and answers which ports are free inside it (only it can
tell: the job's earlier attempts are the only listeners there); each node's torchrun joins it (entry), its
agent and the job's `setup:` stay in this machine's network (a setup may download the job's data). The
namespace lives as long as any process of the job is in it: a controller lost leaves its nodes running.
Where no namespace can be made (user namespaces turned off), `reason` says why, and the store is open to every
user of the machine, as under plain torchrun.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

from harness.node.store_port import free_port, is_free

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# The holder runs the harness's own interpreter, isolated (-I -S) as the node agent is, with the harness's
# folder on its path so that it can import this module and store_port (standard library only).
_ROOT = str(Path(__file__).resolve().parents[3])
_HOLD = f"import sys; sys.path.insert(0, {_ROOT!r}); from harness.targets.local.private_net import hold; hold()"
# Joins the holder's namespaces (argv: its pid, then user,net or net: a user namespace first), then execs the rest
# of argv. A fresh interpreter is single-threaded, as joining a user namespace requires.
_ENTER = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for kind in sys.argv[2].split(","):
    if libc.setns(os.open(f"/proc/{sys.argv[1]}/ns/{kind}", os.O_RDONLY), 0) != 0:
        sys.exit(f"harness: could not join the job's network ({kind}): {os.strerror(ctypes.get_errno())}")
os.execvp(sys.argv[3], sys.argv[3:])
"""


def loopback_up() -> None:
    """A new network namespace's loopback starts down: bring it up (what `ip link set lo up` does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        name = b"lo".ljust(16, b"\0")
        flags = struct.unpack("16sH", fcntl.ioctl(sock, SIOCGIFFLAGS, name + bytes(24))[:18])[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", name, flags | IFF_UP) + bytes(22))


def hold() -> None:
    """The holder, inside the new namespace: loopback up, then `port` -> a free port, `free N` -> yes/no, one
    line each, until its controller closes stdin."""
    loopback_up()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words == ["port"]:
            print(free_port(), flush=True)
        elif len(words) == 2 and words[0] == "free" and words[1].isdigit():
            print("yes" if is_free(int(words[1])) else "no", flush=True)
        else:
            print("?", flush=True)


class PrivateNetwork:
    """A launch's network namespace, made on first use. Thread-safe: the attempt's plan and the next attempt's
    standbys ask it from different threads."""

    def __init__(self, python: str = sys.executable) -> None:
        self._python = python
        self._lock = threading.Lock()
        self._holder: subprocess.Popen[str] | None = None
        self.reason: str | None = None  # why there is none: the store is then open to the machine's users

    def _own_user(self) -> bool:
        """A user namespace too: only root may make a network namespace without one."""
        return os.geteuid() != 0

    def _start(self) -> subprocess.Popen[str] | None:
        if self._holder is not None or self.reason is not None:
            return self._holder
        unshare = shutil.which("unshare")
        if unshare is None:
            self.reason = "util-linux's unshare is not on PATH"
            return None
        user = ["--user", "--map-current-user"] if self._own_user() else []
        holder = subprocess.Popen([unshare, *user, "--net", "--", self._python, "-I", "-S", "-c", _HOLD],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
        assert holder.stdout is not None and holder.stderr is not None
        if holder.stdout.readline().strip() != "ready":
            said = holder.stderr.read().strip().splitlines()
            holder.wait()
            self.reason = f"no network namespace could be made here ({said[-1] if said else 'unshare failed'})"
            return None
        self._holder = holder
        return holder

    def _ask(self, question: str) -> str | None:
        with self._lock:
            holder = self._start()
            if holder is None:
                return None
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(question + "\n")
            holder.stdin.flush()
            return holder.stdout.readline().strip()

    def available(self) -> bool:
        with self._lock:
            return self._start() is not None

    def free_port(self) -> int:
        """A port free inside the namespace (an earlier attempt's store may still hold its own)."""
        answer = self._ask("port")
        return int(answer) if answer else free_port()

    def is_free(self, port: int) -> bool:
        answer = self._ask(f"free {port}")
        return answer == "yes" if answer else is_free(port)

    def entry(self, python: str) -> tuple[str, ...]:
        """The words that run a command inside the namespace (none where there is none): python (the node's own, so
        that a setup that puts the interpreter of the command it runs first on PATH finds the job's) joins it and
        execs the command in its own place: the pid is the command's."""
        with self._lock:
            holder = self._start()
        if holder is None:
            return ()
        kinds = "user,net" if self._own_user() else "net"
        return (python, "-I", "-S", "-c", _ENTER, str(holder.pid), kinds)

    def close(self) -> None:
        """End the holder: the namespace lives on while any node of the job is in it."""
        with self._lock:
            holder, self._holder = self._holder, None
        if holder is not None:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait()
