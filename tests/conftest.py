"""Shared test helpers: run the real CLI, write job specs, find processes of a run."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import ipaddress
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from _pytest.nodeid import NodeId

from harness.node.proctable import run_processes
from testbed.ranks import rank_pids

# Fixtures for every module: namespace clusters (cluster2/3, slurm_cluster/3, from testbed/), the uninterrupted
# payload run; each is built when a test first asks for it (tests/unit asks for none), never at import.
# One instance per session: a second import under another name (`tests.conftest`) would make a second index
# and a second port counter, handing out ports the first already gave.
if __name__ != "conftest":
    raise ImportError(f"import the test helpers as `from conftest import ...`, not as {__name__}")

pytest_plugins = ("testbed.cluster", "testbed.slurm_cluster", "resume_job")

REPO = Path(__file__).resolve().parent.parent

# Every run registers in the user's index of runs ($XDG_STATE_HOME/harness/runs): the session's runs go to an
# index of its own, never the real home's. Set at import, before any test module reads os.environ or starts a
# process, so that everything the tests start inherits it.
STATE_HOME = tempfile.mkdtemp(prefix="harness-test-state-")
os.environ["XDG_STATE_HOME"] = STATE_HOME
atexit.register(shutil.rmtree, STATE_HOME, ignore_errors=True)
# torchrun started by hand keeps its logs in $TMPDIR/torchelastic_* and never removes them: the tests that start
# it give it this folder, removed with the session's state.
BY_HAND_TMPDIR = os.path.join(STATE_HOME, "tmp")
os.mkdir(BY_HAND_TMPDIR)


def _ephemeral_start() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        return int(handle.read().split()[0])


# Ports for the jobs' rendezvous come from below the kernel's ephemeral range, so that no socket of
# any process (gloo's, sshd's, another test's) can be handed one between our check and torchrun's
# bind; each is given out once per session, from a block chosen by pid so that concurrent sessions
# rarely meet, and is checked free before it is given.
_PORT_FLOOR = 20000
_ports = itertools.count(_PORT_FLOOR + (os.getpid() * 97) % (_ephemeral_start() - _PORT_FLOOR))


def free_port() -> int:
    """A free TCP port that nothing else on the machine will be handed meanwhile (see above)."""
    ceiling = _ephemeral_start()
    for _ in range(ceiling - _PORT_FLOOR):
        port = _PORT_FLOOR + (next(_ports) - _PORT_FLOOR) % (ceiling - _PORT_FLOOR)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_PORT_FLOOR}-{ceiling - 1}")


def harness(*args: str, cwd: Path = REPO, timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real `harness` command, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


# A job that renders on any machine: the hostile-input tests (unit/test_hostile.py,
# integration/test_hostile_launches.py) edit it.
DEMO_JOB = "name: demo\nnnodes: 2\nmaster_port: 29400\nentrypoint:\n  module: harness.payload.train\n  args: [--x]\n"


JOB = """
name: ddp-sum
nnodes: 2
nproc_per_node: {nproc}
backend: gloo
master_port: {port}
entrypoint:
  script: {script}
  args: [--tag, "two words", "$$", "${{local_rank}}", "$(x)"]
