"""Remote probe: everything preflight needs to know about one host, gathered in one run.

Runs on the host with the inventory's `python:` (stdlib only: the host may lack the harness, even
torch) and prints one JSON answer (Facts below) after the marker given as argv[1]; argv[2] is its JSON config:
import_torch (authoritative NCCL version and torch's own GPU count, at the price of importing
torch), workdir, entrypoint ({"module": ...} or {"script": ...} or null), master_address, peers
(host name -> address: the kernel's route to each), stacks (default true: whether py-spy can read a
Python process here, as the node agent will read its ranks'). With stacks_only it answers that alone:
a container job's host, where the agent runs while the probe proper runs inside the image.
"""

from __future__ import annotations

import array
import concurrent.futures
import ctypes
import difflib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, final

from harness.node.gpu import GpuHealth, XidEvent, device_health, xid_events
from harness.node.proctable import environ
from harness.node.ranks import dump, py_spy_path

if TYPE_CHECKING:  # typing.NotRequired is Python 3.11's; a host's may be older, and annotations stay unevaluated
    from typing import NotRequired

MISSING = "missing"
NONE = "none"
# <linux/sockios.h>, <net/if.h>; struct ifreq is 40 bytes: the name, then a 24-byte union.
SIOCGIFCONF, SIOCGIFFLAGS, SIOCGIFMTU = 0x8912, 0x8913, 0x8921
IFF_UP, IFF_LOOPBACK = 0x1, 0x8
IFREQ = 40
# The stack check's test process: says it is up (a dump while the interpreter starts fails), then idles.
# As a rank does (node/rank_hook.py): it names its reader's parent, here this probe, as its ptracer (Yama scope 1).
STACKS_CHILD = ("import ctypes, os, sys, time; ctypes.CDLL(None).prctl(0x59616D61, os.getppid(), 0, 0, 0); "
                "sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(30)")
STACKS_START_SECONDS = 5.0
CAP_SYS_PTRACE = 19  # <linux/capability.h>


# The answer's shape, key by key, for preflight's readers. A @final one is half of a union its readers tell
# apart by a key (`"error" in network`), which mypy narrows only for final TypedDicts.
class Versions(TypedDict):
    """torch's version.py, read without importing torch (MISSING: no torch)."""

    torch: str
    torch_git: str
    cuda: str


class GpuProcess(TypedDict):
    """A process holding GPU memory, as nvidia-smi lists it; gpu: its index (its uuid if not listed). run_id and
    attempt: the harness run and attempt that started it, from its environment (a rank left over by one)."""

    pid: int
    name: str
    used_mib: str
    gpu: str
    run_id: NotRequired[str]
    attempt: NotRequired[str]


class Gpus(TypedDict):
    """What nvidia-smi says: no nvidia-smi is no GPU (driver NONE); gpu_error when it failed. gpu_health: each
    GPU's fitness as NVML says it (harness.node.gpu), or why it cannot say; gpu_xids: the Xid events in the
    kernel's log, or why it cannot be read; both only where there are GPUs."""

    gpus: int
    driver: str
    gpu_names: list[str]
    gpu_processes: list[GpuProcess]
    gpu_error: NotRequired[str]
    gpu_health: NotRequired[list[GpuHealth] | str]
    gpu_xids: NotRequired[list[XidEvent] | str]


class Interface(TypedDict):
    """A network interface as `ip addr` shows it: addresses IPv4 first, then global IPv6."""

    name: str
    index: int
    up: bool
    loopback: bool
    mtu: int
    addresses: list[str]


class Route(TypedDict):
    """The kernel's route towards a peer: the source address it picks and the interface that holds it
    (None: no interface holds it), or the error that says why there is none."""

    address: str
    source: NotRequired[str]
    interface: NotRequired[str | None]
    error: NotRequired[str]


@final
class Network(TypedDict):
    """Every interface in index order (the order NCCL sees), and the route to every peer by host name."""

    interfaces: list[Interface]
    routes: dict[str, Route]


