"""Verdicts from the probes' facts: software parity across hosts, GPUs and their fitness, /dev/shm, disk, stack
capture, name resolution."""

from __future__ import annotations

from collections import Counter
from typing import Literal, get_args

from harness.node.gpu import GpuHealth, XidEvent
from harness.node.probe import MISSING, Facts, Stacks
from harness.preflight.table import Check, Status
from harness.spec.inventory import Host
from harness.spec.job import Entrypoint, JobSpec
from harness.targets.address import is_loopback

# The probe's keys compared across hosts, payload (the entrypoint's hash) last.
Fingerprinted = Literal["python", "torch", "torch_git", "cuda", "nccl", "torchvision", "driver", "harness", "payload"]
FINGERPRINT: tuple[Fingerprinted, ...] = get_args(Fingerprinted)
GIB = 1 << 30
SHM_WARN = 1 * GIB
DISK_FAIL = 1 * GIB
DISK_WARN = 10 * GIB
PY_SPY = "py-spy==0.4.3"  # pyproject's pin: what the node agent reads the ranks' Python stacks with
# Xids whose cure NVIDIA's catalog says is a GPU reset, a reboot or new hardware (ECC, row remapping, NVLink, the bus,
# the GSP); the others (13, 31, 43, ...) are a program's own faults.
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 123, 140, 143, 149, 154})
XID_FRESH_S = 600.0  # a hardware Xid this recent is the fault a restart follows (or one just before the launch)
NO_STACKS = "hang verdicts and `harness stacks` will have no Python stacks from this {where} (the job itself runs)"


def size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


def job_backend(spec: JobSpec | None, facts: dict[str, Facts]) -> str | None:
    """The backend the job will really use: `auto` is nccl only where every host has a GPU."""
    if spec is None:
        return None
    if spec.backend != "auto":
        return spec.backend
    return "nccl" if facts and all(f["gpus"] > 0 for f in facts.values()) else "gloo"


def fingerprint_of(facts: Facts) -> dict[str, str]:
    values: dict[str, str] = {name: str(facts[name]) for name in FINGERPRINT[:-1]}
    payload = facts["payload"]
    values["payload"] = "n/a" if payload is None else payload["sha256"][:12] if "sha256" in payload else MISSING
    return values


def majority(values: list[str], master_value: str | None) -> str:
    """What most hosts have; on a tie, what the master has."""
    counts = Counter(values).most_common()
    tied = [value for value, count in counts if count == counts[0][1]]
    return master_value if master_value in tied else tied[0]


def _code_fix(entrypoint: Entrypoint | None, facts: Facts) -> str:
    """Where the job's code must be: every host's workdir; for simulated nodes (entrypoint given), this
    machine's directory and the job spec's key."""
    if entrypoint is None:
        return "put the job's code at the same path in the workdir of every host"
    workdir = facts["workdir"]
    if entrypoint.script is not None:
        where = "" if entrypoint.script.startswith(("/", "~")) else f" in {workdir}"
        return f"create {entrypoint.script}{where}, or fix entrypoint.script"
    return (f"make {entrypoint.module} importable from {workdir} (put it there, or install its package for "
            f"{facts['python_executable']}), or fix entrypoint.module")


