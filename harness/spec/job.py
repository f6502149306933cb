"""The job spec (jobs/*.yaml): one validated description of a distributed torchrun job."""

from __future__ import annotations

import ipaddress
import json
import math
import os
import posixpath
import re
import shutil
from collections.abc import Callable
from decimal import Decimal, DecimalException
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from harness.errors import short_repr
from harness.spec.progress import DEFAULT_PROGRESS, RESUME_LINE, LinePatterns
from harness.spec.validation import StrictModel, error_at, validate
from harness.spec.yamlsource import YamlInt, as_written, load_document, source_text

# Patterns are used with fullmatch: `$` would also match before a trailing newline ("x\n").
DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
# Kubernetes resource.Quantity: a decimal number with an optional binary/decimal suffix or exponent.
QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?", re.ASCII)
# What a quantity's suffix multiplies by (an exponent, 1e3, is Decimal's own notation).
_QUANTITY_SCALE = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
                   "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"), "T": Decimal("1e12"),
                   "P": Decimal("1e15"), "E": Decimal("1e18"), "Ki": Decimal(2**10), "Mi": Decimal(2**20),
                   "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50), "Ei": Decimal(2**60)}
# Docker image reference: [registry[:port]/]path[:tag][@digest], lower-case path components.
IMAGE_REF = re.compile(
    r"(?:[A-Za-z0-9.-]+(?::\d+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@sha256:[a-f0-9]{64})?",
    re.ASCII,
)

# The rendezvous contract belongs to the harness; a user override would split the job's view of it.
RESERVED_ENV = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "NNODES",
     "NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"}
)
RESERVED_PREFIXES = ("PET_", "HARNESS_", "TORCHELASTIC_")
# The one name of HARNESS_ a spec may hold: a piece of a function launch's call, which its spec holds as secrets
# (harness/api/rank.py, CALL_VARIABLE; docs/python.md).
CALL_PIECE = re.compile("HARNESS_CALL_[0-9]+")
# A Linux interface name as getifaddrs reports it (IFNAMSIZ - 1 characters; no '/', no blanks).
INTERFACE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,14}", re.ASCII)


MAX_NNODES = 4096
MAX_NPROC = 1024
MAX_BACKOFF = 300.0  # seconds: the doubling backoff between attempts stops growing here


def exact_int(value: Any) -> Any:
    """A number written with a leading zero is refused: YAML 1.1 tools read 070000 as octal 28672."""
    if isinstance(value, YamlInt) and value.leading_zero:
        raise ValueError(f"{value.text} has a leading zero, which other YAML tools read as an octal number; "
                         f"write {int(value)} (or quote it if you mean the text)")
    return value


def _bounded_int(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"expected {what}, got {as_written(value)}")
    return int(exact_int(value))


def _positive_int(value: Any) -> int:
    return _bounded_int(value, 1, MAX_NNODES, f"an integer from 1 to {MAX_NNODES}")


def _standby(value: Any) -> float | None:
    """restarts.standby: seconds, or false for none."""
    if value is False or value is None:
        return None
    if value is True:
        raise ValueError("expected the seconds into an attempt at which its standbys start (60), or false for "
                         "none, got true")
    seconds = _seconds(value)
    if not 0 <= seconds <= 86400:
        raise ValueError(f"expected from 0 to 86400 seconds, or false for none, got {as_written(value)}")
    return seconds


def _nproc(value: Any) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    return _bounded_int(value, 1, MAX_NPROC, f"an integer from 1 to {MAX_NPROC}, or 'auto' (one process per GPU)")


def _master_port(value: Any) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    return _bounded_int(exact_int(value), 1024, 65535,
                        "a port from 1024 to 65535, or auto (a free port picked on the master host at launch)")


def quantity_value(text: str) -> Decimal | None:
    """The number a Kubernetes quantity stands for (500m: 0.5, 16Gi: 17179869184), as the targets render it
    (sbatch --mem, docker --shm-size); None when text is not one,
    or is too far from 1 for Decimal (1e99999999999999999999, a million digits then Ei): no bound is."""
    match = QUANTITY.fullmatch(text)
    if match is None:
        return None
    suffix = match.group(3) or ""
    try:
        return Decimal(match.group(1)) * _QUANTITY_SCALE[suffix] if suffix in _QUANTITY_SCALE else Decimal(text)
    except DecimalException:
        return None


def _quantity(low: str, high: str, unit: str, examples: str) -> Callable[[Any], str]:
    """A validator of Kubernetes quantities from low to high (both quantities): past high no node has that
    much, so a pod asking for it never schedules (and past 2^63 - 1 Kubernetes caps it without a word);
    below low nothing runs, or Kubernetes rounds it up."""
    least, most = quantity_value(low), quantity_value(high)
    assert least is not None and most is not None

    def check(value: Any) -> str:
        text = source_text(value)
        number = None if text is None else quantity_value(text)
        if text is None or number is None or not least <= number <= most:
            raise ValueError(f"expected a Kubernetes quantity from {low} to {high} {unit}, such as {examples}, "
                             f"got {as_written(value)}")
        return text

    return check


