"""SSH to inventory hosts (paramiko): every failure classified, host keys verified, remote work bounded.

`connect` tells apart the failures a user fixes differently (bad name, nothing listening, firewall,
wrong network, rejected key, changed or unknown host key) and says the fix in one line. A
`Connection` runs commands on its one transport, each on its own session channel, and every wait
has a deadline; a remote command that overruns is stopped as a whole process tree, because closing
a channel without a pty leaves the remote process running.
"""

from __future__ import annotations

import codecs
import errno
import getpass
import logging
import select
import shlex
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import paramiko

from harness.errors import HarnessError
from harness.spec.inventory import Host
from harness.targets.boot import shipped
from harness.targets.host_command import CommandResult, RemoteTimeout, python_line, run_to_end

DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"
CONNECT_KINDS = (
    "dns", "refused", "timeout", "no_route", "network", "protocol", "auth", "hostkey_mismatch", "hostkey_unknown",
)
_PID_PREFIX = b"HARNESS_REMOTE_PID="
_KNOWN_HOSTS_LOCK = threading.Lock()

# paramiko logs handshake failures through the root logger's last-resort handler; we classify them.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

class SSHConnectError(HarnessError):
    """A host could not be reached or authenticated: `kind` (one of CONNECT_KINDS), a reason, the fix."""

    def __init__(self, host: Host, kind: str, reason: str, fix: str | None = None) -> None:
        assert kind in CONNECT_KINDS, kind
        self.host = host
        self.kind = kind
        self.reason = reason
        self.fix = fix
        super().__init__(f"{host.name}: {reason}" + (f"; {fix}" if fix else ""))


def known_hosts_name(address: str, port: int) -> str:
    """The name OpenSSH files a host key under: `addr`, or `[addr]:port` off port 22."""
    return address if port == 22 else f"[{address}]:{port}"


def _user(host: Host) -> str:
    return host.user or getpass.getuser()


def _login(host: Host) -> str:
    return f"{_user(host)}@{host.address}"


def _target(host: Host) -> str:
    return f"{_login(host)}:{host.port}"


def _load_key(host: Host) -> paramiko.PKey | None:
    if host.identity_file is None:
        return None
    path = Path(host.identity_file).expanduser()
    try:
        return paramiko.PKey.from_path(path)
    except FileNotFoundError:
        raise SSHConnectError(host, "auth", f"identity file {path} does not exist", (
            f"fix `identity_file:` in the inventory or create a key with `ssh-keygen -t ed25519 -f {path}`"
        )) from None
    except paramiko.PasswordRequiredException:
        raise SSHConnectError(host, "auth", f"identity file {path} is passphrase-protected", (
            "load it into ssh-agent and remove `identity_file:` from the inventory, or use an unencrypted deploy key"
        )) from None
    except (paramiko.SSHException, OSError, ValueError) as exc:
        raise SSHConnectError(host, "auth", f"cannot read identity file {path} ({exc})",
                              "point `identity_file:` at an OpenSSH private key") from None


def _socket_error(host: Host, exc: OSError, timeout: float) -> SSHConnectError:
    where = f"{host.address}:{host.port}"
    if isinstance(exc, TimeoutError):
        return SSHConnectError(
            host, "timeout", f"no answer from {where} within {timeout:g}s (a firewall drops the packets, or the "
            f"host is down)", f"check that the host is up and tcp {host.port} is open to this machine")
    if isinstance(exc, ConnectionRefusedError):
        return SSHConnectError(
            host, "refused", f"{where} refused the connection (no sshd listens on port {host.port}, or a "
            f"firewall rejects it)", "start sshd on the host or fix `port:` in the inventory")
    if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return SSHConnectError(
            host, "no_route", f"no route to {host.address} ({exc.strerror})",
            "the host is down or not on a network this machine reaches; check `address:` in the inventory")
    return SSHConnectError(host, "network", f"cannot connect to {where}: {exc}")