def fingerprint_checks(facts: dict[str, Facts], master: str, *,
                       local: Entrypoint | None = None) -> tuple[list[Check], dict[str, dict[str, str]], list[str]]:
    """Per host: torch present, entrypoint found, and every fingerprint field equal across hosts. local:
    the job's entrypoint when its nodes are simulated on this machine, whose fixes name this machine's
    directories and the job spec's keys instead of hosts and the inventory; its rows name the interpreter."""
    prints = {host: fingerprint_of(f) for host, f in facts.items()}
    mismatched: list[str] = [field for field in FINGERPRINT if len({p[field] for p in prints.values()}) > 1]
    reference = {field: majority([p[field] for p in prints.values()], prints.get(master, {}).get(field))
                 for field in mismatched}
    checks = []
    for host, values in prints.items():
        problems, fixes = [], []
        python = facts[host]["python_executable"]
        if values["torch"] == MISSING:
            problems.append(f"torch is not installed for {python}")
            fixes.append(f"install it there (`{python} -m pip install torch`), or set simulated.python to the "
                         f"interpreter of an environment that has torch" if local is not None else
                         "point `python:` in the inventory at the interpreter of the environment that has torch")
        payload = facts[host]["payload"]
        if payload is not None and "error" in payload:
            problems.append(f"entrypoint {payload['target']}: {payload['error']}")
            fixes.append(_code_fix(local, facts[host]))
        elif payload is not None and "syntax_error" in payload:
            problems.append(f"entrypoint {payload['target']} does not compile: {payload['syntax_error']}")
            fixes.append(f"fix the code there (`{python} -m py_compile {payload.get('path')}` shows the same)")
        differs = [field for field in mismatched if values[field] != reference[field]]
        if differs:
            others = [h for h in prints if h != host and all(prints[h][f] == reference[f] for f in differs)]
            problems.append("differs from " + (", ".join(others) or "the other hosts") + ": " + ", ".join(
                f"{field} {values[field]} vs {reference[field]}" for field in differs))
            fixes.append("install the same versions everywhere (one pinned venv or image); see the table below")
        if problems:
            checks.append(Check(host, "fingerprint", Status.FAIL, "; ".join(problems), "; ".join(fixes), values))
            continue
        interpreter = f" ({python})" if local is not None else ""
        summary = (f"python {values['python']}{interpreter}, torch {values['torch']} ({values['torch_git'][:8]}), "
                   f"cuda {values['cuda']}, nccl {values['nccl']}, torchvision {values['torchvision']}, "
                   f"driver {values['driver']}, harness {values['harness']}, payload {values['payload']}")
        same = "; other hosts differ, see below" if mismatched else ("; same on all hosts" if len(prints) > 1 else "")
        checks.append(Check(host, "fingerprint", Status.PASS, summary + same, None, values))
    return checks, prints, mismatched


def _gpus(host: Host, facts: Facts, spec: JobSpec | None, backend: str | None) -> Check:
    found = facts["gpus"]
    if spec is None or (backend != "nccl" and spec.resources.gpus == 0):
        why = "no job given" if spec is None else f"the job runs on CPU (backend {backend}, resources.gpus 0)"
        return Check(host.name, "gpus", Status.SKIP, f"{why}; {found} GPUs found")
    per_node = spec.nproc_per_node if isinstance(spec.nproc_per_node, int) else (host.gpus or 1)
    required = max(per_node if backend == "nccl" else 0, spec.resources.gpus)
    if found < required:
        error = f" ({facts['gpu_error']})" if "gpu_error" in facts else ""
        return Check(host.name, "gpus", Status.FAIL, f"{found} GPUs{error}, the job needs {required} per node",
                     "lower nproc_per_node/resources.gpus, or check the GPUs and driver with `nvidia-smi`")
    if "torch_gpus" in facts and facts["torch_gpus"] < required:
        return Check(host.name, "gpus", Status.FAIL,
                     f"torch sees {facts['torch_gpus']} GPUs but nvidia-smi lists {found}; the job needs {required}",
                     f"the driver {facts['driver']} may be too old for CUDA {facts['cuda']}, "
                     f"or CUDA_VISIBLE_DEVICES hides GPUs")
    busy = [p for p in facts["gpu_processes"] if "run_id" not in p]  # a harness run's: _left_over's
    if busy:
        holders = ", ".join(f"pid {p['pid']} ({p['name']}) {p['used_mib']} MiB on GPU {p['gpu']}" for p in busy)
        return Check(host.name, "gpus", Status.WARN, f"{found} GPUs, but memory is in use: {holders}",
                     "stop those processes or use other hosts; they compete for GPU memory", {"processes": busy})
    names = ", ".join(sorted(set(facts["gpu_names"])))
    return Check(host.name, "gpus", Status.PASS,
                 f"{found} GPUs ({names}), driver {facts['driver']}, job needs {required}")


def _left_over(host: Host, facts: Facts, spec: JobSpec | None) -> list[Check]:
    """GPU memory held by a process a harness run started (its environment says which run and attempt): a rank
    that outlived its attempt, as one stuck in the driver does, holds what the next attempt needs. No row
    where there is none."""
    left = [p for p in facts["gpu_processes"] if "run_id" in p]
    if not left or spec is None:
        return []
    holders = ", ".join(f"pid {p['pid']} ({p['name']}) {p['used_mib']} MiB on GPU {p['gpu']}, of run {p['run_id']} "
                        f"attempt {p['attempt']}" for p in left)
    return [Check(host.name, "gpu_memory", Status.FAIL, f"GPU memory still held by a harness run's process that "
                  f"outlived its attempt: {holders}",
                  f"end it (`kill -9 PID` on {host.name}); one that SIGKILL does not end is stuck in the driver and "
                  f"the host needs a GPU reset or a reboot", {"processes": left})]