@final
class NetworkUnlisted(TypedDict):
    """Why the interfaces could not be listed."""

    error: str


class Payload(TypedDict):
    """The entrypoint's file and its sha256, or the error that says why it is not there; syntax_error: where
    and why the file does not compile with this host's Python (`train.py:12: invalid syntax`)."""

    target: str
    path: NotRequired[str]
    sha256: NotRequired[str]
    error: NotRequired[str]
    syntax_error: NotRequired[str]


class Dataset(TypedDict):
    """A data path: if it exists, its files, bytes and a digest of what `compared` says."""

    exists: bool
    files: NotRequired[int]
    bytes: NotRequired[int]
    digest: NotRequired[str]
    compared: NotRequired[str]


@final
class Stacks(TypedDict):
    """Whether py-spy, where the node agent looks for it, read a test Python process (readable, else the
    error), and what decides ptrace rights: the fix depends on them."""

    python: str
    py_spy: str | None
    version: str | None
    readable: bool
    error: str | None
    uid: int
    ptrace_scope: int | None
    cap_sys_ptrace: bool | None
    container: bool


@final
class StacksUnprobed(TypedDict):
    """Stacks' place when the probe on a container job's host failed: preflight writes it, not the probe."""

    python: str
    failed: str


class StacksOnly(TypedDict):
    """The answer with stacks_only."""

    python_executable: str
    stacks: Stacks


class Facts(Versions, Gpus):
    """The answer: one host's software, GPUs, room, job files, name resolution, network and stack capture.
    master_resolves, self_resolves: the addresses in resolver order, or why the name does not resolve.
    torch_gpus or torch_import_error: only with import_torch, which also reads nccl from torch itself."""

    hostname: str
    python: str
    python_executable: str
    torchvision: str
    harness: str
    workdir: str
    workdir_exists: bool
    disk_free_bytes: int | None
    shm_bytes: int | None
    payload: Payload | None
    data: dict[str, Dataset]
    master_resolves: list[str] | str
    self_resolves: list[str] | str
    network: Network | NetworkUnlisted
    stacks: Stacks | StacksUnprobed | None
    nccl: str
    torch_gpus: NotRequired[int]
    torch_import_error: NotRequired[str]


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return MISSING


def _find_spec(name: str) -> Any:
    """find_spec that reports any failure (also one raised by a parent package) as not found."""
    try:
        return importlib.util.find_spec(name)
    except Exception:  # noqa: BLE001 - importing a parent package can raise anything
        return None


def _torch_files() -> Versions:
    """torch's version.py read without importing torch (seconds saved on every fast preflight)."""
    spec = _find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"torch": MISSING, "torch_git": MISSING, "cuda": MISSING}
    namespace: dict[str, Any] = {}
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    exec(compile(version_file.read_text(), str(version_file), "exec"), namespace)  # noqa: S102 - torch's own file
    return {"torch": str(namespace.get("__version__")), "torch_git": str(namespace.get("git_version")),
            "cuda": str(namespace.get("cuda") or NONE)}