def _no_nul(text: str) -> str:
    if "\0" in text:
        raise ValueError("contains a NUL byte, which no command-line argument or environment value can hold")
    return text


def _argument(value: Any) -> str:
    """An argument reaches the script exactly as written: an unquoted 1.10 stays `1.10`, 0123 stays `0123`.
    Booleans and nulls have several spellings, so those must be quoted."""
    text = source_text(value)
    if text is None:
        written = json.dumps(value) if isinstance(value, (bool, type(None))) else short_repr(value)
        raise ValueError(f"expected a string or number, got {written}; quote it if you mean the text: '{written}'")
    return _no_nul(text)


def _env_value(value: Any) -> str:
    if not isinstance(value, str):
        written = json.dumps(value) if isinstance(value, (bool, type(None))) else as_written(value)
        raise ValueError(f"expected a string, got {written}; quote it if you mean the text: '{written}'")
    return _no_nul(value)


def _shipped_path(value: Any) -> str:
    """A path the renderer reads from where `harness render` runs and restores under the pods' code directory."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a relative path such as model.py or configs/, got {short_repr(value)}")
    _no_nul(value)
    if value.startswith("/") or ".." in value.split("/"):
        raise ValueError(f"{short_repr(value)} must be relative to the directory `harness render` runs in, "
                         f"without '..': the pods get it under the same relative path")
    return value


def _setup_command(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a shell command such as 'harness prepare --data-dir data/cifar10', "
                         f"got {short_repr(value)}")
    return _no_nul(value)


def _file_path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected the path of a file such as ~/.config/hf-token, got {short_repr(value)}")
    return _no_nul(value)


def _env_name(key: Any) -> str:
    if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
        raise ValueError(f"{short_repr(key)} is not a valid environment variable name")
    upper = key.upper()
    if CALL_PIECE.fullmatch(key):
        return key
    if upper in RESERVED_ENV or upper.startswith(RESERVED_PREFIXES):
        same = "is" if upper == key else f"differs only in case from {upper}, which is"
        raise ValueError(
            f"{key} {same} set by the harness/torchrun for every node and cannot be overridden; "
            f"use master_port, nnodes or nproc_per_node instead"
        )
    return key


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number of seconds, got {as_written(value)}")
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number of seconds, got {as_written(value)}")
    return float(value)


def _whole_seconds(value: Any) -> int:
    seconds = _seconds(value)
    if not seconds.is_integer():
        raise ValueError(f"expected whole seconds (torchrun's join timeout is an integer), got {as_written(value)}")
    return int(exact_int(value))


def _ip_address(value: Any) -> str:
    """An IP address to listen on, as ipaddress spells it."""
    try:
        return str(ipaddress.ip_address(value)) if isinstance(value, str) else _not_an_address(value)
    except ValueError:
        return _not_an_address(value)


def _not_an_address(value: Any) -> str:
    raise ValueError(f"expected an IP address of this machine (127.0.0.1, 0.0.0.0 for every interface, ::1), got "
                     f"{as_written(value)}")


PositiveInt = Annotated[int, PlainValidator(_positive_int)]
Count = Annotated[int, BeforeValidator(exact_int), Field(ge=0, le=MAX_NPROC)]
# No node has 16384 CPUs or a pebibyte of memory (the largest have about 2000 and tens of TiB).
Cpus = Annotated[str, PlainValidator(_quantity("1m", "16384", "CPUs", "4 or 500m"))]
MemorySize = Annotated[str, PlainValidator(_quantity("1Mi", "1Pi", "bytes", "16Gi or 512Mi"))]
VolumeSize = Annotated[str, PlainValidator(_quantity("1Mi", "1Ei", "bytes", "50Gi or 2Ti"))]
Argument = Annotated[str, PlainValidator(_argument)]
EnvName = Annotated[str, PlainValidator(_env_name)]
EnvValue = Annotated[str, PlainValidator(_env_value)]
SetupCommand = Annotated[str, PlainValidator(_setup_command)]
ShippedPath = Annotated[str, PlainValidator(_shipped_path)]
Seconds = Annotated[float, BeforeValidator(_seconds)]


LOCAL_RANK_ARG = re.compile(r"--?[A-Za-z][A-Za-z0-9_-]*", re.ASCII)


class Entrypoint(StrictModel):
    """What torchrun runs on every rank: a module (`python -m`) or a script path, plus its args.
    local_rank_arg: the option through which a script written for torch.distributed.launch takes its
    local rank (e.g. --local_rank); each worker gets `OPTION=N` before the args."""

    module: str | None = None
    script: str | None = None
    args: list[Argument] = Field(default_factory=list)
    local_rank_arg: str | None = None

    @field_validator("local_rank_arg")
    @classmethod
    def _option(cls, value: str | None) -> str | None:
        if value is not None and not LOCAL_RANK_ARG.fullmatch(value):
            raise ValueError(f"expected a command-line option such as --local_rank or --local-rank, "
                             f"got {short_repr(value)}")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> Entrypoint:
        if (self.module is None) == (self.script is None):
            raise ValueError("set exactly one of 'module' (e.g. harness.payload.train) or 'script' (e.g. train.py)")
        if self.module is not None and not MODULE.fullmatch(self.module):
            raise ValueError(f"module must be a dotted Python module name, got {short_repr(self.module)}")
        if self.script is not None:
            if not self.script.strip():
                raise ValueError("script must be a non-empty path")
            if self.script.startswith("-"):
                raise ValueError(f"script {short_repr(self.script)} starts with '-', which torchrun would take for "
                                 f"one of its own options; write ./{self.script}")
            _no_nul(self.script)
        return self


class Resources(StrictModel):
    """Per-node resources; the Kubernetes renderer and preflight use them.

    storage sizes the shared volume that holds data and checkpoints on Kubernetes.
    """

    gpus: Count = 0
    cpu: Cpus | None = None
    memory: MemorySize | None = None
    shm_size: MemorySize | None = None
    storage: VolumeSize = "50Gi"


class Timeouts(StrictModel):
    """Seconds. stop_grace is the SIGTERM-to-SIGKILL wait when a run is stopped."""

    rendezvous: Annotated[int, BeforeValidator(_whole_seconds), Field(gt=0, le=86400)] = 900
    stop_grace: Annotated[Seconds, Field(gt=0, le=4)] = 3
    connect: Annotated[Seconds, Field(gt=0, le=600)] = 10


class Supervision(StrictModel):
    """What a job does when its controller is gone (killed, its machine or its network lost): each node's agent
    holds its node, running, for grace seconds, for `harness attach RUN` (or the controller itself, once its
    link comes back) to take back; past grace it stops it. 0: every node stops at once, as its controller goes.
    300 by default: a controller restarted by hand, a login node's reboot, a Kubernetes pod rescheduled take a
    few minutes at most, and a job nobody takes back holds its machines no longer than that (docs/recovery.md)."""

    grace: Annotated[Seconds, Field(ge=0, le=86400)] = 300


def _removed_max_restarts(value: Any) -> None:
    raise ValueError(
        "max_restarts (torchrun's per-node restarts) is not used: with a static rendezvous it restarts one "
        "node's workers and leaves the other nodes waiting. Write `restarts: {max: N}` instead: the harness "
        "stops every node and restarts the whole job, which resumes from its newest checkpoint"
    )


FAILURE_KINDS = ("infra", "hang", "program")  # how an attempt can fail (control/recovery.py classes it)
RESTART_KINDS = (*FAILURE_KINDS, "slow")  # what restarts.on may name: slow, a restart the harness chooses


def _failure_kinds(value: Any) -> tuple[str, ...]:
    """One kind, `any` (every failure kind; slow is never implied), or a list of kinds: the set of kinds that are
    restarted."""
    expected = f"one of {', '.join(RESTART_KINDS)} or any, or a list of them, e.g. [infra, hang]"
    kinds = [value] if isinstance(value, str) else value
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"expected {expected}, got {as_written(value)}")
    if unknown := [k for k in kinds if k not in (*RESTART_KINDS, "any")]:
        raise ValueError(f"expected {expected}, got {short_repr(unknown[0])}")
    return tuple(k for k in RESTART_KINDS if k in kinds or ("any" in kinds and k in FAILURE_KINDS))


class Restarts(StrictModel):
    """Whole-job restarts by the harness: every node stops, then a new attempt starts (same run id,
    HARNESS_ATTEMPT + 1, a fresh rendezvous) after backoff x 2^(restarts so far) seconds, at most
    MAX_BACKOFF. on: the failure kinds that are restarted (normalised to a tuple of FAILURE_KINDS):
    infra, failures of the machines (a lost host or connection, a process killed by a signal, a
    rendezvous timeout); hang, a job that made no progress for health.stall seconds; program, a
    program that fails by itself; any, all three; slow (only when named): a rank that slowed the job for
    health.slow_for seconds, when a restart without its host costs less by the job's end (docs/health.md).
    min_nnodes: the fewest nodes the job may go on with
    when hosts are down and no spare is left (torchrun's --nnodes MIN:MAX); unset, nnodes: the run
    ends instead. cooldown: seconds a host that failed at the machine's level stays out of every run
    (record/hosts_out.py; 0: only out of its own run); max_out: how many of the inventory's hosts may be
    out at once (unset: a quarter of them, at least 1). standby: seconds into an attempt with a restart left
    (from its last rank joining; 60) after which the next attempt's torchrun and workers wait on every usable
    host (spares too) with their imports done, so that a restart starts warm (node/standby.py; simulated nodes,
    SSH hosts and pods, not in containers nor under Slurm); the first attempt's nodes start so while the job is
    checked; false: none, every attempt starts cold. A failure before then restarts as before; a short run never
    pays for them."""

    max: Annotated[int, BeforeValidator(exact_int), Field(ge=0, le=100)] = 0
    on: Annotated[tuple[str, ...], PlainValidator(_failure_kinds)] = ("infra",)
    backoff: Annotated[Seconds, Field(ge=0, le=MAX_BACKOFF)] = 5
    min_nnodes: Annotated[int, BeforeValidator(exact_int), Field(ge=1, le=MAX_NNODES)] | None = None
    cooldown: Annotated[Seconds, Field(ge=0, le=30 * 86400)] = 3600
    max_out: Annotated[int, BeforeValidator(exact_int), Field(ge=0, le=MAX_NNODES)] | None = None
    standby: Annotated[float | None, PlainValidator(_standby)] = 60.0

    def out_limit(self, hosts: int) -> int:
        """How many of an inventory's hosts may be kept out at once."""
        return self.max_out if self.max_out is not None else max(1, hosts // 4)


# A rank's line that says a checkpoint was saved and how long the save took (the payload's `checkpoint: 20 steps
# saved in 0.120 s`): those seconds are the run's `checkpoint` time, not its training (record/goodput.py). The word
# comes first and its start is looked behind for: a pattern that starts with a word lets re find it as fast as
# `in` does, where one that starts with \b is tried at every position of all a chatty job prints.
DEFAULT_CHECKPOINT = r"checkpoint(?<=\bcheckpoint)\b.*?\bsaved in (?P<seconds>\d+(?:\.\d+)?) ?s\b"


class Health(StrictModel):
    """What the harness watches while a job runs (harness.health, control/health_loop.py). stall: seconds a rank may
    make no progress (no CPU time used, in it or its children) before the job counts as hung: every rank's
    stack is captured, the job stopped and the attempt classed `hang`; 0 turns the watch off. slow: a
    rank that its peers wait for at least this percentage of the time, for a minute, is named as
    slow; 0 turns it off. slow_for: seconds a slowness must last before it is weighed against a restart
    without its host (restarts.on: slow acts on it). progress: the regular expression (or a list of them, the
    first that finds a line's)
    that finds a step number (a group named `step`) in a rank's lines, for the step and step rate `harness status`
    shows; with groups named `epoch` (from 1, or `epoch0` from 0) and `per_epoch` too, a step that starts again
    each epoch counts from the run's start; the run's steps, for its progress and time left, from a group named
    `total`, or `per_epoch` times `epochs` (without an epoch, `per_epoch` alone: `step 12/97`); groups named
    `loss` and `throughput` (items per second) are drawn by `harness report` and served as metrics. The default
    (spec/progress.py) reads the payload's lines, `step N[/T]` lines, PyTorch's examples, and Lightning's and
    Hugging Face's tqdm bars, each from the line's start; empty turns it off. checkpoint: the regular expression
    of a line that says a checkpoint was saved, with a group named `seconds` (how long the save took), for where
    the run's time went; empty turns it off. metrics_port:
    the port on which the controller serves the run's metrics to Prometheus while it runs (docs/metrics.md);
    None, the default: nothing listens. metrics_address: the address it listens on (an IP of the controller's
    machine, 0.0.0.0 for every interface); None: 127.0.0.1 (the machine's own Prometheus), in a Kubernetes
    controller pod its own address."""

    stall: Annotated[Seconds, Field(ge=0, le=86400)] = 300
    slow: Annotated[Seconds, Field(ge=0, le=100)] = 20
    slow_for: Annotated[Seconds, Field(ge=1, le=86400)] = 60
    progress: str | list[str] = Field(default_factory=lambda: list(DEFAULT_PROGRESS))
    checkpoint: str = DEFAULT_CHECKPOINT
    metrics_port: Annotated[int, BeforeValidator(exact_int), Field(ge=1, le=65535)] | None = None
    metrics_address: Annotated[str, PlainValidator(_ip_address)] | None = None

    @field_validator("progress", "checkpoint")
    @classmethod
    def _pattern(cls, value: str | list[str], info: ValidationInfo) -> str | list[str]:
        group, example = ("step", "step (?P<step>\\d+)") if info.field_name == "progress" else \
            ("seconds", "saved in (?P<seconds>[\\d.]+) s")
        for text in [value] if isinstance(value, str) else value:
            if not text:
                continue
            try:
                pattern = re.compile(text)
            except re.error as exc:
                raise ValueError(f"expected a regular expression, got {short_repr(text)}: {exc}") from None
            if group not in pattern.groupindex:
                raise ValueError(f"expected a group named {group} in {short_repr(text)}, e.g. '{example}'")
        return value

    @property
    def progress_pattern(self) -> LinePatterns | None:
        """The job's progress lines, and with the default, its resume lines (where an attempt's count starts)."""
        patterns = [self.progress] if isinstance(self.progress, str) else self.progress
        if not any(patterns):
            return None
        return LinePatterns([pattern for pattern in patterns if pattern],
                            RESUME_LINE if patterns == list(DEFAULT_PROGRESS) else None)

    @property
    def checkpoint_pattern(self) -> re.Pattern[str] | None:
        return re.compile(self.checkpoint) if self.checkpoint else None

    @property
    def watched(self) -> bool:
        """Whether the agents sample the ranks at all."""
        return self.stall > 0 or self.slow > 0

    @property
    def sample_seconds(self) -> float:
        """How often the node agents sample their ranks: a twentieth of stall, from 1 to 5 s, so that a hang is
        seen within a few samples of the stall (harness.health.judge's rules count on it); every 5 s for slow
        ranks alone; 0 when neither is watched. A job of more than 500 nodes is sampled less often: every nnodes / 500
        s at least, so that its controller takes at most 500 samples a second (harness.node.protocol.paced)."""
        if not self.watched:
            return 0.0
        return min(5.0, max(1.0, self.stall / 20)) if self.stall > 0 else 5.0


SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]+", re.ASCII)
# Slurm's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}", re.ASCII)
SBATCH_OPTION = re.compile(r"--[a-z][a-z0-9-]*(=[^\n\r\0]*)?", re.ASCII)
# sbatch options the harness writes itself from the rest of the spec: one source of truth.
SBATCH_OWNED = ("--nodes", "--ntasks", "--ntasks-per-node", "--job-name", "--gpus-per-node", "--cpus-per-task",
                "--mem", "--partition", "--account", "--time", "--qos", "--constraint", "--chdir", "--output",
                "--error", "--signal", "--requeue", "--no-requeue", "--open-mode")


def _slurm_name(value: Any) -> str:
    if not isinstance(value, str) or not SLURM_NAME.fullmatch(value):
        raise ValueError(f"expected a Slurm name (letters, digits, '_', '.', '+', '-'), got {short_repr(value)}")
    return value


def _slurm_time(value: Any) -> str:
    text = source_text(value)
    if text is None or isinstance(value, bool) or not SLURM_TIME.fullmatch(text):
        raise ValueError(f"expected a Slurm time limit such as 90 (minutes), 02:00:00 or 1-12:00:00, quoted, "
                         f"got {short_repr(value)}")
    return text


def _sbatch_line(value: Any) -> str:
    if not isinstance(value, str) or not SBATCH_OPTION.fullmatch(value):
        raise ValueError(f"expected one sbatch option such as --exclusive or --mail-type=END, got {short_repr(value)}")
    name = value.split("=", 1)[0]
    if name in SBATCH_OWNED:
        raise ValueError(f"{name} is written by the harness from the spec (nnodes, resources, name or a slurm: "
                         f"key); set it there instead")
    return value


SlurmName = Annotated[str, PlainValidator(_slurm_name)]


# The slurm: keys that are sbatch options of the same name, and `harness launch` flags that override them.
SLURM_OPTIONS = ("partition", "account", "qos", "time", "constraint")


class Slurm(StrictModel):
    """What the job asks of Slurm (`--target slurm`); `harness launch` flags override these.
    python: the interpreter with torch on the compute nodes; workdir: where the job runs there
    (sbatch --chdir; default: where it was submitted); warning: seconds before the time limit at which
    the training processes get SIGUSR1 (checkpoint now) and the job requeues itself, 0 for none;
    spares: nodes asked for beyond nnodes, which take the place of a lost node within the allocation;
    extra: further `#SBATCH` options."""

    partition: SlurmName | None = None
    account: SlurmName | None = None
    qos: SlurmName | None = None
    time: Annotated[str, PlainValidator(_slurm_time)] | None = None
    constraint: Annotated[str, Field(min_length=1, pattern=r"^[^\s\x00]+$")] | None = None
    python: Annotated[str, Field(min_length=1, pattern=r"^[^\s\x00]+$")] = "python3"
    workdir: Annotated[str, Field(min_length=1, pattern=r"^[^\n\x00]+$")] | None = None
    warning: Annotated[int, Field(ge=0, le=3600)] = 120
    spares: Annotated[int, Field(ge=0, le=1024)] = 0
    extra: list[Annotated[str, PlainValidator(_sbatch_line)]] = Field(default_factory=list)


def _image_reference(value: str | None) -> str | None:
    if value is not None and not IMAGE_REF.fullmatch(value):
        raise ValueError(f"expected an image reference such as registry/name:tag, got {short_repr(value)}")
    return value


AccessMode = Literal["ReadWriteMany", "ReadWriteOnce"]
ACCESS_MODES: tuple[AccessMode, ...] = ("ReadWriteMany", "ReadWriteOnce")


def _access_mode(value: Any) -> AccessMode:
    """k8s.access_mode. ReadWriteOncePod is refused: it lets a single pod mount the volume, and a job has more
    than one (supervised: the controller and its workers)."""
    if value in ACCESS_MODES:
        return value
    why = "; ReadWriteOncePod lets a single pod mount the volume, and every pod of the job mounts it" \
        if value == "ReadWriteOncePod" else ""
    raise ValueError(f"expected ReadWriteMany (pods on any nodes share the volume: NFS, EFS, CephFS, ...) or "
                     f"ReadWriteOnce (one node mounts the volume, and every pod of the job runs on that node){why}, "
                     f"got {short_repr(value)}")


def dns_subdomain(value: str) -> bool:
    """Whether value is a DNS-1123 subdomain, as Kubernetes names most objects: labels joined by '.'."""
    return len(value) <= 253 and all(DNS1123_LABEL.fullmatch(part) for part in value.split("."))


def _storage_class(value: Any) -> str:
    """k8s.storage_class: a StorageClass's name, or "" for none (the claim binds a PersistentVolume made by hand)."""
    if not isinstance(value, str) or (value and not dns_subdomain(value)):
        raise ValueError(f"expected the name of a StorageClass (a DNS-1123 subdomain such as efs-sc; `kubectl get "
                         f"storageclass` lists them), or \"\" for none, got {short_repr(value)}")
    return value


def _namespace(value: Any) -> str:
    """k8s.namespace: a namespace's name is a DNS-1123 label."""
    if not isinstance(value, str) or len(value) > 63 or not DNS1123_LABEL.fullmatch(value):
        raise ValueError(f"expected the name of a Kubernetes namespace (a DNS-1123 label such as ml-jobs: lower-case "
                         f"letters, digits and '-', at most 63 characters), got {short_repr(value)}")
    return value


class ControllerRequests(StrictModel):
    """What the scheduler sets aside for the controller pod (and a ResourceQuota's requests.* count): little, as
    it mostly waits on its pods' streams."""

    cpu: Cpus | None = "250m"
    memory: MemorySize | None = "512Mi"


class ControllerLimits(StrictModel):
    """The most the controller pod may use (and a ResourceQuota's limits.* count): past memory it is OOM-killed."""

    cpu: Cpus | None = "1"
    memory: MemorySize | None = "1Gi"


class ControllerResources(StrictModel):
    """The controller pod's requests and limits: a namespace whose ResourceQuota covers CPU or memory admits only
    pods that give them. A key left out keeps its default; null leaves it out of the pod."""

    requests: ControllerRequests = Field(default_factory=ControllerRequests)
    limits: ControllerLimits = Field(default_factory=ControllerLimits)

    @model_validator(mode="after")
    def _requests_within_limits(self) -> ControllerResources:
        for key in ("cpu", "memory"):
            request, limit = getattr(self.requests, key), getattr(self.limits, key)
            if request is None or limit is None:
                continue  # Kubernetes takes the limit for a request left out; no limit bounds a request
            low, high = quantity_value(request), quantity_value(limit)
            if low is not None and high is not None and low > high:
                raise error_at("ControllerResources", ("requests", key), request,
                               f"expected at most limits.{key} ({limit}): Kubernetes refuses a pod that requests "
                               f"more than its limit, got {request}")
        return self


class Kubernetes(StrictModel):
    """How `harness render --target k8s` runs the job. supervised: the harness's controller runs in a pod of
    its own beside the worker pods and supervises them as it does SSH hosts (false: the pods run bare
    torchrun, for clusters that cannot run the project's image); controller_image: that pod's image, the
    project's (docker/; default: the job's `image`); controller_resources: that pod's requests and limits;
    spares: worker pods beyond nnodes, waiting to take a lost one's place; rejoin: seconds a restart waits for
    pods Kubernetes recreates before it goes on without them; port: where the controller listens for its pods;
    metrics_from: the labels of the pods in the job's namespace that may scrape the controller's metrics
    (health.metrics_port), which the NetworkPolicy opens to them alone (unset: to nobody). storage_class: the
    StorageClass of the job's volume (unset: the cluster's default class); access_mode: how its pods mount it,
    ReadWriteMany (from any node) or ReadWriteOnce (from one node, where every pod of the job is then put).
    namespace: the namespace every object of the render names (unset: none, so they go where `kubectl apply -n`
    or the context's namespace says)."""

    supervised: bool = True
    controller_image: str | None = None
    controller_resources: ControllerResources = Field(default_factory=ControllerResources)
    spares: Annotated[int, Field(ge=0, le=1024)] = 0
    rejoin: Annotated[float, Field(ge=0, le=3600)] = 120
    port: Annotated[int, Field(ge=1, le=65535)] = 29400
    metrics_from: dict[str, str] | None = None
    storage_class: Annotated[str, PlainValidator(_storage_class)] | None = None
    access_mode: Annotated[AccessMode, PlainValidator(_access_mode)] = "ReadWriteMany"
    namespace: Annotated[str, PlainValidator(_namespace)] | None = None

    @field_validator("controller_image")
    @classmethod
    def _image_ref(cls, value: str | None) -> str | None:
        return _image_reference(value)


SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}", re.ASCII)  # a key of a Kubernetes Secret's data


