"""A job spec from torchrun-style flags: `harness launch train.py --nnodes 2 --nproc-per-node 4 -- ARGS`
builds in memory the spec a YAML file would hold, validated by the same model, and can write it out
(--save-job) so that the next step is the full spec; the flags a spec file takes too (--stall, --slow) win
over its keys. Pure: the caller writes the file."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from harness.errors import UsageError, short_repr
from harness.spec.job import Health, JobSpec
from harness.spec.secrets import env_apart

# Each ScriptFlags field that a flag sets: the spec's key path it lands at, and the flag (errors name it).
FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "name": (("name",), "--name"),
    "nnodes": (("nnodes",), "--nnodes"),
    "nproc_per_node": (("nproc_per_node",), "--nproc-per-node"),
    "master_port": (("master_port",), "--master-port"),
    "rdzv": (("rdzv",), "--rdzv-backend"),
    "backend": (("backend",), "--backend"),
    "max_restarts": (("restarts", "max"), "--max-restarts"),
    "min_nnodes": (("restarts", "min_nnodes"), "--nnodes"),
    "env": (("env",), "--env"),
    "stall": (("health", "stall"), "--stall"),
    "slow": (("health", "slow"), "--slow"),
    "metrics_port": (("health", "metrics_port"), "--metrics-port"),
    "metrics_address": (("health", "metrics_address"), "--metrics-address"),
}
# The fields whose flags a spec file takes too (harness launch job.yaml --stall 60): they win over its keys.
SPEC_FILE_FLAGS = ("stall", "slow", "metrics_port", "metrics_address")


@dataclass(frozen=True)
class ScriptFlags:
    """What the command line says of a job that has no spec file; None: the spec's default."""

    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)
    name: str | None = None
    nnodes: int | None = None
    nproc_per_node: int | str | None = None
    master_port: int | str | None = None
    rdzv: str | None = None
    backend: str | None = None
    max_restarts: int | None = None
    min_nnodes: int | None = None  # --nnodes MIN:N
    env: list[str] = field(default_factory=list)
    stall: float | None = None  # health.stall: seconds
    slow: float | None = None  # health.slow: percent
    metrics_port: int | None = None  # health.metrics_port
    metrics_address: str | None = None  # health.metrics_address

    def given(self, script_only: bool = False) -> list[str]:
        """The flags that were set, as the user types them; script_only: only those a spec file refuses."""
        return list(dict.fromkeys(flag for name, (_, flag) in FLAGS.items() if getattr(self, name) not in (None, [])
                                  and not (script_only and name in SPEC_FILE_FLAGS)))


def job_name(entry: str) -> str:
    """A DNS-1123 name from a script path or module (train.py -> train, pkg.train_ddp -> train-ddp)."""
    stem = PurePosixPath(entry).stem if entry.endswith(".py") or "/" in entry else entry.rsplit(".", 1)[-1]
    name = re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")[:63].strip("-")
    return name or "job"


def _env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key:
            raise UsageError(f"--env: expected KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def spec_data(flags: ScriptFlags) -> dict[str, Any]:
    """The spec as a YAML file would hold it: only what the flags set, in the reference's key order."""
    entry = flags.script if flags.script is not None else flags.module
    assert entry is not None, "a script or a module"
    nnodes = 1 if flags.nnodes is None else flags.nnodes  # torchrun's default
    data: dict[str, Any] = {"name": flags.name or job_name(entry), "nnodes": nnodes}
    optional = {"nproc_per_node": flags.nproc_per_node, "backend": flags.backend, "master_port": flags.master_port,
                "rdzv": flags.rdzv}
    data |= {key: value for key, value in optional.items() if value is not None}
    data["entrypoint"] = {"script": flags.script} if flags.script is not None else {"module": flags.module}
    if flags.args:
        data["entrypoint"]["args"] = list(flags.args)
    if flags.env:
        data["env"] = _env(flags.env)
    restarts = {"max": flags.max_restarts, "min_nnodes": flags.min_nnodes}
    if given := {key: value for key, value in restarts.items() if value is not None}:
        data["restarts"] = given
    if health := _health(flags):
        data["health"] = health
    return data


def _health(flags: ScriptFlags) -> dict[str, float | int]:
    return {key: value for key in SPEC_FILE_FLAGS if (value := getattr(flags, key)) is not None}


def spec_from_flags(flags: ScriptFlags) -> JobSpec:
    """The validated spec; a bad value is a usage error naming its flag."""
    data = spec_data(flags)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise _flag_error(exc, flags) from None


def with_spec_file_flags(spec: JobSpec, flags: ScriptFlags) -> JobSpec:
    """A spec file's spec with the flags that win over its keys (--stall, --slow, --metrics-port), validated as
    the file's values are; a bad value is a usage error naming its flag."""
    if not (health := _health(flags)):
        return spec
    try:
        return spec.model_copy(update={"health": Health.model_validate(spec.health.model_dump() | health)})
    except ValidationError as exc:
        raise _flag_error(exc, flags, within=("health",)) from None


def _flag_error(exc: ValidationError, flags: ScriptFlags, within: tuple[str, ...] = ()) -> UsageError:
    """The first problem, named by the flag that set the value (within: where the model validated sits)."""
    first = exc.errors()[0]
    loc = within + tuple(str(part) for part in first["loc"])
    flag = next((f for keys, f in FLAGS.values() if loc[:len(keys)] == keys),
                "the script's arguments" if loc[:2] == ("entrypoint", "args") else
                "-m" if flags.module is not None else "the script")
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] in ("greater_than_equal", "less_than_equal"):  # pydantic's range: say what was given too
        message += f", got {short_repr(first['input'])}"
    return UsageError(f"{flag}: {message}")


def spec_yaml(flags: ScriptFlags, command: str, path: str | None = None) -> str:
    """The spec as a file. command: how it was made, as the harness shows it (spec/secrets.shown_words). path: where
    it is saved (--save-job), to be launched again (`harness launch PATH`): that file holds no value of an --env name
    that looks secret, and takes each from the launching environment instead (secrets:, spec/secrets.py)."""
    data = spec_data(flags)
    secret_looking: dict[str, str] = {}
    if path is not None and "env" in data:
        plain, secret_looking = env_apart(data.pop("env"))
        at = list(data).index("entrypoint") + 1  # the reference's key order: env and secrets after the entrypoint
        both: dict[str, dict[str, str | None]] = {"env": dict(plain)} if plain else {}
        both |= {"secrets": dict.fromkeys(secret_looking)} if secret_looking else {}
        data = dict(list(data.items())[:at]) | both | dict(list(data.items())[at:])
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
    again = f"# Launch with: harness launch {path}  (every key: docs/job-spec.md)\n" if path else ""
    if secret_looking:
        again += (f"# {', '.join(secret_looking)}: given by --env, and written nowhere: each is read from the "
                  f"environment `harness launch` runs in (export it first; docs/security.md#secrets)\n")
    return f"# Made by: {command}\n{again}{body}"