def _nccl_from_library(cuda: str) -> str:
    """ncclGetVersion from the libnccl a pip torch loads (nvidia/nccl/lib), without importing torch."""
    if cuda in (NONE, MISSING):
        return NONE
    spec = _find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        return "unknown"
    library = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libnccl.so.2"
    try:
        version = ctypes.c_int()
        ctypes.CDLL(str(library)).ncclGetVersion(ctypes.byref(version))
    except OSError:
        return "unknown"
    code = version.value
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _import_torch(facts: Facts) -> None:
    """NCCL's version and the GPU count as torch itself sees them, into facts."""
    try:
        import torch  # imported here: only in the full probe
    except Exception as exc:  # noqa: BLE001 - a broken torch install is a finding, not a crash
        facts["torch_import_error"] = f"{type(exc).__name__}: {exc}"
        return
    try:
        facts["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        facts["nccl"] = NONE
    facts["torch_gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _harness_version() -> str:
    """The version of the harness that `python -m` in the workdir would import (checkout or install)."""
    spec = _find_spec("harness")
    if spec is None or not spec.origin:
        return MISSING
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", Path(spec.origin).read_text())
    return match.group(1) if match else "unknown"


def _nvidia_smi(*query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, timeout=20, check=True).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def _gpus() -> Gpus:
    if shutil.which("nvidia-smi") is None:
        return {"gpus": 0, "driver": NONE, "gpu_names": [], "gpu_processes": []}
    try:
        rows = _nvidia_smi("--query-gpu=index,name,uuid,driver_version")
        apps = _nvidia_smi("--query-compute-apps=pid,process_name,used_memory,gpu_uuid")
    except (subprocess.SubprocessError, OSError) as exc:
        return {"gpus": 0, "driver": "unknown", "gpu_names": [], "gpu_processes": [],
                "gpu_error": f"nvidia-smi failed: {exc}"}
    index_of = {row[2]: row[0] for row in rows}
    found: Gpus = {
        "gpus": len(rows),
        "driver": rows[0][3] if rows else NONE,
        "gpu_names": [row[1] for row in rows],
        "gpu_processes": [_gpu_process(int(a[0]), a[1], a[2], index_of.get(a[3], a[3])) for a in apps if len(a) >= 4],
    }
    if rows:
        found["gpu_health"] = device_health()
        found["gpu_xids"] = xid_events()
    return found


def _gpu_process(pid: int, name: str, used_mib: str, gpu: str) -> GpuProcess:
    process: GpuProcess = {"pid": pid, "name": name, "used_mib": used_mib, "gpu": gpu}
    env = environ(pid)
    if b"HARNESS_RUN_ID" in env:
        process["run_id"] = env[b"HARNESS_RUN_ID"].decode(errors="replace")
        process["attempt"] = env.get(b"HARNESS_ATTEMPT", b"?").decode(errors="replace")
    return process


def _addresses(name: str) -> list[str] | str:
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        return f"does not resolve ({exc})"
    return list(dict.fromkeys(str(info[4][0]) for info in infos))  # resolver order: connections use the first


def _ipv4_addresses() -> dict[str, list[str]]:
    """Every IPv4 address per interface, as `ip addr` lists them (SIOCGIFCONF: no iproute2 needed)."""
    size = IFREQ * 1024
    buffer = array.array("B", bytes(size))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("iL", size, buffer.buffer_info()[0])
        length = struct.unpack("iL", fcntl.ioctl(sock.fileno(), SIOCGIFCONF, request))[0]
    data = buffer.tobytes()
    found: dict[str, list[str]] = {}
    for offset in range(0, length, IFREQ):
        label = data[offset:offset + 16].split(b"\0")[0].decode()
        found.setdefault(label.split(":")[0], []).append(socket.inet_ntoa(data[offset + 20:offset + 24]))
    return found


def _ipv6_addresses() -> dict[str, list[str]]:
    """Global-scope IPv6 addresses per interface (link-local ones need a scope id nobody passes)."""
    found: dict[str, list[str]] = {}
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) == 6 and fields[3] == "00":
            found.setdefault(fields[5], []).append(socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0])))
    return found


def _interfaces() -> list[Interface]:
    """Every interface in index order (the order getifaddrs, and so NCCL, sees them)."""
    ipv4, ipv6 = _ipv4_addresses(), _ipv6_addresses()
    found: list[Interface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for index, name in socket.if_nameindex():
            request = struct.pack("16s24s", name.encode(), b"")
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, request), 16)[0]
                mtu = struct.unpack_from("i", fcntl.ioctl(sock.fileno(), SIOCGIFMTU, request), 16)[0]
            except OSError:
                continue  # gone since the listing
            found.append({"name": name, "index": index, "up": bool(flags & IFF_UP),
                          "loopback": bool(flags & IFF_LOOPBACK), "mtu": mtu,
                          "addresses": ipv4.get(name, []) + ipv6.get(name, [])})
    return found