def _secret_key(value: Any) -> str:
    if not isinstance(value, str) or not SECRET_KEY.fullmatch(value):
        raise ValueError(f"expected a key of a Kubernetes Secret (letters, digits, '-', '_' or '.'), got "
                         f"{short_repr(value)}")
    return value


def _secret_name(value: Any) -> str:
    if not isinstance(value, str) or not dns_subdomain(value):
        raise ValueError(f"expected the name of a Kubernetes Secret (a DNS-1123 subdomain such as hf-token), got "
                         f"{short_repr(value)}")
    return value


class SecretKey(StrictModel):
    """A value in a Kubernetes Secret of the job's namespace (`kubectl create secret generic NAME
    --from-literal=KEY=...`)."""

    secret: Annotated[str, PlainValidator(_secret_name)]
    key: Annotated[str, PlainValidator(_secret_key)]


class Secret(StrictModel):
    """Where one secret environment value comes from (harness/spec/secrets.py); it is never written into a
    file, manifest or command line the harness makes. env: a variable of the environment `harness launch`
    runs in (default: the secret's own name); file: a file of the launching user whose contents (less one
    trailing newline) are the value; k8s: the Secret the pods take it from (default: Secret <job>-secrets,
    key the secret's name)."""

    env: EnvName | None = None
    file: Annotated[str, PlainValidator(_file_path)] | None = None
    k8s: SecretKey | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Secret:
        if self.env is not None and self.file is not None:
            raise error_at("Secret", ("file",), self.file, "expected env or file, not both: the value comes from "
                           "one of them")
        return self