def _open_socket(host: Host, timeout: float) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host.address, host.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise SSHConnectError(host, "dns", f"cannot resolve {host.address!r} ({exc.strerror})",
                              "use an IP address in the inventory or fix DNS / /etc/hosts on this machine") from None
    error: OSError = OSError("no address")
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise _socket_error(host, error, timeout)


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown host keys are refused, or appended to known_hosts when the user asked for exactly that."""

    def __init__(self, host: Host, path: Path, accept_new: bool) -> None:
        self.host = host
        self.path = path
        self.accept_new = accept_new
        self.added: str | None = None

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise SSHConnectError(
                self.host, "hostkey_unknown",
                f"{hostname} is not in {self.path} (it offers {key.get_name()} {key.fingerprint})",
                f"verify that fingerprint, then add the key with "
                f"`ssh-keyscan -p {self.host.port} {self.host.address} >> {self.path}` or pass --accept-new-host-keys")
        with _KNOWN_HOSTS_LOCK:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            self.path.chmod(0o600)
        self.added = key.fingerprint


def connect(host: Host, *, known_hosts: Path | str | None = None, accept_new_host_keys: bool = False,
            timeout: float = 10.0) -> Connection:
    """Open one authenticated SSH connection to host or raise SSHConnectError naming the cause and fix."""
    began = time.monotonic()
    key = _load_key(host)
    path = Path(known_hosts or DEFAULT_KNOWN_HOSTS).expanduser()
    sock = _open_socket(host, timeout)
    client = paramiko.SSHClient()
    if path.exists():
        client.load_system_host_keys(str(path))
    policy = _HostKeyPolicy(host, path, accept_new_host_keys)
    client.set_missing_host_key_policy(policy)
    try:
        client.connect(
            host.address, port=host.port, username=_user(host), pkey=key, sock=sock,
            timeout=timeout, banner_timeout=timeout, auth_timeout=timeout, channel_timeout=timeout,
            allow_agent=key is None, look_for_keys=key is None,
        )
    except SSHConnectError:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        name = known_hosts_name(host.address, host.port)
        raise SSHConnectError(
            host, "hostkey_mismatch",
            f"host key for {name} does not match {path} (expected {exc.expected_key.fingerprint}, "
            f"got {exc.key.fingerprint})",
            f"if the host was reinstalled remove the old key with `ssh-keygen -f {path} -R '{name}'`, "
            f"otherwise do not connect: someone may be intercepting") from None
    except paramiko.AuthenticationException as exc:
        client.close()
        which = f"key {Path(host.identity_file).expanduser()}" if host.identity_file else "the agent/default keys"
        raise SSHConnectError(
            host, "auth", f"{_target(host)} rejected {which} ({exc})",
            f"add the public key to the user's ~/.ssh/authorized_keys on the host (e.g. `ssh-copy-id -p {host.port} "
            f"{_login(host)}`) or fix `user:`/`identity_file:` in the inventory") from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        client.close()
        kind = "timeout" if isinstance(exc, TimeoutError) or "timed out" in str(exc).lower() else "protocol"
        reason = f"SSH handshake with {host.address}:{host.port} failed ({exc or type(exc).__name__})"
        raise SSHConnectError(host, kind, reason, "check that an SSH server listens on that port") from None
    return Connection(host, client, new_host_key=policy.added, seconds=time.monotonic() - began)


class Connection:
    """One SSH connection to a host. Every command gets its own session channel on the one transport."""

    def __init__(self, host: Host, client: paramiko.SSHClient, *, new_host_key: str | None = None,
                 seconds: float = 0.0) -> None:
        self.host = host
        self.client = client
        self.new_host_key = new_host_key
        self.seconds = seconds  # how long connecting took
        transport = client.get_transport()
        assert transport is not None
        self.transport: paramiko.Transport = transport
        self.peer_ip: str = transport.getpeername()[0]
        self.lost: str | None = None  # why keep_alive gave the connection up
        self._closed = threading.Event()
        self._kept_alive = False

    def keep_alive(self, interval: float, timeout: float) -> None:
        """Ask the host for an answer every `interval` seconds; with none within `timeout`, close the
        connection, so that every channel on it ends and the host counts as lost. A host that died
        without a word, or whose traffic is dropped, otherwise leaves TCP silent for many minutes. Once per
        connection: one kept for the next attempt is already asked."""
        if self._kept_alive:
            return
        self._kept_alive = True
        threading.Thread(target=self._probe, args=(interval, timeout), daemon=True,
                         name=f"keepalive-{self.host.name}").start()

    def _probe(self, interval: float, timeout: float) -> None:
        while not self._closed.wait(interval) and self.transport.is_active():
            answered = threading.Event()
            threading.Thread(target=self._ask, args=(answered,), daemon=True).start()
            if not answered.wait(timeout) and not self._closed.is_set():
                self.lost = f"no answer from {self.host.address} for {timeout:g} s"
                self.transport.close()
                return

    def start(self, command: str, *, pty: bool = False, timeout: float = 10.0) -> RemoteProcess:
        """Start command on a new channel and return at once; the caller streams, waits or stops it."""
        channel = self.transport.open_session(timeout=timeout)
        channel.settimeout(timeout)  # bounds writes to stdin; reads only take what has arrived
        if pty:
            channel.get_pty()
        channel.exec_command(f"echo {_PID_PREFIX.decode()}$$; exec sh -c {shlex.quote(command)}")
        return RemoteProcess(self, channel, command)

    def run(self, command: str, *, stdin: bytes = b"", timeout: float) -> CommandResult:
        """Run command to completion: (exit status, stdout, stderr), or RemoteTimeout once stopped."""
        return run_to_end(self.start(command, timeout=timeout), stdin, timeout)

    def python_command(self, args: Sequence[str]) -> str:
        return python_line(self.host.python, args)

    def _ask(self, answered: threading.Event) -> None:
        """sshd answers every global request that wants a reply (this one with "unknown request")."""
        self.transport.global_request("keepalive@openssh.com", wait=True)
        answered.set()

    def close(self) -> None:
        self._closed.set()
        self.client.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteProcess:
    """A command running on a host: write its stdin, read its output, wait with a deadline, stop it."""

    def __init__(self, connection: Connection, channel: paramiko.Channel, command: str) -> None:
        self.connection = connection
        self.channel = channel
        self.command = command
        self.pid: int | None = None
        self._out = bytearray()
        self._err = bytearray()
        self._decoders = [codecs.getincrementaldecoder("utf-8")("replace") for _ in range(2)]

    def write(self, data: bytes) -> None:
        self.channel.sendall(data)

    def close_stdin(self) -> None:
        self.channel.shutdown_write()

    def _drain(self) -> None:
        while self.channel.recv_ready():
            self._out += self.channel.recv(65536)
        while self.channel.recv_stderr_ready():
            self._err += self.channel.recv_stderr(65536)
        if self.pid is None:
            start = self._out.find(_PID_PREFIX)
            end = self._out.find(b"\n", start)
            if start >= 0 and end >= 0:
                # Whatever a login shell's rc files print comes before our marker and is dropped.
                self.pid = int(self._out[start + len(_PID_PREFIX):end].strip())
                del self._out[:end + 1]

    def _finished(self) -> bool:
        return bool(self.channel.exit_status_ready() and (self.channel.eof_received or self.channel.closed)
                    and not self.channel.recv_ready() and not self.channel.recv_stderr_ready())

    def _pump(self, deadline: float) -> None:
        """Collect output, blocking until something arrives, the command ends, or the deadline passes."""
        wait = max(0.0, min(deadline - time.monotonic(), 0.2))
        if self.channel.eof_received or self.channel.closed:
            self.channel.status_event.wait(wait)
        else:
            waiting = select.poll()  # not select(): a controller of hundreds of nodes has descriptors past 1,024
            waiting.register(self.channel, select.POLLIN)
            waiting.poll(wait * 1000)
        self._drain()

    def poll(self) -> int | None:
        """The exit status once the command has finished and its output is read, else None."""
        self._drain()
        return self.channel.recv_exit_status() if self._finished() else None

    def read_line(self, timeout: float) -> str | None:
        """The next stdout line (None at end of output); RemoteTimeout if none comes in time."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            if self.pid is not None and b"\n" in self._out:
                line, _, rest = bytes(self._out).partition(b"\n")
                self._out = bytearray(rest)
                return line.decode("utf-8", "replace").rstrip("\r")
            if self._finished():
                return None
            if time.monotonic() >= deadline:
                raise self._timed_out(timeout)
            self._pump(deadline)

    def take_output(self) -> tuple[str, str]:
        """Stdout and stderr text that arrived since the last take (for streaming), emptying the buffers."""
        self._drain()
        out = b""
        if self.pid is not None or self._finished():  # before the pid marker, stdout is not the command's yet
            out = bytes(self._out)
            self._out.clear()
        err = bytes(self._err)
        self._err.clear()
        return self._decoders[0].decode(out), self._decoders[1].decode(err)

    def _wait_until(self, deadline: float) -> bool:
        while not self._finished():
            if time.monotonic() >= deadline:
                return False
            self._pump(deadline)
        return True

    def wait(self, timeout: float) -> CommandResult:
        """Wait for the end; on overrun stop the remote process tree and raise RemoteTimeout."""
        if not self._wait_until(time.monotonic() + timeout):
            raise self._timed_out(timeout)
        stdout, stderr = self.take_output()
        return CommandResult(self.channel.recv_exit_status(), stdout, stderr)

    def _timed_out(self, timeout: float) -> RemoteTimeout:
        self.terminate()
        stdout, stderr = self.take_output()
        return RemoteTimeout(self.connection.host, self.command, timeout, stdout, stderr)

    def terminate(self, grace: float = 2.0) -> None:
        """SIGTERM the remote process, SIGKILL its whole tree after grace seconds, close the channel."""
        if self.pid is not None and not self.channel.exit_status_ready() and self.connection.transport.is_active():
            killer = self.connection.start(
                self.connection.python_command(["harness-kill-tree", str(self.pid)]), timeout=grace + 5
            )
            killer.write(shipped("proctable", [str(self.pid), str(grace)]))
            killer.close_stdin()
            killer._wait_until(time.monotonic() + grace + 5)
            killer.close()
        self.close()

    def close(self) -> None:
        self.channel.close()