def _shm(host: str, facts: Facts) -> Check:
    shm = facts["shm_bytes"]
    fix = "enlarge it, e.g. `mount -o remount,size=16G /dev/shm` (containers: --shm-size, or a Memory emptyDir)"
    if shm is None:
        return Check(host, "shm", Status.WARN, "/dev/shm does not exist (DataLoader workers need it)", fix)
    if shm < SHM_WARN:
        return Check(host, "shm", Status.WARN,
                     f"/dev/shm is only {size(shm)}; DataLoader workers die with 'bus error' when it fills", fix)
    return Check(host, "shm", Status.PASS, f"/dev/shm {size(shm)}")


def _disk(host: str, facts: Facts) -> Check:
    workdir = facts["workdir"]
    if not facts["workdir_exists"]:
        return Check(host, "disk", Status.FAIL, f"workdir {workdir} does not exist",
                     "create it with the job's code in it, or fix `workdir:` in the inventory")
    free = facts["disk_free_bytes"]
    if free is None:
        return Check(host, "disk", Status.WARN, f"cannot tell how much space is free in {workdir}",
                     f"`df {workdir}` on {host} says why")
    fix = f"free space in {workdir} (checkpoints and logs are written there)"
    if free < DISK_FAIL:
        return Check(host, "disk", Status.FAIL, f"only {size(free)} free in {workdir}", fix)
    if free < DISK_WARN:
        return Check(host, "disk", Status.WARN, f"only {size(free)} free in {workdir}", fix)
    return Check(host, "disk", Status.PASS, f"{size(free)} free in {workdir}")


def _ptrace_fix(host: str, stacks: Stacks) -> str:
    """How to give py-spy the right to read the ranks, from what the probe saw of ptrace rights on the host."""
    scope, path = stacks["ptrace_scope"], stacks["py_spy"]
    # The safe way first: at ptrace_scope 1 each rank names its node agent its ptracer (the rank hook's
    # PR_SET_PTRACER), so py-spy reads the ranks and nothing else. Wider rights only where the host is the user's
    # alone: `setcap cap_sys_ptrace` on py-spy lets everyone who runs it read every process, root's too.
    alone = (f"on a host that is yours alone, `sysctl kernel.yama.ptrace_scope=0` or the agent as root (never "
             f"`setcap cap_sys_ptrace+ep` on a shared host: every user who runs {path} could read every process)")
    if stacks["container"] and not stacks["cap_sys_ptrace"]:
        return (f"{host} is a container without CAP_SYS_PTRACE: start it with `--cap-add SYS_PTRACE` (the harness's "
                f"own Kubernetes pods need none: their agent is their ranks' ptracer)")
    if scope == 3:
        return (f"kernel.yama.ptrace_scope is 3 on {host} (no process may read another until reboot): set it to 1 "
                f"in /etc/sysctl.d/ and reboot (at 1 each rank names the node agent its ptracer)")
    if scope == 2 and not stacks["cap_sys_ptrace"]:
        return (f"`sysctl kernel.yama.ptrace_scope=1` on {host} (it is 2: only CAP_SYS_PTRACE may read another "
                f"process; at 1, Ubuntu's default, each rank names the node agent its ptracer, and py-spy reads the "
                f"ranks and nobody else's processes); {alone}")
    return (f"`{path} dump --pid PID` on {host} says why py-spy is refused (the same user at ptrace_scope 0 or 1 is "
            f"all it needs: each rank names the node agent its ptracer); {alone}")