env:
{env}
"""
SCRIPT = REPO / "tests" / "scripts" / "ddp_sum.py"


def attack_store(run_dir: Path, marker: Path, login: Callable[[list[str]], list[str]] = list) -> str:
    """Another local user's attack on the run's rendezvous store (tests/scripts/store_attack.py), while the run runs,
    where its torchrun's command line says the store is: its one line, `refused ...` or `set ...`; marker: the file a
    pickle it set would create, once loaded; login: the attack's argv as it runs on the store's host (testbed's
    Cluster.login; this machine's by default)."""
    argv = json.loads((run_dir / "plan.json").read_text())["nodes"][0]["argv"]
    flags = dict(re.findall(r"^--([\w-]+)=(.*)$", "\n".join(argv), re.M))
    host, port = flags["rdzv-endpoint"].rsplit(":", 1) if "rdzv-endpoint" in flags else \
        (flags["master-addr"], flags["master-port"])
    attack = subprocess.run(login(["setpriv", "--reuid=12345", "--regid=12345", "--clear-groups", sys.executable,
                                   str(REPO / "tests" / "scripts" / "store_attack.py"), str(marker), host, port,
                                   *([flags["rdzv-id"]] if "rdzv-id" in flags else [])]),
                            capture_output=True, text=True, timeout=120)
    assert attack.returncode == 0, attack.stderr
    return attack.stdout.strip()


STOP_GRACE = 3.0  # the spec's default timeouts.stop_grace, which ddp_job keeps
# testbed/standin's torch, first on a job's PYTHONPATH: torchrun's place taken by a launcher that forks its ranks, a
# process group whose collectives wait at node 0, no torch import anywhere. For what the harness does around a job
# (supervision, stops, records, views), where torch's own behaviour is not what is tested: a launch then costs the
# harness's processes, not four torch imports. tests/scripts/ddp_sum.py runs on either.
STANDIN_ENV = {"PYTHONPATH": f"{REPO / 'testbed' / 'standin' / 'shim'}:{REPO}"}


def ddp_job(write_yaml, nproc: int = 1, standin: bool = False, **env: str) -> Path:
    """A job running tests/scripts/ddp_sum.py on 2 nodes; env tunes its pace and failures; standin: on the stand-in
    torch (STANDIN_ENV)."""
    env = (STANDIN_ENV if standin else {}) | env
    lines = "\n".join(f"  {k}: '{v}'" for k, v in env.items()) or "  {}"
    text = JOB.format(nproc=nproc, port=free_port(), script=SCRIPT, env=lines)
    return write_yaml(text.replace("env:\n  {}", "env: {}"))


# A rank's line as the stream shows it, unless it is one of torch's C++ log lines: `[W1126 16:16:13.906 ...]`.
JOBS_OWN_LINE = re.compile(r"^\[node\d+\] \[rank\d+\]: (?!\[[IWEF]\d{4} \d\d:\d\d:\d\d)")


def assert_only_the_jobs_lines(output: str) -> None:
    """Every line of a launch's stream is the job's own or the harness's own (`harness: ...`, and the indented
    lines its failure report quotes): nothing of the harness's machinery in the ranks (its rank hook's server),
    no C++ log line of torch's. Lines end at newlines alone, as the stream's do (a rank may print a record separator
    inside one: str.splitlines would break it there)."""
    foreign = [line for line in output.removesuffix("\n").split("\n")
               if not (line.startswith(("harness: ", "    ")) or JOBS_OWN_LINE.match(line))]
    assert not foreign, "lines neither the job's nor the harness's:\n" + "\n".join(foreign)


def leftover(run_id: str) -> list[int]:
    return run_processes(run_id)


def worker_pid(run_id: str, rank: int) -> int:
    """The training process of a global rank (testbed/ranks.py)."""
    if found := rank_pids(run_id, rank):
        return found[0]
    raise AssertionError(f"no worker with RANK={rank} in run {run_id}")


def listening_ports(pid: int) -> set[int]:
    """The TCP ports a process listens on."""
    return {port for _, port in listening_sockets(pid)}


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of each TCP socket a process listens on: its sockets that /proc/net/tcp and tcp6 list in
    state LISTEN (the kernel writes each 32-bit word of an address in the machine's byte order)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (link := os.readlink(fd)).startswith("socket:["):
                inodes.add(link.removeprefix("socket:[").removesuffix("]"))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                address, port = fields[1].rsplit(":", 1)
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def agent_pid(run_id: str, node_rank: int | str) -> int:
    """The node agent of a node (it runs under `python -I -S -c`, with the node's NODE_RANK; a standby's, and so a node's
    started warm: `standby-HOST`)."""
    return next(pid for pid in leftover(run_id) if b"-I\0-S\0-c\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
                and f"NODE_RANK={node_rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))


GPU_TESTS = REPO / "tests" / "gpu"
PAYLOAD_TESTS = REPO / "tests" / "integration" / "payload"
# The area markers (pyproject.toml lists them; `pytest -m ssh` runs one area), given by what a test uses:
# its clusters, or the payload's training (the reference runs of resume_job.py and tests/integration/payload).
AREAS = {
    "ssh": {"cluster2", "cluster3", "multi_nic_cluster2", "doomed_cluster3", "podman_cluster"},
    "slurm": {"slurm_cluster", "slurm_cluster3"},
    "podman": {"podman_cluster"},
    "payload": {"uninterrupted"},
}


# Under pytest-xdist (make test: -n, --dist loadgroup), the tests that share what is costly to build run on
# one worker, which builds it once: Slurm's cluster (slurmctld, slurmd per node, munged); the restart tests that
# compare with the payload's uninterrupted reference run (resume_job.py: made once per session, shared with
# the Slurm tests that compare with it too), off the Slurm worker, the suite's longest; the podman hosts. A module whose own fixture is costly groups its tests itself (pytestmark = pytest.mark.xdist_group(...)).
SHARED = {"slurm": AREAS["slurm"], "uninterrupted": {"uninterrupted"}, "podman": AREAS["podman"]}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in AREAS.items():
            if used & fixtures:
                item.add_marker(marker)
        if PAYLOAD_TESTS in item.path.parents:
            item.add_marker("payload")
        if group := next((name for name, fixtures in SHARED.items() if used & fixtures), None):
            item.add_marker(pytest.mark.xdist_group(group))
        if config.getoption("loadgroup", default=False):
            _join_group(item)


def _join_group(item: pytest.Item) -> None:
    """What pytest-xdist 3.8 does for --dist loadgroup, in the way pytest 9 reads it: the group's name
    after `@` in the node id, which the scheduler sends to one worker (xdist sets `_nodeid`, which pytest
    9 no longer reads: every group's tests were spread over every worker, each building the cluster)."""
    groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                     for mark in item.iter_markers("xdist_group")})
    if groups and "@" not in item.nodeid:
        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")  # type: ignore[attr-defined]


@pytest.fixture
def cuda() -> None:
    """tests/gpu's: `make test-gpu` runs them, `make test` leaves them out (pyproject's norecursedirs),
    so none skips where there is no GPU; there, each fails."""
    import torch

    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA GPU and torch sees none; `make test` is the suite for this machine")


@pytest.fixture(scope="session", autouse=True)
def cpu_suite(request: pytest.FixtureRequest) -> Iterator[None]:
    """`make test` is the CPU suite: on a machine with GPUs, what it starts sees none (CUDA_VISIBLE_DEVICES
    empty), so that it shows there what it shows in CI; tests/gpu, run on its own, sees them."""
    if any(GPU_TESTS in item.path.parents for item in request.session.items):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture
def write_yaml(tmp_path: Path):
    """Write dedented YAML to a file under tmp_path and return its path."""

    def write(text: str, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return write


class Streamed:
    """A process started in a session of its own, its output lines collected as they arrive."""

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO) -> None:
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 90, after: re.Match[str] | None = None) -> re.Match[str]:
        """The first line so far (or to come) that matches pattern; after: of those after that match's line."""
        deadline = time.monotonic() + timeout
        seen = self.lines.index(after.string) + 1 if after is not None else 0
        while time.monotonic() < deadline:
            ended = self.proc.poll() is not None and not self._reader.is_alive()
            lines = self.lines[seen:]
            for line in lines:
                if match := re.search(pattern, line):
                    return match
            seen += len(lines)
            if ended:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not seen (exit {self.proc.poll()}); output:\n{self.output}")

    def finish(self, timeout: float = 120) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code

    def kill_group(self) -> None:
        """SIGKILL the process group we started, as a crash or `kill -9` would."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


class Launch(Streamed):
    """`harness launch` as a user starts it; traced_by: a command that runs it (strace and its options)."""

    def __init__(self, job_path: Path, runs_dir: Path, *extra: str, env: dict[str, str] | None = None,
                 cwd: Path = REPO, traced_by: Sequence[str] = ()) -> None:
        super().__init__([*traced_by, sys.executable, "-m", "harness.cli", "launch", str(job_path), "--runs-dir",
                          str(runs_dir), *extra], env=env, cwd=cwd)
        self.runs_dir = runs_dir

    @property
    def run_id(self) -> str:
        return self.wait_for(r"harness: run (\S+): ").group(1)

    def summary(self) -> dict:
        return json.loads((self.runs_dir / self.run_id / "summary.json").read_text())

    def cleanup(self) -> None:
        self.kill_group()
        if match := re.search(r"harness: run (\S+): ", self.output):
            for pid in leftover(match.group(1)):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path):
    started: list[Launch] = []

    def start(job_path: Path, *extra: str, env: dict[str, str] | None = None, cwd: Path = REPO,
              runs_dir: Path | None = None) -> Launch:
        started.append(Launch(job_path, runs_dir or tmp_path / "runs", *extra, env=env, cwd=cwd))
        return started[-1]

    yield start
    for run in started:
        run.cleanup()


def stragglers_s(summary: dict) -> float:
    """How long the last node ran on after the first failure ended its node (from summary.json)."""
    first_end = summary["started_at"] + summary["first_failure"]["after_s"]
    return max(summary["started_at"] + n["duration_s"] for n in summary["nodes"]) - first_end


SECRET_NAME = "HF_TOKEN"  # the secret with_secret gives a job; its ranks say what they have of it (ddp_sum.py)
# Names that look secret (spec/secrets.looks_secret), one of each kind the rule knows, SECRET_NAME aside: written
# in env: or given by --env, the harness shows and keeps their values nowhere (docs/security.md#secrets).
SECRET_LOOKING = ("GITHUB_PAT", "HF_AUTH", "DB_PASSWD", "SSH_PRIVKEY", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY",
                  "GCP_CREDENTIALS", "GPG_PASSPHRASE", "YT_COOKIE", "AOC_SESSION", "MYSQL_PWD")


def secret_looking_env() -> dict[str, str]:
    """Each of SECRET_LOOKING with a fresh value, letters and digits only (strace shows them as they are)."""
    return {name: f"v{secrets.token_hex(10)}" for name in SECRET_LOOKING}


def with_secret(job: Path, source: str = "") -> tuple[Path, str]:
    """job with secret SECRET_NAME taken from source (a secrets: entry's value; empty: the launch's environment)
    and its ranks told to show it (besides the names its env's SHOW_DIGEST lists already); and a fresh value for
    it."""
    text = job.read_text().rstrip("\n")
    if re.search(r"(?m)^  SHOW_DIGEST: '", text):
        text = re.sub(r"(?m)^  SHOW_DIGEST: '", f"  SHOW_DIGEST: '{SECRET_NAME},", text)
    else:
        shown = f"env:\n  SHOW_DIGEST: {SECRET_NAME}\n"
        text = text.replace("env: {}", shown.rstrip("\n")) if "env: {}" in text else text.replace("env:\n", shown, 1)
    job.write_text(f"{text}\nsecrets:\n  {SECRET_NAME}: {source}\n")
    return job, f"hf_{secrets.token_hex(12)}"


def assert_secret_kept(value: str, output: str, ranks: int, *folders: Path, name: str = SECRET_NAME) -> None:
    """Every rank had the value of name, in no process's command line while it ran; and no terminal line and no
    file of folders (the run's record) holds it."""
    digest = hashlib.sha256(value.encode()).hexdigest()[:16]
    for rank in range(ranks):
        assert f"rank {rank}: {name} sha256 {digest}, in 0 command lines" in output, output
    assert value not in output
    for folder in folders:
        holding = [path for path in folder.rglob("*") if path.is_file() and value.encode() in path.read_bytes()]
        assert not holding, f"the secret's value is in {holding}"


def assert_nothing_left(run_id: str, within: float = 5.0) -> None:
    """No process of the run within `within` seconds (nodes are reaped asynchronously, even when done)."""
    deadline = time.monotonic() + within
    while leftover(run_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftover(run_id) == [], f"processes of {run_id} still running"
