"""Spec -> a self-contained Slurm batch script (`harness render JOB --target slurm`). Pure.

The script runs under plain `sbatch`, without the harness on the login node: one torchrun per node
through `srun --ntasks-per-node=1`, the node rank from SLURM_NODEID, the master the first node of the
allocation resolved to its IP inside the allocation, and the same torchrun flags and env contract as
every other backend (plan.torchrun_args, plan.node_env). Values only the allocation knows (node rank,
master address, job id, restart count) are sentinels here and shell variables in the script.
"""

from __future__ import annotations

import math
import re
import shlex
from decimal import Decimal

from harness import __version__
from harness.plan import LOG_LINE_PREFIX, TORCHRUN_MODULE, node_env, resolve_nproc, torchrun_args
from harness.spec import QUANTITY, JobSpec

_NODE, _MASTER, _JOB, _ATTEMPT = "\0node\0", "\0master\0", "\0job\0", "\0attempt\0"
_SHELL = {_NODE: '"$SLURM_NODEID"', _MASTER: '"$MASTER_ADDR"', _JOB: '"$SLURM_JOB_ID"',
          _ATTEMPT: '"${SLURM_RESTART_COUNT:-0}"'}
_PER_NODE = ("NODE_RANK", "PET_NODE_RANK")  # set in each task from SLURM_NODEID
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
            "E": Decimal(10**18)}


def _quantity(text: str) -> Decimal:
    """A Kubernetes quantity (the spec's resources) as a plain number."""
    match = QUANTITY.fullmatch(text)
    assert match is not None  # the spec validated it
    number, suffix = Decimal(match.group(1)), match.group(3) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * (Decimal(10) ** int(suffix[1:]) if suffix else 1)


def _megabytes(size: Decimal) -> str:
    """sbatch --mem: binary units, the largest that states the size exactly (at least 1M)."""
    mebibytes = max(1, math.ceil(size / 2**20))
    for unit, scale in (("T", 2**20), ("G", 2**10)):
        if mebibytes % scale == 0:
            return f"{mebibytes // scale}{unit}"
    return f"{mebibytes}M"


def _word(value: str) -> str:
    """One shell word; the sentinels inside become expansions of the allocation's variables."""
    parts = re.split(f"({'|'.join(map(re.escape, _SHELL))})", value)
    return "".join(_SHELL.get(part) or shlex.quote(part) for part in parts if part) or "''"


def sbatch_options(spec: JobSpec) -> list[str]:
    """The #SBATCH lines: the allocation from nnodes and resources, then the job's slurm: section."""
    options = [f"--job-name={spec.name}", f"--nodes={spec.nnodes}", "--ntasks-per-node=1"]
    if spec.resources.cpu is not None:
        options.append(f"--cpus-per-task={max(1, math.ceil(_quantity(spec.resources.cpu)))}")
    if spec.resources.memory is not None:
        options.append(f"--mem={_megabytes(_quantity(spec.resources.memory))}")
    if spec.resources.gpus:
        options.append(f"--gpus-per-node={spec.resources.gpus}")
    slurm = spec.slurm
    for key in ("partition", "account", "qos", "time", "constraint"):
        if (value := getattr(slurm, key)) is not None:
            options.append(f"--{key}={value}")
    if slurm.workdir is not None:
        options.append(f"--chdir={slurm.workdir}")
    return options + list(slurm.extra)


def batch_script(spec: JobSpec, source: str) -> str:
    """The whole batch script, readable and editable by hand."""
    nproc = resolve_nproc(spec, [spec.resources.gpus] * spec.nnodes, ["each node (resources.gpus)"] * spec.nnodes)
    run_id = f"{spec.name}-{_JOB}"
    env = node_env(spec, run_id=run_id, master_addr=_MASTER, nproc=nproc, node_rank=_NODE, attempt=_ATTEMPT)
    args = torchrun_args(spec, run_id=run_id, master_addr=_MASTER, nproc=nproc, node_rank=_NODE)
    prefix = f"--log-line-prefix-template={LOG_LINE_PREFIX}"
    args = [f"--log-line-prefix-template=[node{_NODE}] {LOG_LINE_PREFIX}" if a == prefix else a for a in args]
    target = len(args) - len(spec.entrypoint.args) - (2 if spec.entrypoint.module else 1)  # where the entrypoint starts
    launcher = [spec.slurm.python, "-m", TORCHRUN_MODULE, *args[:target]]
    exports = [f"export {k}={_word(v)}" for k, v in env.items() if k not in _PER_NODE and k != "MASTER_ADDR"]
    lines = [
        "#!/bin/bash",
        f"# Rendered by `harness render {source} --target slurm` (harness {__version__}). Runs with plain",
        "# sbatch; edit freely. One torchrun per node, node rank = SLURM_NODEID, master = the first node.",
        *(f"#SBATCH {option}" for option in sbatch_options(spec)),
        "set -uo pipefail",
        "",
        "# The master: the allocation's first node, as the IP the other nodes reach it at.",
        'master_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_ADDR=$(getent ahostsv4 \"$master_host\" | awk 'NR == 1 { print $1 }')",
        'case "$MASTER_ADDR" in',
        '  "" | 127.*) echo "harness: $master_host resolves to \'$MASTER_ADDR\', not an address the other nodes'
        ' reach; fix its /etc/hosts or DNS entry" >&2; exit 2 ;;',
        "esac",
        "export MASTER_ADDR",
        *exports,
        "",
        "# What every node runs; $SLURM_NODEID is each task's own.",
        "read -r -d '' NODE_COMMAND <<'END_OF_NODE_COMMAND'",
        'export NODE_RANK="$SLURM_NODEID" PET_NODE_RANK="$SLURM_NODEID"',
        f"exec {' '.join(_word(word) for word in launcher)} \\",
        f"  {' '.join(_word(word) for word in args[target:])}",
        "END_OF_NODE_COMMAND",
        "",
        "# --kill-on-bad-exit: a node that fails ends the others (Slurm's default leaves them running).",
        f'srun --nodes={spec.nnodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$NODE_COMMAND"',
        "status=$?",
        'if [ "$status" -ne 0 ]; then',
        '  echo "harness: job $SLURM_JOB_ID failed: srun exited $status; the failed node\'s torchrun report'
        ' above names the rank" >&2',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"