def _route(address: str, interfaces: list[Interface]) -> Route:
    """The kernel's own choice of source address, and so interface, towards address: connecting a UDP
    socket sends nothing, it only looks the route up."""
    try:
        family, _, _, _, destination = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
    except OSError as exc:
        return {"address": address, "error": f"does not resolve ({exc})"}
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(destination)
            source = str(sock.getsockname()[0])
    except OSError as exc:
        return {"address": str(destination[0]), "error": exc.strerror or str(exc)}
    holder = next((i["name"] for i in interfaces if source in i["addresses"]), None)
    return {"address": str(destination[0]), "source": source, "interface": holder}


def _network(peers: dict[str, str]) -> Network | NetworkUnlisted:
    try:
        interfaces = _interfaces()
    except OSError as exc:
        return {"error": f"cannot list the network interfaces: {exc}"}
    return {"interfaces": interfaces, "routes": {name: _route(address, interfaces) for name, address in peers.items()}}


def _payload(entrypoint: dict[str, str] | None, workdir: str) -> Payload | None:
    """sha256 of the job's script, or of the module's source file as `python -m` in workdir finds it."""
    if not entrypoint:
        return None
    if entrypoint.get("script"):
        target = entrypoint["script"]
        path = Path(workdir, os.path.expanduser(target))
    else:
        target = entrypoint["module"]
        spec = _find_spec(target)
        if spec is not None and spec.submodule_search_locations:
            spec = _find_spec(f"{target}.__main__")
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            return {"target": target, "error": f"module {target} is not importable from {workdir}"}
        path = Path(spec.origin)
    if not path.is_file():
        return {"target": target, "error": f"{path} does not exist{_did_you_mean(path)}"}
    source = path.read_bytes()
    found: Payload = {"target": target, "path": str(path), "sha256": hashlib.sha256(source).hexdigest()}
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:  # IndentationError and TabError are SyntaxErrors too
        found["syntax_error"] = f"{exc.filename or path}:{exc.lineno}: {exc.msg} ({type(exc).__name__})"
    except ValueError as exc:  # a NUL byte in the source
        found["syntax_error"] = f"{path}: {exc}"
    return found


