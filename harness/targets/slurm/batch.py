"""Spec -> the Slurm batch scripts. Pure.

`harness render JOB --target slurm` prints a self-contained script (batch_script) for plain `sbatch`,
without the harness on the cluster: one torchrun per node through `srun --ntasks-per-node=1`, the node
rank from SLURM_NODEID, the master the first node of the allocation resolved to its IP inside the
allocation, and the same torchrun flags and env contract as every other backend (plan.torchrun_args,
plan.node_env). Values only the allocation knows (node rank, master address, job id, restart count) are
sentinels here and shell variables in the script.

`harness launch JOB --target slurm` submits controller_script instead: its batch step runs the harness's
own controller in the allocation (`harness batch-step`), which drives every node as an srun step (srun.py).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Iterable, Sequence
from decimal import Decimal
from pathlib import Path

from harness import __version__
from harness.node import store_port
from harness.plan.planner import (
    LOG_LINE_PREFIX,
    LOG_LINE_PREFIX_ENV,
    TORCHRUN_MODULE,
    entrypoint_args,
    node_env,
    resolve_nproc,
    torchrun_flags,
)
from harness.plan.setup_script import setup_script, with_setup
from harness.spec.job import SLURM_OPTIONS, JobSpec, quantity_value
from harness.spec.secrets import env_apart

_NODE, _MASTER, _JOB, _ATTEMPT, _PORT = "\0node\0", "\0master\0", "\0job\0", "\0attempt\0", "\0port\0"
_SHELL = {_NODE: '"$SLURM_NODEID"', _MASTER: '"$MASTER_ADDR"', _JOB: '"$SLURM_JOB_ID"', _PORT: '"$MASTER_PORT"',
          _ATTEMPT: '"${SLURM_RESTART_COUNT:-0}"'}


def _number(quantity: str) -> Decimal:
    """A quantity of the spec's resources (validated there) as a plain number."""
    number = quantity_value(quantity)
    assert number is not None
    return number


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


def _here_document(variable: str, lines: list[str]) -> list[str]:
    """`read` of lines into variable, as a quoted here-document (nothing in it expanded) whose terminator is a line
    none of them is: a value that is the usual terminator cannot end it early and run what follows."""
    end = "END_OF_NODE_COMMAND"
    while any(line == end for text in lines for line in text.split("\n")):
        end += "_"
    return [f"read -r -d '' {variable} <<'{end}'", *lines, end]


def _secret_exports(spec: JobSpec) -> list[str]:
    """Each secret set in the batch script's environment from where the spec says, its value in no file: the
    environment sbatch ran in (which sbatch passes on) or the launching user's file, read where the script runs."""
    lines = []
    for name, secret in spec.secrets.items():
        if secret.file is not None:
            path = secret.file
            word = "~/" + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)
            lines.append(f"{name}=$(cat -- {word}) || exit 1")
        else:
            lines.append(f'{name}="${{{secret.env or name}:?is not set in the environment sbatch ran in '
                         f'(secrets.{name}): export it before sbatch}}"')
        lines.append(f"export {name}")
    return ["", "# secrets: the values are never in this script", *lines] if lines else []


def _secret_looking_exports(names: Iterable[str]) -> list[str]:
    """Each env name that looks secret (spec/secrets.py) taken from the environment sbatch ran in, as a secret from
    the environment is: the script holds no value of it."""
    lines = [line for name in names for line in (
        f'{name}="${{{name}:?is not set in the environment sbatch ran in (env.{name} looks like a secret, so this '
        f'script holds no value of it): export it before sbatch}}"', f"export {name}")]
    return ["", "# env values that look like secrets: never in this script", *lines] if lines else []


BATCH_LOG = "slurm-%j.log"  # the batch step's own output in a launch's run directory (%j: the job id)


def batch_log(log_dir: Path, job_id: int) -> Path:
    return log_dir / BATCH_LOG.replace("%j", str(job_id))