def stacks_check(host: str, facts: Facts, *, local: bool = False) -> Check:
    """py-spy found where the node agent looks for it, and able to read a Python process on the host: the agent
    needs both to show every rank's stack when a job hangs. Without them the job still runs, so: a warning.
    local: simulated nodes, whose agents run with the harness's own Python on this machine."""
    stacks = facts["stacks"]
    if not stacks:
        return Check(host, "stacks", Status.SKIP, "not checked")
    python, details = stacks["python"], {k: v for k, v in stacks.items() if k != "error"}
    no_stacks = NO_STACKS.format(where="machine" if local else "host")
    if "failed" in stacks:
        return Check(host, "stacks", Status.WARN, f"{stacks['failed']}; {no_stacks}",
                     f"check that {python}, the harness's own Python, runs: the node agents run with it" if local else
                     f"set `python:` in the inventory to a Python of {host} itself (the node agent runs there, "
                     f"outside the container)", details)
    if stacks["py_spy"] is None:
        return Check(host, "stacks", Status.WARN, f"{stacks['error']}: {no_stacks}",
                     f"`{python} -m pip install {PY_SPY}` (the node agents run with that Python, the harness's own, "
                     f"and look for py-spy beside it, then on PATH)" if local else
                     f"`{python} -m pip install {PY_SPY}` on {host} (the node agent looks for py-spy beside that "
                     f"Python, then on PATH)", details)
    if not stacks["readable"]:
        return Check(host, "stacks", Status.WARN, f"py-spy {stacks['version']} ({stacks['py_spy']}) cannot read a "
                     f"Python process: {stacks['error']}; {no_stacks}", _ptrace_fix(host, stacks), details)
    return Check(host, "stacks", Status.PASS,
                 f"py-spy {stacks['version']} ({stacks['py_spy']}) read the stack of a test process", None, details)


def _gpu_health(host: Host, facts: Facts, spec: JobSpec | None, backend: str | None) -> list[Check]:
    """Whether the driver calls every GPU fit (NVML and the kernel log, before every attempt): a GPU that needs a
    reset or a reboot, has remappings pending or a remapping failed, or logged a hardware Xid in the last
    XID_FRESH_S fails the host, which a spare then replaces; uncorrectable ECC errors and older hardware Xids
    alone warn. A host without GPUs has no such row."""
    health = facts.get("gpu_health")
    if health is None:
        return []
    return [_fitness(host, health, facts.get("gpu_xids", []), spec, backend)]


def _fitness(host: Host, health: list[GpuHealth] | str, xids: list[XidEvent] | str, spec: JobSpec | None,
             backend: str | None) -> Check:
    if spec is None or (backend != "nccl" and spec.resources.gpus == 0):
        return Check(host.name, "gpu_health", Status.SKIP, "no job given" if spec is None else "the job runs on CPU")
    if isinstance(health, str):
        return Check(host.name, "gpu_health", Status.WARN, f"NVML cannot say whether the GPUs are fit: {health}")
    hardware = [] if isinstance(xids, str) else [x for x in xids if x["xid"] in HARDWARE_XIDS]
    unfit = [f"GPU {gpu['index']} needs {gpu['recovery']} (the driver's recovery action)"
             for gpu in health if gpu["recovery"]]
    unfit += [f"GPU {gpu['index']} has memory rows waiting to be remapped (a GPU reset applies them)"
              for gpu in health if gpu["rows_pending"]]
    unfit += [f"GPU {gpu['index']} failed to remap a memory row" for gpu in health if gpu["rows_failed"]]
    unfit += [_xid(x) for x in hardware if x["age_s"] <= XID_FRESH_S]
    if unfit:
        return Check(host.name, "gpu_health", Status.FAIL, "; ".join(unfit),
                     "reset the GPU (`nvidia-smi -r -i N` with nothing running on it) or reboot the host, as the "
                     "driver says; a failed remapping means the GPU must be replaced", {"xids": hardware})
    errors = [f"GPU {gpu['index']}: {gpu['ecc_uncorrected']}" for gpu in health if gpu["ecc_uncorrected"]]
    warnings = [f"uncorrectable ECC errors since the driver loaded ({', '.join(errors)}), no recovery asked for"
                ] if errors else []
    warnings += [f"older hardware Xids: {'; '.join(_xid(x) for x in hardware)}"] if hardware else []
    if warnings:
        return Check(host.name, "gpu_health", Status.WARN, "; ".join(warnings), None, {"xids": hardware})
    read = f"Xids not read: {xids}" if isinstance(xids, str) else "no hardware Xid"
    return Check(host.name, "gpu_health", Status.PASS, f"{len(health)} GPU(s) fit: no recovery action, no row "
                                                       f"remapping pending or failed, no uncorrectable ECC error, "
                                                       f"{read}")


