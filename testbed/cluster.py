"""A real multi-host cluster on this machine, for tests: one network namespace per host.

Every host is a network namespace on a private bridge (10.250.N.0/24, no default route, so nothing
leaves the machine) with its own address, hostname (UTS namespace), /etc/hosts, resolver (loopback
only), iptables and Debian sshd. With multi_nic, each host also has a data network (eth1, on a second
bridge), an interface that routes nowhere (extra0) and Debian's `127.0.1.1 <hostname>` line. The root
namespace owns the bridge's .1 address and plays the controller. Tests get an ordinary hosts.yaml and
known_hosts for it, so SSH, preflight and launch run against real TCP, real firewalls and a real sshd.
Names carry the pid, so two runs coexist; everything is torn down on exit, also when setup or a test
fails.

Use from a test module (tests/conftest.py loads this module as a plugin, so its fixtures are
everywhere; the benchmarks use Cluster directly):

    from testbed.cluster import Cluster

    def test_x(cluster2: Cluster, tmp_path):
        hosts = cluster2.write_inventory(tmp_path / "hosts.yaml")
        with cluster2.firewall("h1", "-p", "tcp", "--dport", "29500", "-j", "DROP"):
            ...
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.record.hosts_out import bring_back, hosts_file, hosts_out
from harness.spec.inventory import Host
from testbed import podman_config

REPO = Path(__file__).resolve().parents[1]
SSHD = "/usr/sbin/sshd"
SSH_PORTS = (22, 2222)  # 2222 lets tests cover the `[addr]:port` known_hosts form
TOOLS = ("ip", "iptables", "unshare", "ssh-keygen", SSHD)
SUBNET_PREFIX = "10.250"
_names = itertools.count()


@dataclass
class NsHost:
    """One host of the cluster."""

    name: str
    netns: str
    address: str
    veth: str
    host_key: str  # "ssh-ed25519 AAAA..." as it appears in known_hosts
    sshd: subprocess.Popen[bytes] | None = None
    data_address: str | None = None  # on the data network (eth1), when the cluster has one


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "harness-test", "-f", str(path)], check=True)


def _cgroup_mounts() -> str:
    """Shell steps that mount the machine's cgroup hierarchies again in a host's own mount namespace.

    `ip netns exec` mounts a fresh /sys, without /sys/fs/cgroup, and runc cannot start a container
    without the cgroup mounts (`no cgroup mount found in mountinfo`).
    """
    steps: list[str] = []
    for line in Path("/proc/1/mounts").read_text().splitlines():
        source, target, kind, options = line.split()[:4]
        if target == "/sys/fs/cgroup" and kind == "tmpfs":
            steps.insert(0, f"&& mount -t tmpfs -o {options} {source} {target} ")
        elif target.startswith("/sys/fs/cgroup/") and kind in ("cgroup", "cgroup2"):
            steps.append(f"&& mkdir -p {target} && mount -t {kind} -o {options} {source} {target} ")
    return "".join(steps)


def missing_support() -> str | None:
    """Why this machine cannot build a namespace cluster, or None when it can."""
    if os.geteuid() != 0:
        return "namespace clusters need root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (apt-get install openssh-server iproute2 iptables)"
    return None


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Serialise subnet choice between concurrent runs; locking /tmp itself leaves no file behind."""
    fd = os.open(tempfile.gettempdir(), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _free_subnet() -> str:
    """The first 10.250.N.0/24 that no address or route on this machine overlaps."""
    words = _ip("-4", "-o", "addr", "show").stdout.split() + _ip("-4", "route", "show").stdout.split()
    used = []
    for word in words:
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(word, strict=False))
    for third in range(1, 255):
        candidate = ipaddress.ip_network(f"{SUBNET_PREFIX}.{third}.0/24")
        if not any(candidate.overlaps(net) for net in used if net.prefixlen > 0):
            return f"{SUBNET_PREFIX}.{third}"
    raise RuntimeError(f"no free {SUBNET_PREFIX}.N.0/24 subnet for a test cluster")