def sbatch_options(spec: JobSpec, log_dir: Path | None = None, nodes: int | None = None,
                   exclude: Sequence[str] = ()) -> list[str]:
    """The #SBATCH lines: the allocation from nnodes (or nodes) and resources, restarts as requeues,
    the time-limit warning, then the job's slurm: section; exclude: nodes kept out (with the job's own
    --exclude, if its slurm.extra has one)."""
    options = [f"--job-name={spec.name}", f"--nodes={nodes or spec.nnodes}", "--ntasks-per-node=1"]
    if spec.resources.cpu is not None:
        options.append(f"--cpus-per-task={max(1, math.ceil(_number(spec.resources.cpu)))}")
    if spec.resources.memory is not None:
        options.append(f"--mem={_megabytes(_number(spec.resources.memory))}")
    if spec.resources.gpus:
        options.append(f"--gpus-per-node={spec.resources.gpus}")
    slurm = spec.slurm
    for key in SLURM_OPTIONS:
        if (value := getattr(slurm, key)) is not None:
            options.append(f"--{key}={value}")
    if slurm.workdir is not None:
        options.append(f"--chdir={slurm.workdir}")
    # Without restarts a lost node ends the job; Slurm's default would requeue it and leave it pending.
    options.append("--requeue" if spec.restarts.max else "--no-requeue")
    options.append("--open-mode=append")  # a requeued job adds to its output file instead of replacing it
    if slurm.warning:
        options.append(f"--signal=B:USR1@{slurm.warning}")
    if log_dir is not None:
        options.append(f"--output={log_dir}/{BATCH_LOG}")
    extra = list(slurm.extra)
    if exclude:
        own = [option for option in extra if option.startswith("--exclude=")]
        nodes_out = [*(name for option in own for name in option.split("=", 1)[1].split(",")), *exclude]
        extra = [option for option in extra if option not in own] + [f"--exclude={','.join(dict.fromkeys(nodes_out))}"]
    return options + extra


def _free_port(python: str) -> list[str]:
    """master_port: auto, picked where the batch script runs: the allocation's first node, the master."""
    source = Path(store_port.__file__).read_text(encoding="utf-8")
    return ["", "# master_port: auto: a port that nobody holds on the master (this node), picked now.",
            f"MASTER_PORT=$({_word(python)} - <<'END_OF_FREEPORT'", source.rstrip("\n"), "END_OF_FREEPORT", ")",
            'export MASTER_PORT PET_MASTER_PORT="$MASTER_PORT"']