def _did_you_mean(path: Path) -> str:
    """` (did you mean train.py?)` where a file beside it is named almost the same (a typo), else nothing."""
    try:
        names = [entry.name for entry in os.scandir(path.parent) if entry.is_file()]
    except OSError:
        return ""
    close = difflib.get_close_matches(path.name, names, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def _space(path: str) -> int | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


CONTENT_HASH_LIMIT = 1 << 30  # above this, compare names and sizes only: hashing would take minutes


def _dataset(path: str, full: bool) -> Dataset:
    """Files, bytes and a digest of a data path; the digest covers contents when full and small enough."""
    root = Path(os.path.expanduser(path))
    if not root.exists():
        return {"exists": False}
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    sizes = [(str(p.relative_to(root)) if root.is_dir() else p.name, p.stat().st_size) for p in files]
    total = sum(size for _, size in sizes)
    contents = full and total <= CONTENT_HASH_LIMIT
    digest = hashlib.sha256(json.dumps(sizes).encode())
    if contents:
        for file in files:
            with open(file, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return {"exists": True, "files": len(files), "bytes": total, "digest": digest.hexdigest(),
            "compared": "contents" if contents else "names and sizes"}


def _ptrace_scope() -> int | None:
    """kernel.yama.ptrace_scope (None: no Yama): 1 lets a process read only its own descendants."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return None


def _cap_sys_ptrace() -> bool | None:
    """Whether this process holds CAP_SYS_PTRACE (root outside a container; inside one, --cap-add SYS_PTRACE)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _py_spy_version(py_spy: str) -> str:
    try:
        said = subprocess.run([py_spy, "--version"], capture_output=True, text=True, timeout=5, check=False,
                              stdin=subprocess.DEVNULL).stdout.split()
    except (subprocess.SubprocessError, OSError):
        return "unknown"
    return said[-1] if said else "unknown"


def _read_a_stack(py_spy: str) -> str | None:
    """Dump a test Python started here, as the agent dumps its ranks: py-spy is then that process's
    sibling, not its parent, which kernel.yama.ptrace_scope=1 allows only because the process named this
    one its ptracer, as every rank names its agent. None: read, with frames."""
    child = subprocess.Popen([sys.executable, "-I", "-S", "-c", STACKS_CHILD], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert child.stdout is not None
        if not select.select([child.stdout], [], [], STACKS_START_SECONDS)[0] or not child.stdout.readline():
            return f"the test process {sys.executable} did not start within {STACKS_START_SECONDS:g} s"
        threads = dump(child.pid, py_spy)
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    if isinstance(threads, str):
        return threads
    if not any(thread["frames"] for thread in threads):
        return "py-spy found no Python frames in the test process"
    return None


def _stacks() -> Stacks:
    """Can the node agent read its ranks' Python stacks here? py-spy where the agent looks for it (beside
    this Python, else on PATH), a real dump of a test process, and what decides ptrace rights (for the fix)."""
    found = py_spy_path(sys.executable)
    facts: Stacks = {
        "python": sys.executable, "py_spy": found, "version": None, "readable": False, "error": None,
        "uid": os.geteuid(), "ptrace_scope": _ptrace_scope(), "cap_sys_ptrace": _cap_sys_ptrace(),
        "container": os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"),
    }
    if found is None:
        facts["error"] = f"py-spy is neither beside {sys.executable} nor on PATH"
        return facts
    facts["version"] = _py_spy_version(found)
    try:
        facts["error"] = _read_a_stack(found)
    except OSError as exc:
        facts["error"] = f"cannot start the test process {sys.executable}: {exc.strerror or exc}"
    facts["readable"] = facts["error"] is None
    return facts


def _shm_bytes() -> int | None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return None
    stat = os.statvfs(shm)
    return stat.f_blocks * stat.f_frsize


def probe(config: dict[str, Any]) -> Facts | StacksOnly:
    if config.get("stacks_only"):
        return {"python_executable": sys.executable, "stacks": _stacks()}
    # The stack check waits on two processes (py-spy and the test Python it reads): meanwhile, the rest.
    stacks = concurrent.futures.ThreadPoolExecutor(1).submit(_stacks) if config.get("stacks", True) else None
    workdir = os.path.expanduser(config.get("workdir") or "~")
    workdir_ok = os.path.isdir(workdir)
    if workdir_ok:
        os.chdir(workdir)
        sys.path.insert(0, workdir)  # what `python -m` started in the workdir sees
    versions = _torch_files()
    facts: Facts = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        **versions,
        "torchvision": _dist_version("torchvision"),
        "harness": _harness_version(),
        **_gpus(),
        "workdir": workdir,
        "workdir_exists": workdir_ok,
        "disk_free_bytes": _space(workdir) if workdir_ok else None,
        "shm_bytes": _shm_bytes(),
        "payload": _payload(config.get("entrypoint"), workdir) if workdir_ok else None,
        "data": {path: _dataset(path, config.get("import_torch", False)) for path in config.get("data_paths", [])}
        if workdir_ok else {},
        "master_resolves": _addresses(config["master_address"]),
        "self_resolves": _addresses(socket.gethostname()),
        "network": _network(config.get("peers", {})),
        "stacks": stacks.result() if stacks is not None else None,
        "nccl": _nccl_from_library(versions["cuda"]),
    }
    if config.get("import_torch") and facts["torch"] != MISSING:
        _import_torch(facts)
    return facts


if __name__ == "__main__":
    print(sys.argv[1] + json.dumps(probe(json.loads(sys.argv[2]))), flush=True)