def _wait_port(address: str, port: int, process: subprocess.Popen[bytes], log: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sshd for {address} exited with {process.returncode}: {log.read_text()}")
        with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"sshd on {address}:{port} did not come up within {timeout:g}s: {log.read_text()}")


class Cluster:
    """K namespace hosts named h1..hK at 10.250.N.11.., reachable from the root namespace at .1."""

    def __init__(self, size: int, *, workdir: Path = REPO, python: str = sys.executable,
                 image_store: Path | None = None, multi_nic: bool = False) -> None:
        """image_store: give every host a podman (podman_config.py) that sees this image store.
        multi_nic: hosts as on a GPU cluster (see _add_data_network)."""
        self.size = size
        self.workdir = workdir
        self.python = python
        self.image_store = image_store
        self.multi_nic = multi_nic
        self.tag = f"hx{os.getpid()}n{next(_names)}"
        self.bridge = f"{self.tag}b"
        self.data_bridge = f"{self.tag}d"
        self.prefix = ""
        self.data_prefix = ""
        self.hosts: list[NsHost] = []
        self.dir = Path(tempfile.mkdtemp(prefix=f"harness-cluster-{self.tag}-"))
        self.client_key = self.dir / "client_key"
        self.known_hosts = self.dir / "known_hosts"
        self._stack = contextlib.ExitStack()
        self._stack.callback(shutil.rmtree, self.dir, ignore_errors=True)
        # The hosts' podman state, at a short path (see podman_config.storage_conf).
        self.podman_dir = Path(tempfile.mkdtemp(prefix=self.tag)) if image_store is not None else None
        if self.podman_dir is not None:
            self._stack.callback(shutil.rmtree, self.podman_dir, ignore_errors=True)
            # Machine-wide, whatever the settings: podman's blob-info cache (written by commit, pull, load).
            if not podman_config.BLOB_CACHE.exists():
                self._stack.callback(shutil.rmtree, podman_config.BLOB_CACHE, ignore_errors=True)
        self._children: list[tuple[str, subprocess.Popen[bytes]]] = []  # (netns, process) started here

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Cluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _keygen(self.client_key)
        (self.dir / "authorized_keys").write_text(self.client_key.with_suffix(".pub").read_text())
        with _subnet_lock():
            self.prefix = self._add_bridge(self.bridge, gateway=True)
            if self.multi_nic:
                self.data_prefix = self._add_bridge(self.data_bridge, gateway=False)
        self._stack.callback(self._forget_kept_out)
        self._room_in_the_neighbour_table()
        for index in range(1, self.size + 1):
            self.hosts.append(self._add_host(f"h{index}", f"{self.prefix}.{10 + index}", f"{self.tag}v{index}"))
        hosts_lines = "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        for host in self.hosts:
            # Debian's installer maps the machine's own name to 127.0.1.1, first.
            own = f"127.0.1.1 {host.name}\n" if self.multi_nic else ""
            self._etc(host, "hosts").write_text(f"127.0.0.1 localhost\n{own}::1 localhost\n{hosts_lines}")
        self.known_hosts.write_text("".join(
            f"{a} {h.host_key}\n" for h in self.hosts for a in (h.address, f"[{h.address}]:2222")
        ))
        for host in self.hosts:
            self._start_sshd(host)

    def _add_bridge(self, bridge: str, *, gateway: bool) -> str:
        """A bridge on a free 10.250.N.0/24 (the caller holds the subnet lock); the root namespace takes
        .1 on it only as the controller's (management) network."""
        prefix = _free_subnet()
        _ip("link", "add", bridge, "type", "bridge")
        self._stack.callback(_ip, "link", "del", bridge, check=False)
        _ip("link", "set", bridge, "up")
        if gateway:
            _ip("addr", "add", f"{prefix}.1/24", "dev", bridge)
        else:  # no address here; the route tells the next _free_subnet() that the subnet is taken
            _ip("route", "add", f"{prefix}.0/24", "dev", bridge, "metric", "4000")
        # With br_netfilter loaded, bridged frames cross the root FORWARD chain (DROP on Docker hosts).
        forward = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", "-I", *forward], check=True)
        self._stack.callback(subprocess.run, ["iptables", "-D", *forward], check=False)
        return prefix

    def _add_data_network(self, netns: str, index: int) -> str:
        """What a GPU cluster's host has besides its management eth0: a data network (eth1 on a second
        bridge) and, first of all, an interface that routes nowhere (extra0: a veth whose other end is
        attached to nothing, with an address no peer has a route to), because NCCL's default takes the
        first interface that is not lo or docker*."""
        dead_end = f"{self.tag}x{index}"
        _ip("link", "add", dead_end, "type", "veth", "peer", "name", "extra0", "netns", netns)
        self._stack.callback(_ip, "link", "del", dead_end, check=False)
        _ip("link", "set", dead_end, "up")
        _ip("-n", netns, "addr", "add", f"{SUBNET_PREFIX}.0.{10 + index}/32", "dev", "extra0")
        _ip("-n", netns, "link", "set", "extra0", "up")
        veth = f"{self.tag}w{index}"
        address = f"{self.data_prefix}.{10 + index}"
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth1", "netns", netns)
        self._stack.callback(_ip, "link", "del", veth, check=False)
        _ip("link", "set", veth, "master", self.data_bridge, "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth1")
        _ip("-n", netns, "link", "set", "eth1", "up")
        return address

    def _add_host(self, name: str, address: str, veth: str) -> NsHost:
        netns = f"{self.tag}-{name}"
        _ip("netns", "add", netns)
        self._stack.callback(self._remove_netns, netns, veth)
        index = int(name[1:])
        data_address = self._add_data_network(netns, index) if self.multi_nic else None
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / netns
        etc.mkdir(parents=True)
        self._stack.callback(self._remove_etc, etc)
        # `ip netns exec` bind-mounts the files here over /etc: DNS goes to loopback only (hosts: see _build).
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        if self.podman_dir is not None:
            podman_config.write(etc / "containers", self.podman_dir / name, self.image_store)
        key = self.dir / f"{name}_host_key"
        _keygen(key)
        public = " ".join(key.with_suffix(".pub").read_text().split()[:2])
        return NsHost(name=name, netns=netns, address=address, veth=veth, host_key=public, data_address=data_address)

    def _start_sshd(self, host: NsHost) -> None:
        config = self.dir / f"{host.name}_sshd_config"
        config.write_text("".join(f"Port {p}\n" for p in SSH_PORTS) + "\n".join([
            f"ListenAddress {host.address}",
            f"HostKey {self.dir / f'{host.name}_host_key'}",
            "PidFile none",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "Subsystem sftp /usr/lib/openssh/sftp-server",
            "",
        ]))
        log = self.dir / f"{host.name}_sshd.log"
        # sshd needs /run/sshd; a tmpfs on /run in the host's own mount namespace avoids touching the machine's.
        script = (
            f"hostname {host.name} && mount -t tmpfs -o mode=755 harness-run /run && mkdir -m 755 /run/sshd "
            f"{_cgroup_mounts() if self.image_store is not None else ''}&& exec {SSHD} -D -e -f {config}"
        )
        with log.open("wb") as out:
            host.sshd = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", script],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self._children.append((host.netns, host.sshd))
        _wait_port(host.address, 22, host.sshd, log)

    def _remove_netns(self, netns: str, veth: str) -> None:
        """Kill everything left in the namespace (all of it started by this cluster), then delete it."""
        ours = [p for ns, p in self._children if ns == netns]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in self._netns_pids(netns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 3
            while self._netns_pids(netns) and time.monotonic() < deadline:
                for process in ours:
                    process.poll()  # reap our own children, or they linger as zombies in the namespace
                time.sleep(0.05)
        for process in ours:
            process.wait(timeout=5)
        _ip("link", "del", veth, check=False)
        _ip("netns", "del", netns, check=False)

    @staticmethod
    def _remove_etc(etc: Path) -> None:
        shutil.rmtree(etc, ignore_errors=True)
        with contextlib.suppress(OSError):
            etc.parent.rmdir()  # only when no other cluster still uses /etc/netns

    @staticmethod
    def _netns_pids(netns: str) -> list[int]:
        result = _ip("netns", "pids", netns, check=False)
        return [int(p) for p in result.stdout.split()]

    def close(self) -> None:
        self._stack.close()

    def _room_in_the_neighbour_table(self) -> None:
        """The kernel's ARP table is one for every network namespace, full at gc_thresh3 entries (1,024 by
        default: "neighbor table overflow", and some hosts' packets go nowhere). Every host may learn every
        other's address, on each network: raised for the cluster's life when it needs more, put back after."""
        needed = 4 * (self.size + 1) ** 2
        keys = [f"/proc/sys/net/ipv4/neigh/default/gc_thresh{level}" for level in (1, 2, 3)]
        before = [Path(key).read_text().strip() for key in keys]
        if int(before[2]) >= needed:
            return
        def put(values: list[str]) -> None:
            for key, value in zip(keys, values, strict=True):
                Path(key).write_text(f"{value}\n")

        put([str(needed // 4), str(needed // 2), str(needed)])
        self._stack.callback(put, before)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _forget_kept_out(self) -> None:
        """The hosts a run kept out (record/hosts_out.py) go with the cluster: a later one on this subnet has new
        machines at the same addresses."""
        path = hosts_file()
        for entry in hosts_out(path):
            if entry.machine.startswith(f"{self.prefix}."):
                bring_back(path, entry.machine)

    # -- helpers for tests ---------------------------------------------------------------------------

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where the controller's connections come from)."""
        return f"{self.prefix}.1"

    @property
    def unused_address(self) -> str:
        """An address on the bridge subnet with no host behind it (connections fail: no route)."""
        return f"{self.prefix}.250"

    def host(self, name: str) -> NsHost:
        return next(h for h in self.hosts if h.name == name)

    def _etc(self, host: NsHost | str, name: str) -> Path:
        netns = host.netns if isinstance(host, NsHost) else self.host(host).netns
        return Path("/etc/netns") / netns / name

    def exec(self, host: NsHost | str, argv: Sequence[str], *, timeout: float = 30, check: bool = True,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command inside a host's network namespace (root namespace hostname, not the host's)."""
        netns = host.netns if isinstance(host, NsHost) else self.host(host).netns
        return subprocess.run(["ip", "netns", "exec", netns, *argv], capture_output=True, text=True,
                              timeout=timeout, check=check, input=input)

    def spawn(self, host: NsHost | str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start a background process in a host's namespace; it is killed at teardown at the latest."""
        netns = host.netns if isinstance(host, NsHost) else self.host(host).netns
        process = subprocess.Popen(["ip", "netns", "exec", netns, *argv], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        self._children.append((netns, process))
        return process

    def login(self, host: NsHost | str, argv: Sequence[str]) -> list[str]:
        """argv as a user's SSH session on the host runs it: in sshd's namespaces (its hostname, /run, cgroups)."""
        sshd = (host if isinstance(host, NsHost) else self.host(host)).sshd
        assert sshd is not None
        return ["nsenter", "-t", str(sshd.pid), "-m", "-u", "-n", *argv]

    def podman(self, host: NsHost | str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run podman on a host exactly as its SSH sessions do."""
        assert self.image_store is not None
        return subprocess.run(self.login(host, ["podman", *args]), capture_output=True, text=True, timeout=timeout,
                              check=True)

    def logins(self, host: NsHost | str) -> int:
        """How many SSH connections the host's sshd has accepted so far (its log says each)."""
        name = host.name if isinstance(host, NsHost) else host
        return (self.dir / f"{name}_sshd.log").read_text(errors="replace").count("Accepted publickey for ")

    def pids(self, host: NsHost | str) -> list[int]:
        """Every process in a host's namespace (its sshd included)."""
        return self._netns_pids(host.netns if isinstance(host, NsHost) else self.host(host).netns)

    def assert_only_sshd_left(self, within: float = 5.0) -> None:
        """Nothing left running on any host (sessions end asynchronously): only sshd in every namespace."""
        deadline = time.monotonic() + within
        for host in self.hosts:
            assert host.sshd is not None
            while self.pids(host) != [host.sshd.pid] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert self.pids(host) == [host.sshd.pid], f"{host.name} still runs {self.pids(host)}"

    @contextlib.contextmanager
    def firewall(self, host: NsHost | str, *rule: str, chain: str = "INPUT") -> Iterator[None]:
        """Insert an iptables rule in a host's namespace for the duration of the block."""
        self.exec(host, ["iptables", "-I", chain, *rule])
        try:
            yield
        finally:
            self.exec(host, ["iptables", "-D", chain, *rule], check=False)

    @contextlib.contextmanager
    def hosts_entries(self, host: NsHost | str, lines: Sequence[str]) -> Iterator[None]:
        """Put lines first in a host's /etc/hosts (e.g. the Debian `127.0.1.1 h1`) for the block."""
        path = self._etc(host, "hosts")
        original = path.read_text()
        path.write_text("".join(f"{line}\n" for line in lines) + original)  # same inode: the bind mount sees it
        try:
            yield
        finally:
            path.write_text(original)

    def new_client_key(self, name: str) -> Path:
        """A fresh key pair that no host authorizes (for auth-failure tests)."""
        path = self.dir / name
        _keygen(path)
        return path

    def inventory_data(self, *, hosts: Sequence[str] | None = None,
                       overrides: dict[str, dict[str, Any]] | None = None,
                       extra: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """The hosts.yaml content: chosen hosts in order (master first), per-host overrides, extra hosts."""
        chosen = [self.host(n) for n in hosts] if hosts is not None else self.hosts
        entries = [{"name": h.name, "address": h.address} | (overrides or {}).get(h.name, {}) for h in chosen]
        return {
            "defaults": {"user": "root", "identity_file": str(self.client_key), "python": self.python,
                         "workdir": str(self.workdir), "gpus": 0},
            "hosts": entries + list(extra),
        }

    def inventory_host(self, name: str, **overrides: Any) -> Host:
        """The inventory Host for one cluster host (address from `name`), as hosts.yaml would give it."""
        fields = self.inventory_data()["defaults"] | {"name": name, "address": self.host(name).address}
        return Host(**(fields | overrides))

    def write_inventory(self, path: Path, **kwargs: Any) -> Path:
        """Write an ordinary hosts.yaml for this cluster (see inventory_data for the options)."""
        path.write_text(yaml.safe_dump(self.inventory_data(**kwargs), sort_keys=False))
        return path


@contextlib.contextmanager
def namespace_cluster(size: int, **kwargs: Any) -> Iterator[Cluster]:
    """A started cluster of `size` hosts, torn down when the block ends (also on failure)."""
    with Cluster(size, **kwargs) as cluster:
        yield cluster


def _cluster_fixture(size: int, **kwargs: Any) -> Iterator[Cluster]:
    reason = missing_support()
    if reason:
        pytest.skip(reason)
    with namespace_cluster(size, **kwargs) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster2() -> Iterator[Cluster]:
    """Two hosts (h1 master, h2), shared by the whole session; tests undo what they change."""
    yield from _cluster_fixture(2)


@pytest.fixture(scope="session")
def cluster3() -> Iterator[Cluster]:
    """Three hosts (h1 master, h2, h3), shared by the whole session."""
    yield from _cluster_fixture(3)


@pytest.fixture(scope="session")
def multi_nic_cluster2() -> Iterator[Cluster]:
    """Two hosts as on a GPU cluster: management eth0, data eth1, extra0 first, hostname -> 127.0.1.1."""
    yield from _cluster_fixture(2, multi_nic=True)


@pytest.fixture
def doomed_cluster3() -> Iterator[Cluster]:
    """Three hosts of one test's own, for tests that kill hosts (sshd included): torn down after it."""
    yield from _cluster_fixture(3)