def batch_script(spec: JobSpec, source: str, command: str | None = None) -> str:
    """The whole self-contained batch script, readable and editable by hand; the run id is the job name
    and the Slurm job id. source: the spec file; command: the command that renders it, where the spec came
    from flags (a script launch) instead."""
    nproc = resolve_nproc(spec, [spec.resources.gpus] * spec.nnodes, ["each node (resources.gpus)"] * spec.nnodes)
    run_id = f"{spec.name}-{_JOB}"
    port = _PORT if spec.master_port == "auto" else None
    env = node_env(spec, run_id=run_id, master_addr=_MASTER, nproc=nproc, node_rank=_NODE, attempt=_ATTEMPT,
                   interface=spec.network.interface, master_port=port)
    env[LOG_LINE_PREFIX_ENV] = f"[node{_NODE}] {LOG_LINE_PREFIX}"  # one output file for every node
    flags = torchrun_flags(spec, run_id=run_id, master_addr=_MASTER, nproc=nproc, node_rank=_NODE, master_port=port)
    launcher = with_setup([spec.slurm.python, "-m", TORCHRUN_MODULE, *flags], setup_script(spec.setup, spec.data_paths))
    per_node = {k: v for k, v in env.items() if _NODE in v}  # set in each task from SLURM_NODEID
    secret_looking = env_apart(spec.env)[1]
    exports = [f"export {k}={_word(v)}" for k, v in env.items() if k not in per_node and v != _PORT
               and k != "MASTER_ADDR" and k not in secret_looking]
    most = spec.restarts.max
    srun = f"srun --nodes={spec.nnodes} --ntasks-per-node=1 --kill-on-bad-exit=1"
    lines = [
        "#!/bin/bash",
        f"# Rendered by `{command or f'harness render {source} --target slurm'}` (harness {__version__}). Runs with "
        "plain",
        "# sbatch; edit freely. One torchrun per node, node rank = SLURM_NODEID, master = the first node.",
        *(f"#SBATCH {option}" for option in sbatch_options(spec)),
        "set -uo pipefail",
        "",
        "# Each requeue (time limit, preemption, `scontrol requeue`) is a restart: at most restarts.max.",
        "restarts=${SLURM_RESTART_COUNT:-0}",
        f'if [ "$restarts" -gt {most} ]; then',
        f'  echo "harness: job $SLURM_JOB_ID was requeued $restarts times, more than restarts.max ({most});'
        ' not starting again" >&2',
        "  exit 1",
        "fi",
        "",
        "# The master: the allocation's first node, as the IP the other nodes reach it at.",
        'master_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_ADDR=$(getent ahostsv4 \"$master_host\" | awk 'NR == 1 { print $1 }')",
        'case "$MASTER_ADDR" in',
        '  "" | 127.*) echo "harness: $master_host resolves to \'$MASTER_ADDR\', not an address the other nodes'
        ' reach; fix its /etc/hosts or DNS entry" >&2; exit 2 ;;',
        "esac",
        "export MASTER_ADDR",
        *(_free_port(spec.slurm.python) if port else []),
        *exports,
        *_secret_looking_exports(secret_looking),
        *_secret_exports(spec),
        "",
        "# What every node runs; $SLURM_NODEID is each task's own. torchrun would die of the time-limit",
        "# warning (SIGUSR1): it ignores it, and the training processes catch it themselves.",
        *_here_document("NODE_COMMAND", [
            f"export {' '.join(f'{k}={_word(v)}' for k, v in per_node.items())}",
            "trap '' USR1",
            f"exec {' '.join(_word(word) for word in launcher)} \\",
            f"  {' '.join(_word(word) for word in entrypoint_args(spec))}",
        ]),
        "",
        *_warning_handler(spec),
        "# --kill-on-bad-exit: a node that fails ends the others (Slurm's default leaves them running).",
        *(_srun_warned(spec, f'{srun} bash -c "$NODE_COMMAND"') if spec.slurm.warning else
          [f'{srun} bash -c "$NODE_COMMAND"', "status=$?"]),
        *(_requeue_on_warning(most) if spec.slurm.warning else []),
        'if [ "$status" -ne 0 ]; then',
        '  echo "harness: job $SLURM_JOB_ID failed: srun exited $status; the failed node\'s torchrun report'
        ' above names the rank" >&2',
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _warning_handler(spec: JobSpec) -> list[str]:
    """Slurm warns this script (SIGUSR1, `slurm.warning` s before the time limit): the training processes
    get the signal, checkpoint and exit; a step that has not ended after half the warning time is ended."""
    warning = spec.slurm.warning
    if not warning:
        return []
    return [
        f"# The time-limit warning: Slurm sends SIGUSR1 to this script {warning} s before the limit.",
        'warned=0 srun_pid="" timer_pid=""',
        "on_warning() {",
        "  warned=1",
        f'  echo "harness: job $SLURM_JOB_ID: time limit in {warning} s: SIGUSR1 to the training processes'
        ' (checkpoint and exit), then a requeue" >&2',
        '  scancel --signal=USR1 "$SLURM_JOB_ID"  # every step\'s processes, not this script',
        f"  sleep {max(1, warning // 2)} & timer_pid=$!",
        "}",
        "trap on_warning USR1",
        "",
    ]


def _srun_warned(spec: JobSpec, srun: str) -> list[str]:
    """srun in the background, so that the warning's trap runs at once; the step is ended when the timer
    the warning started runs out. Every process this script starts ends with it (no orphan is left)."""
    return [
        f"{srun} &",
        "srun_pid=$!",
        'wait "$srun_pid"; status=$?',
        'while kill -0 "$srun_pid" 2>/dev/null; do  # the warning ended the wait',
        '  if [ -n "$timer_pid" ] && ! kill -0 "$timer_pid" 2>/dev/null; then',
        f'    echo "harness: the step did not end within {max(1, spec.slurm.warning // 2)} s of the warning: ending'
        ' it" >&2',
        '    kill -TERM "$srun_pid"; timer_pid=""',
        "  fi",
        "  wait -n; status=$?",
        '  [ "$status" -ne 127 ] || break',
        "done",
        '[ -z "$timer_pid" ] || kill "$timer_pid" 2>/dev/null',
    ]


def _requeue_on_warning(most: int) -> list[str]:
    requeue = [
        f'  if [ "$restarts" -lt {most} ]; then',
        f'    echo "harness: requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of {most}); it resumes from'
        ' the newest checkpoint" >&2',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "  fi",
    ]
    return [
        'if [ "$warned" -eq 1 ]; then',
        *(requeue if most else []),
        f'  echo "harness: job $SLURM_JOB_ID reached its time limit with no requeue left (restarts.max: {most})" >&2',
        "  exit 1",
        "fi",
    ]


def controller_script(spec: JobSpec, source: str, run_path: Path, python: str, exclude: Sequence[str] = ()) -> str:
    """The batch script of `harness launch --target slurm`: its batch step runs the harness's controller
    (`python -m harness.cli batch-step`, with the user's python, which has the harness) on the
    allocation's first node; it drives nnodes of the allocation's nodes as srun steps and keeps the rest
    (slurm.spares) to replace a lost one. The script itself only checks that the run directory is there,
    passes Slurm's time-limit warning on (SIGUSR1 to every step's processes, then SIGTERM to the
    controller, which requeues the job when a restart is left) and passes a stop on (SIGTERM). exclude: the
    nodes kept out after they failed (record/hosts_out.py)."""
    run = _word(str(run_path))
    warning = spec.slurm.warning
    return "\n".join([
        "#!/bin/bash",
        f"# Submitted by `harness launch {source} --target slurm` (harness {__version__}): the harness's controller",
        "# runs in this batch step and drives every node as an srun step (stall detection, stacks, failure classes,",
        "# restarts and spares within the allocation). `harness render --target slurm` prints a script without it.",
        *(f"#SBATCH {option}" for option in sbatch_options(spec, run_path, nodes=spec.nnodes + spec.slurm.spares,
                                                            exclude=exclude)),
        "set -u",
        f"run={run}",
        'if [ ! -r "$run/job.json" ]; then',
        '  echo "harness: the run directory $run is not visible on $(hostname): launch with a --runs-dir on a file'
        ' system that this machine and the nodes share" >&2',
        "  exit 1",
        "fi",
        f"if ! [ -x {_word(python)} ]; then",
        f"  echo \"harness: {python}, the Python of the harness that submitted the job, is not on $(hostname):"
        " install the harness where the nodes see it (a shared file system), or submit the script of"
        " \\`harness render --target slurm\\` instead\" >&2",
        "  exit 1",
        "fi",
        'controller=""',
        'stop_controller() { [ -z "$controller" ] || kill -TERM "$controller" 2>/dev/null; }',
        *([f"# Slurm's warning, {warning} s before the time limit: the training processes checkpoint (SIGUSR1 to",
           "# every step's processes; the node agents and torchrun ignore it), then the controller ends the attempt",
           "# and requeues the job.",
           "on_warning() {",
           '  touch "$run/time-limit"',
           '  scancel --signal=USR1 "$SLURM_JOB_ID"',
           f"  (sleep {max(1, warning // 2)}; stop_controller) &",
           "}",
           "trap on_warning USR1"] if warning else []),
        "trap stop_controller TERM INT",
        f'{_word(python)} -m harness.cli batch-step "$run" &',
        "controller=$!",
        'while wait "$controller"; status=$?; kill -0 "$controller" 2>/dev/null; do :; done  # a trap ended the wait',
        'exit "$status"',
    ]) + "\n"