def _xid(event: XidEvent) -> str:
    return f"Xid {event['xid']} on GPU {event['pci']} {event['age_s']:.0f} s ago ({event['text']})"


def resource_checks(host: Host, facts: Facts, spec: JobSpec | None, backend: str | None) -> list[Check]:
    return [_gpus(host, facts, spec, backend), *_gpu_health(host, facts, spec, backend), *_left_over(host, facts, spec),
            _shm(host.name, facts),
            _disk(host.name, facts)]


def data_checks(facts: dict[str, Facts], paths: list[str], master: str, setup: bool = False, *,
                local: bool = False) -> list[Check]:
    """Every data path of the job present on every host, and the same there as on most hosts. setup:
    the job's setup commands run before torchrun and must create what is missing (checked then).
    local: simulated nodes, whose fix names this machine's directory, not storage the hosts share."""
    checks = []
    for path in paths:
        found = {host: f["data"].get(path, {"exists": False}) for host, f in facts.items()}
        present = {host: d for host, d in found.items() if d["exists"]}
        master_digest = present[master]["digest"] if master in present else None
        reference = majority([d["digest"] for d in present.values()], master_digest) if present else None
        for host, data in found.items():
            if not data["exists"] and setup:
                checks.append(Check(host, "data", Status.WARN, f"{path} is missing in {facts[host]['workdir']}: "
                                    f"the job's setup: must create it (checked before torchrun starts)",
                                    f"nothing, if setup creates {path}; otherwise copy it there"))
            elif not data["exists"]:
                fix = (f"create it there, e.g. `harness prepare --data-dir {path}` for CIFAR-10, or fix data_paths"
                       if local else f"copy it there (or onto storage every host mounts), e.g. `harness prepare "
                       f"--data-dir {path}` for CIFAR-10")
                checks.append(Check(host, "data", Status.FAIL, f"{path} is missing in {facts[host]['workdir']}", fix))
            elif data["digest"] != reference:
                same = sorted(h for h, d in present.items() if d["digest"] == reference)
                checks.append(Check(host, "data", Status.FAIL,
                                    f"{path} differs from {', '.join(same)} ({data['files']} files, "
                                    f"{size(data['bytes'])} vs {present[same[0]]['files']} files, "
                                    f"{size(present[same[0]]['bytes'])}; compared {data['compared']})",
                                    f"sync {path} from {same[0]} (e.g. rsync -a --delete)"))
            else:
                checks.append(Check(host, "data", Status.PASS,
                                    f"{path}: {data['files']} files, {size(data['bytes'])}, same on all hosts "
                                    f"(compared {data['compared']})" if len(present) == len(found) else
                                    f"{path}: {data['files']} files, {size(data['bytes'])}"))
    return checks


def resolve_checks(facts: dict[str, Facts], master: Host, one_machine: bool = False) -> list[Check]:
    """Every host resolves the master's address alike and not to loopback (each host's own name is the
    interface check's business: gloo's default, interfaces.py). one_machine: every host is this machine
    at a loopback address (sshd on 127.0.0.1, as people try before a cluster): loopback is right there."""
    master_view = facts[master.name]["master_resolves"] if master.name in facts else None
    checks = []
    for host, f in facts.items():
        seen = f["master_resolves"]
        if isinstance(seen, str):
            problem = (f"the master address {master.address} {seen}",
                       f"use the master's IP address in the inventory, or fix DNS / /etc/hosts on {host}")
        elif is_loopback(seen[0]) and not one_machine:
            problem = (f"resolves the master address {master.address} to {seen[0]} (loopback)",
                       f"use the master's IP address in the inventory, or drop that /etc/hosts line on {host}")
        elif isinstance(master_view, list) and master_view and seen[0] != master_view[0]:
            problem = (f"resolves {master.address} to {seen[0]} but {master.name} resolves it to {master_view[0]}",
                       "make DNS / /etc/hosts agree on every host, or use an IP address")
        else:
            checks.append(Check(host, "resolve", Status.PASS, f"master {master.address} -> {seen[0]}", None,
                                {"master": seen}))
            continue
        checks.append(Check(host, "resolve", Status.FAIL, *problem, {"master": seen}))
    return checks
