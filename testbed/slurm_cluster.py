"""A real Slurm cluster on this machine, for tests: slurmctld and one slurmd per node, each in a namespace.

Every compute node n1..nK is a network namespace on a private bridge (10.250.N.0/24, chosen like
testbed/cluster.py does, so the two kinds of cluster never overlap) with its own address, hostname (UTS
namespace) and /etc/hosts naming every node and the controller; slurmctld runs in a namespace of its
own ("ctl"), because slurmctld and slurmd listen on 0.0.0.0 and would clash with another cluster in the
root namespace. munged runs in the root namespace with its own key and socket, which every namespace
reaches by path. All state, logs and configs live in the cluster's temp dir; the machine's own Slurm and
munge configuration is never read or touched, and names carry the pid, so two runs coexist.

Clients (sbatch, srun, squeue, scontrol, scancel) run in the root namespace with `cluster.env`. Stopping
slurmd does not stop the jobs it started, so teardown kills every process in every namespace, then
slurmctld and munged, then deletes namespaces, bridge, firewall rule, /etc/netns files and the temp dir,
also when setup or a test fails. See ../shared/notes/slurm.md for why each setting is what it is.

    def test_x(slurm_cluster: SlurmCluster, tmp_path):
        job = slurm_cluster.sbatch("--nodes=2", f"--output={tmp_path}/out", "--wrap=srun hostname")
        assert slurm_cluster.wait_job(job) == "COMPLETED"
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from testbed.cluster import Cluster, _free_subnet, _ip, _subnet_lock

DAEMON_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # slurmd, slurmctld and munged live in sbin
TOOLS = ("ip", "iptables", "unshare", "munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "squeue",
         "sinfo", "scontrol", "scancel")
CONTROLLER = "ctl"
# Every state a job ends in (squeue forgets it, `scontrol show job` keeps it for MinJobAge seconds).
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE"})
_names = itertools.count()


def missing_support() -> str | None:
    """Why this machine cannot build a Slurm cluster, or None when it can."""
    if os.geteuid() != 0:
        return "a Slurm namespace cluster needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:{DAEMON_PATH}") is None]
    if missing:
        return (f"missing tools: {', '.join(missing)} (`make test-packages` installs slurmctld slurmd slurm-client "
                "munge; iproute2 and iptables come with `make setup`)")
    return None


@dataclass
class SlurmNode:
    """One namespace of the cluster: a compute node, or the controller."""

    name: str  # Slurm node name and hostname inside the namespace
    netns: str
    address: str
    veth: str
    daemon: subprocess.Popen[bytes] | None = None  # slurmd, or slurmctld on the controller


def _machine_memory_mb() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) // 1024 for line in meminfo if line.startswith("MemTotal:"))


def _tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


class SlurmCluster:
    """K compute nodes n1..nK at 10.250.N.11.. and slurmctld at .10, all in partition `debug`."""

    def __init__(self, size: int, *, cpus: int = 2, memory_mb: int | None = None) -> None:
        self.size = size
        self.cpus = cpus
        self.memory_mb = memory_mb or _machine_memory_mb()  # each node's RealMemory: what --mem may ask for
        self.tag = f"sx{os.getpid()}n{next(_names)}"
        self.bridge = f"{self.tag}b"
        self.prefix = ""
        self.controller: SlurmNode | None = None
        self.nodes: list[SlurmNode] = []
        self.munged: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix=f"harness-slurm-{self.tag}-"))
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.jobcomp_log = self.dir / "jobcomp.log"  # one line per finished job: state, exit code, nodes
        self._stack = contextlib.ExitStack()
        self._stack.callback(shutil.rmtree, self.dir, ignore_errors=True)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Build everything and return once every node is idle; on any failure tear down what was built."""
        try:
            self._build(time.monotonic() + timeout)
        except BaseException:
            self.close()
            raise
        return self

    def _build(self, deadline: float) -> None:
        self._start_munged(deadline)
        with _subnet_lock():
            self.prefix = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            self._stack.callback(_ip, "link", "del", self.bridge, check=False)
            _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        # With br_netfilter loaded, bridged frames cross the root FORWARD chain (DROP on Docker hosts).
        forward = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", "-I", *forward], check=True)
        self._stack.callback(subprocess.run, ["iptables", "-D", *forward], check=False)
        # Namespaces added later are torn down first: compute nodes (and their jobs), then the controller.
        self.controller = self._add_namespace(CONTROLLER, f"{self.prefix}.10", f"{self.tag}vc")
        for index in range(1, self.size + 1):
            self.nodes.append(self._add_namespace(f"n{index}", f"{self.prefix}.{10 + index}", f"{self.tag}v{index}"))
        everyone = [self.controller, *self.nodes]
        hosts = "127.0.0.1 localhost\n::1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in everyone)
        for node in everyone:
            (Path("/etc/netns") / node.netns / "hosts").write_text(hosts)
        self._write_config()
        self._start_daemon(self.controller, f"slurmctld -D -f {self.conf}")
        self._wait(deadline, "slurmctld to answer", lambda: self.run(["scontrol", "ping"], check=False).returncode == 0)
        for node in self.nodes:
            (self.dir / node.name / "spool").mkdir(parents=True)
            self._start_daemon(node, f"slurmd -D -N {node.name} -f {self.conf}")
        self._wait(deadline, "every node to be idle", self._all_idle)

    def _start_munged(self, deadline: float) -> None:
        munge = self.munge_socket.parent
        # munged wants its socket reachable by all: execute permission on every directory above it.
        self.dir.chmod(0o755)
        munge.mkdir()
        munge.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        with (munge / "daemon.out").open("wb") as handle:
            self.munged = subprocess.Popen(
                ["munged", "--foreground", f"--key-file={key}", f"--socket={self.munge_socket}",
                 f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                 f"--seed-file={munge / 'munged.seed'}"],
                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=self.env,
            )
        self._stack.callback(self._stop, self.munged)

        self._wait(deadline, "munged to answer", lambda: subprocess.run(
            ["munge", f"--socket={self.munge_socket}", "--no-input"], capture_output=True, env=self.env,
        ).returncode == 0)

    def _add_namespace(self, name: str, address: str, veth: str) -> SlurmNode:
        node = SlurmNode(name=name, netns=f"{self.tag}-{name}", address=address, veth=veth)
        _ip("netns", "add", node.netns)
        self._stack.callback(self._remove_namespace, node)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", node.netns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", node.netns, "link", "set", "eth0", "up")
        _ip("-n", node.netns, "link", "set", "lo", "up")
        etc = Path("/etc/netns") / node.netns
        etc.mkdir(parents=True)
        # `ip netns exec` bind-mounts these over /etc; DNS goes to loopback only, so lookups fail fast, locally.
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        return node

    def _write_config(self) -> None:
        assert self.controller is not None
        d = self.dir
        names = ",".join(n.name for n in self.nodes)
        lines = [
            f"ClusterName={self.tag}",
            f"SlurmctldHost={CONTROLLER}({self.controller.address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={d / CONTROLLER}",
            f"SlurmctldPidFile={d / CONTROLLER / 'slurmctld.pid'}",
            f"SlurmctldLogFile={d / CONTROLLER / 'slurmctld.log'}",
            f"SlurmdSpoolDir={d / '%n' / 'spool'}",
            f"SlurmdPidFile={d / '%n' / 'slurmd.pid'}",
            f"SlurmdLogFile={d / '%n' / 'slurmd.log'}",
            "SlurmdParameters=config_overrides",  # nodes may claim more CPUs than this machine has
            # No cgroup-based plugin: `ip netns exec` leaves no cgroup hierarchy under /sys (see cgroup.conf).
            # linuxproc, unlike pgid, finds torchrun's workers in their own sessions, so scancel ends them.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp_log}",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",  # memory is no consumable: --mem is checked against RealMemory only
            "SchedulerParameters=batch_sched_delay=0",  # sbatch to running in ~1 s instead of 2-3 s
            "ReturnToService=2",  # a restarted slurmd is idle again at once
            "MinJobAge=300",  # finished jobs stay in `scontrol show job` for the tests to read
            "KillWait=3",  # SIGTERM to SIGKILL on scancel or time limit
            "SlurmdTimeout=10",
            "MessageTimeout=10",
            "InactiveLimit=0",
            "MailProg=/bin/true",  # the default, /bin/mail, is not installed: one error less in every log
            "Waittime=0",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *(f"NodeName={n.name} NodeAddr={n.address} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN"
              for n in self.nodes),
            f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        # slurmd 22.05 always loads a cgroup plugin; v1 without automount loads without a hierarchy.
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _start_daemon(self, node: SlurmNode, command: str) -> None:
        """Start a daemon in the foreground in a node's namespace under its hostname; its PID is the daemon's."""
        (self.dir / node.name).mkdir(exist_ok=True)
        with (self.dir / node.name / "daemon.out").open("wb") as out:
            node.daemon = subprocess.Popen(
                ["ip", "netns", "exec", node.netns, "unshare", "--uts", "sh", "-c",
                 f"hostname {node.name} && exec {command}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=self.env,
            )

    def _all_idle(self) -> bool:
        states = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        return states == [word for n in self.nodes for word in (n.name, "idle")]

    def _wait(self, deadline: float, what: str, ready: Callable[[], bool]) -> None:
        """Poll `ready` until it holds; fail at once, with the logs, when a daemon dies or time runs out."""
        daemons = [("munge", self.munged), *((n.name, n.daemon) for n in self.namespaces())]
        while not ready():
            dead = [(name, p.returncode) for name, p in daemons if p is not None and p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {name}:\n{self.daemon_log(name)}" for name, _ in daemons)
                problem = ", ".join(f"{name} exited {code}" for name, code in dead) or f"timed out waiting for {what}"
                raise RuntimeError(f"{problem}; logs:\n{logs}")
            time.sleep(0.1)

    def _remove_namespace(self, node: SlurmNode) -> None:
        """Kill everything in the namespace (the daemon, and jobs it leaves running), then delete it."""
        deadline = time.monotonic() + 10
        while (pids := Cluster._netns_pids(node.netns)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if node.daemon is not None:
                node.daemon.poll()  # reap our own child, or it lingers as a zombie in the namespace
            time.sleep(0.05)
        self._stop(node.daemon)
        _ip("link", "del", node.veth, check=False)
        _ip("netns", "del", node.netns, check=False)
        Cluster._remove_etc(Path("/etc/netns") / node.netns)

    @staticmethod
    def _stop(process: subprocess.Popen[bytes] | None) -> None:
        if process is not None and process.poll() is None:
            process.kill()
        if process is not None:
            process.wait(timeout=10)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for tests ---------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client command: this cluster's config, and no SLURM_* of an outer job."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return base | {"SLURM_CONF": str(self.conf), "PATH": f"{os.environ.get('PATH', '')}:{DAEMON_PATH}"}

    def namespaces(self) -> list[SlurmNode]:
        """The controller's namespace (once built), then every compute node's."""
        return ([self.controller] if self.controller else []) + self.nodes

    def node(self, name: str) -> SlurmNode:
        """A compute node, or the controller ("ctl"), by name."""
        return next(n for n in self.namespaces() if n.name == name)

    def daemon_log(self, name: str) -> str:
        """The end of the logs of a node's slurmd ("ctl": slurmctld, "munge": munged) and of what it printed."""
        logs = ("daemon.out", "slurmd.log", "slurmctld.log", "munged.log")
        return "\n".join(_tail(self.dir / name / log) for log in logs if (self.dir / name / log).exists())

    def run(self, argv: Sequence[str], *, timeout: float = 60, check: bool = True, cwd: Path | None = None,
            environment: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (sbatch, srun, squeue, scontrol, scancel, sinfo) against this cluster;
        environment: variables added to its environment."""
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                                env=self.env | (environment or {}), cwd=cwd or self.dir, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
        return result

    def sbatch(self, *args: str, cwd: Path | None = None, environment: dict[str, str] | None = None) -> int:
        """Submit a batch job (`sbatch ARGS`, e.g. `--wrap=...` or a script path) and return its id; environment:
        variables added to the environment sbatch runs in, which it hands the job."""
        return int(self.run(["sbatch", "--parsable", *args], cwd=cwd, environment=environment).stdout.strip()
                   .split(";")[0])

    def job_state(self, job_id: int) -> str:
        """PENDING, RUNNING, COMPLETED, CANCELLED, ... (finished jobs are kept for MinJobAge=300 s)."""
        shown = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        match = re.search(r"\bJobState=(\S+)", shown)
        assert match, f"no JobState for job {job_id} in: {shown}"
        return match.group(1)

    def wait_job(self, job_id: int, states: frozenset[str] = FINISHED, timeout: float = 120) -> str:
        """Wait until the job is in one of `states` (by default: finished) and return that state."""
        deadline = time.monotonic() + timeout
        while (state := self.job_state(job_id)) not in states:
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} still {state} after {timeout:g}s, not in {sorted(states)}")
            time.sleep(0.1)
        return state

    def node_pids(self, name: str) -> list[int]:
        """Every process in a node's namespace: its slurmd, and slurmstepd and tasks of running jobs."""
        return Cluster._netns_pids(self.node(name).netns)

    def job_pids(self, name: str) -> list[int]:
        """Every process in a node's namespace but its slurmd."""
        daemon = self.node(name).daemon
        return [pid for pid in self.node_pids(name) if daemon is None or pid != daemon.pid]

    def restart_slurmd(self, name: str) -> None:
        """A node's slurmd again, after a test killed it with the rest of the node (a machine back from a
        crash): it cleans up what its jobs left, so that they can end."""
        node = self.node(name)
        self._stop(node.daemon)
        self._start_daemon(node, f"slurmd -D -N {node.name} -f {self.conf}")

    def assert_no_job_processes(self, within: float = 30.0) -> None:
        """Within `within` seconds nothing but slurmd runs on any node (steps end asynchronously)."""
        deadline = time.monotonic() + within
        for node in self.nodes:
            while self.job_pids(node.name) and time.monotonic() < deadline:
                time.sleep(0.1)
            left = {pid: process_name(pid) for pid in self.job_pids(node.name)}
            assert not left, f"{node.name} still runs {left} besides slurmd after {within:g}s"


def process_name(pid: int) -> str:
    """The command name of a process, "" once it is gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def _slurm_fixture(size: int) -> Iterator[SlurmCluster]:
    reason = missing_support()
    if reason:
        pytest.fail(f"cannot build a Slurm test cluster: {reason}", pytrace=False)
    with SlurmCluster(size) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """Two Slurm nodes (n1, n2) in partition debug, shared by the session: tests cancel what they start."""
    yield from _slurm_fixture(2)


@pytest.fixture(scope="session")
def slurm_cluster3() -> Iterator[SlurmCluster]:
    """Three Slurm nodes (n1, n2, n3) in partition debug, shared by the session."""
    yield from _slurm_fixture(3)