def _secret(value: Any) -> Any:
    """`NAME:` alone (null) takes every default: the launching environment's NAME, Secret <job>-secrets."""
    return {} if value is None else value


def interface_name(value: Any) -> str:
    if not isinstance(value, str) or not INTERFACE_NAME.fullmatch(value):
        raise ValueError(f"expected a network interface name such as eth1 or ib0 (at most 15 letters, digits, "
                         f"'_', '.', ':' or '-'), got {short_repr(value)}")
    return value


InterfaceName = Annotated[str, PlainValidator(interface_name)]


class Network(StrictModel):
    """interface: the one network interface gloo and NCCL use on every host (GLOO_SOCKET_IFNAME,
    NCCL_SOCKET_IFNAME); a host's `interface:` in the inventory overrides it. Unset, the harness pins
    the interface that preflight finds routing to the peers."""

    interface: InterfaceName | None = None


def _node_workdir(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or value.startswith("/"):
        raise ValueError(f"expected a relative directory such as nodes/node{{node_rank}}, got {short_repr(value)}")
    try:
        distinct = value.format(node_rank=0) != value.format(node_rank=1)
    except (KeyError, IndexError, ValueError):
        distinct = False
    if not distinct:
        raise ValueError(f"expected a directory with {{node_rank}} in it (one per node) and no other {{...}}, "
                         f"got {short_repr(value)}")
    return _no_nul(value)


def _interpreter(value: Any) -> str:
    """One word, as a shell line runs it (no blanks, no NUL), and not one `env` would take for an option."""
    if not isinstance(value, str) or not value or any(c.isspace() or c == "\0" for c in value):
        raise ValueError(f"expected the path of a Python interpreter without blanks, such as "
                         f"~/envs/train/bin/python, got {short_repr(value)}")
    if value.startswith("-"):
        raise ValueError(f"{short_repr(value)} starts with '-', which would be read as an option; write ./{value}")
    if value.endswith("/"):
        raise ValueError(f"{short_repr(value)} is a directory; name the interpreter in it, e.g. {value}bin/python")
    return value


class Simulated(StrictModel):
    """Simulated nodes (a launch without --hosts). workdir: each node's own working directory, relative
    to where harness runs, with {node_rank} in it, so that files every node writes under the same
    name (a checkpoint, a log) do not collide as they would not on separate machines. Unset, the
    nodes share the launch directory. python: the interpreter every node's torchrun (and so every
    rank) runs with, e.g. a virtual environment's bin/python that has the job's own packages; unset,
    the harness's own. network: private (the default), a network of the launch's own where loopback is the only
    interface, so that no other user of the machine reaches the job's rendezvous store, which has no
    authentication (targets/local/private_net.py); the job then reaches no other host either. host: this
    machine's network, for a job that downloads or logs to a service while it runs; its store is then open to
    every user of the machine, and `rdzv: c10d`, whose store holds pickles torchrun loads, is refused."""

    workdir: Annotated[str, PlainValidator(_node_workdir)] | None = None
    python: Annotated[str, PlainValidator(_interpreter)] | None = None
    network: Literal["private", "host"] = "private"

    def interpreter(self, cwd: str, default: str) -> str:
        """python as a path on this machine (default when unset): `~` expanded, a relative path taken
        from the launch directory cwd, a bare name looked up on PATH as a shell would (left as written
        when it is not there, for preflight to say so). Absolute but not resolved: a virtual
        environment's bin/python is a link to its base interpreter, and only its own path is the venv."""
        if self.python is None:
            return default
        path = os.path.expanduser(self.python)
        if "/" not in path:
            found = shutil.which(path)
            if found is None:
                return path
            path = found
        return posixpath.normpath(posixpath.join(cwd, path))


ContainerEngine = Literal["docker", "podman"]


class Container(StrictModel):
    """How every node runs inside `image` over SSH. engine: the CLI on the hosts (docker | podman);
    each host needs it, the image (same digest everywhere: preflight checks) and, for GPUs, the
    NVIDIA container toolkit (docker) or its CDI spec (podman)."""

    engine: ContainerEngine = "docker"


def _container(value: Any) -> Any:
    """`container: true` is the docker default and `false` none; a mapping chooses the engine."""
    if value is True:
        return {}
    if value is False or value is None:
        return None
    if isinstance(value, dict):
        return value
    raise ValueError(f"expected true, false or a mapping such as {{engine: podman}}, got {short_repr(value)}")


class JobSpec(StrictModel):
    """A distributed job. Field names are a public contract: other tools and tests write them.

    container: over SSH, run every node's torchrun inside `image` (`docker run`, or podman with
    `container: {engine: podman}`), so that every host runs identical software whatever it has
    installed. data_paths: files or directories (relative to each node's workdir) that every node
    needs; preflight checks they exist and are identical. setup: shell commands that prepare a node's
    workdir (e.g. the data) before torchrun starts, once per workdir (plan/setup_script.py). files: more of
    the job's code for Kubernetes pods (files or directories, relative to where `harness render` runs),
    shipped with a relative entrypoint.script in the job's ConfigMap (targets/k8s/manifests.py); other
    targets run where the code already is. secrets: environment values the job gets without their being
    written anywhere (Secret; docs/security.md).
    """

    name: str
    nnodes: PositiveInt
    nproc_per_node: Annotated[int | Literal["auto"], PlainValidator(_nproc)] = 1
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    master_port: Annotated[int | Literal["auto"], PlainValidator(_master_port)] = "auto"
    rdzv: Literal["static", "c10d"] = "static"
    entrypoint: Entrypoint
    env: dict[EnvName, EnvValue] = Field(default_factory=dict)
    secrets: dict[EnvName, Annotated[Secret, BeforeValidator(_secret)]] = Field(default_factory=dict)
    image: str | None = None
    resources: Resources = Field(default_factory=Resources)
    restarts: Restarts = Field(default_factory=Restarts)
    slurm: Slurm = Field(default_factory=Slurm)
    k8s: Kubernetes = Field(default_factory=Kubernetes)
    # Kept only to point a spec that still uses it at `restarts` (see _removed_max_restarts).
    max_restarts: Annotated[None, PlainValidator(_removed_max_restarts)] = None
    timeouts: Timeouts = Field(default_factory=Timeouts)
    supervision: Supervision = Field(default_factory=Supervision)
    health: Health = Field(default_factory=Health)
    container: Annotated[Container | None, BeforeValidator(_container)] = None
    network: Network = Field(default_factory=Network)
    simulated: Simulated = Field(default_factory=Simulated)
    data_paths: list[str] = Field(default_factory=list)
    setup: list[SetupCommand] = Field(default_factory=list)
    files: list[ShippedPath] = Field(default_factory=list)
    _source: str | None = PrivateAttr(default=None)

    @field_validator("data_paths")
    @classmethod
    def _non_empty_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.strip():
                raise ValueError("data_paths entries must be non-empty paths")
            _no_nul(path)
        return paths

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if len(value) > 63 or not DNS1123_LABEL.fullmatch(value):
            raise ValueError(
                f"expected a DNS-1123 label (lower-case letters, digits and '-', starting and ending "
                f"with a letter or digit, at most 63 characters), got {short_repr(value)}"
            )
        return value

    @field_validator("container")
    @classmethod
    def _container_needs_image(cls, value: Container | None, info: ValidationInfo) -> Container | None:
        if value is not None and info.data.get("image") is None:
            raise ValueError("container: true runs every node in `image:`; set image (e.g. registry/harness:0.1.0)")
        return value

    @model_validator(mode="after")
    def _secrets_not_in_env(self) -> JobSpec:
        for name in self.secrets:
            if name in self.env:
                raise error_at("JobSpec", ("secrets", name), name,
                               f"{name} is also in env: a value comes from env (written in clear) or from secrets, "
                               f"not both")
        return self

    def secret_key(self, name: str) -> SecretKey:
        """The Kubernetes Secret that the pods take secret `name` from."""
        return self.secrets[name].k8s or SecretKey(secret=f"{self.name}-secrets", key=name)

    @model_validator(mode="after")
    def _min_nnodes_within_nnodes(self) -> JobSpec:
        fewest = self.restarts.min_nnodes
        if fewest is not None and fewest > self.nnodes:
            raise error_at("JobSpec", ("restarts", "min_nnodes"), fewest,
                           f"expected at most nnodes ({self.nnodes}): a run never grows past nnodes, it shrinks to "
                           f"no fewer than min_nnodes, got {fewest}")
        return self

    @property
    def fewest_nnodes(self) -> int:
        """The fewest nodes an attempt may run on: restarts.min_nnodes, else nnodes (no shrinking)."""
        return self.restarts.min_nnodes or self.nnodes

    def at_nnodes(self, nnodes: int) -> JobSpec:
        """This spec on fewer nodes: what an attempt runs when hosts are down and no spare is left
        (restarts.min_nnodes), each node with the same processes, so a smaller world size."""
        return self.model_copy(update={"nnodes": nnodes})

    def at_port(self, port: int) -> JobSpec:
        """This spec with master_port fixed: what a target plans with once it has picked a free port."""
        return self.model_copy(update={"master_port": port})

    def script_under(self, base: str) -> JobSpec:
        """This spec with a relative entrypoint.script taken from base, for a node whose working
        directory is not where the script is (Kubernetes pods, simulated nodes with their own)."""
        script = self.entrypoint.script
        if script is None or script.startswith("/"):
            return self
        entry = self.entrypoint.model_copy(update={"script": posixpath.normpath(posixpath.join(base, script))})
        return self.model_copy(update={"entrypoint": entry})

    @property
    def source(self) -> str | None:
        """The file the spec was read from (None for a spec made in code): where errors point."""
        return self._source

    @field_validator("image")
    @classmethod
    def _image_ref(cls, value: str | None) -> str | None:
        return _image_reference(value)


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job spec; problems are raised as SpecError with file:line:col."""
    spec = validate(JobSpec, load_document(path))
    spec._source = str(path)
    return spec
