"""The job spec (jobs/*.yaml): one validated description of a distributed torchrun job."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, field_validator, model_validator

from harness.validation import StrictModel, validate
from harness.yamlsource import load_document

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Kubernetes resource.Quantity: a decimal number with an optional binary/decimal suffix or exponent.
QUANTITY = re.compile(r"^(\d+(\.\d+)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")
# Docker image reference: [registry[:port]/]path[:tag][@digest], lower-case path components.
IMAGE_REF = re.compile(
    r"^(?:[A-Za-z0-9.-]+(?::\d+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@sha256:[a-f0-9]{64})?$"
)

# The rendezvous contract belongs to the harness; a user override would split the job's view of it.
RESERVED_ENV = frozenset(
    {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "NNODES",
     "NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"}
)
RESERVED_PREFIXES = ("PET_", "HARNESS_", "TORCHELASTIC_")


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1, got {value!r}")
    return value


def _nproc(value: Any) -> int | Literal["auto"]:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer >= 1 or 'auto' (one process per GPU), got {value!r}")
    return value


def _quantity(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or not QUANTITY.match(str(value)):
        raise ValueError(
            f"expected a Kubernetes quantity such as 4, 500m, 16Gi or 512Mi, got {value!r}"
        )
    return str(value)


def _argument(value: Any) -> str:
    """Numbers in args are written unquoted in YAML all the time; booleans and nulls are ambiguous."""
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        written = json.dumps(value) if isinstance(value, (bool, type(None))) else repr(value)
        raise ValueError(f"expected a string or number, got {written}; quote it if you mean the text: '{written}'")
    return str(value)


def _env_name(key: Any) -> str:
    if not isinstance(key, str) or not ENV_NAME.match(key):
        raise ValueError(f"{key!r} is not a valid environment variable name")
    if key in RESERVED_ENV or key.startswith(RESERVED_PREFIXES):
        raise ValueError(
            f"{key} is set by the harness/torchrun for every node and cannot be overridden; "
            f"use master_port, nnodes or nproc_per_node instead"
        )
    return key


PositiveInt = Annotated[int, PlainValidator(_positive_int)]
Quantity = Annotated[str, PlainValidator(_quantity)]
Argument = Annotated[str, PlainValidator(_argument)]
EnvName = Annotated[str, PlainValidator(_env_name)]


class Entrypoint(StrictModel):
    """What torchrun runs on every rank: a module (`python -m`) or a script path, plus its args."""

    module: str | None = None
    script: str | None = None
    args: list[Argument] = Field(default_factory=list)

    @model_validator(mode="after")
    def _exactly_one(self) -> Entrypoint:
        if (self.module is None) == (self.script is None):
            raise ValueError("set exactly one of 'module' (e.g. harness.payload.train) or 'script' (e.g. train.py)")
        if self.module is not None and not re.match(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$", self.module):
            raise ValueError(f"module must be a dotted Python module name, got {self.module!r}")
        if self.script is not None and not self.script.strip():
            raise ValueError("script must be a non-empty path")
        return self


class Resources(StrictModel):
    """Per-node resources; the Kubernetes renderer and preflight use them.

    storage sizes the shared volume that holds data and checkpoints on Kubernetes.
    """

    gpus: Annotated[int, Field(ge=0)] = 0
    cpu: Quantity | None = None
    memory: Quantity | None = None
    shm_size: Quantity | None = None
    storage: Quantity = "50Gi"


class Timeouts(StrictModel):
    """Seconds. stop_grace is the SIGTERM-to-SIGKILL wait when a run is stopped."""

    rendezvous: Annotated[float, Field(gt=0, le=86400)] = 900
    stop_grace: Annotated[float, Field(gt=0, le=4)] = 3
    connect: Annotated[float, Field(gt=0, le=600)] = 10

    @field_validator("rendezvous", "stop_grace", "connect", mode="before")
    @classmethod
    def _number(cls, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number of seconds, got {value!r}")
        return float(value)


class JobSpec(StrictModel):
    """A distributed job. Field names are a public contract: other tools and tests write them.

    container: over SSH, run every node's torchrun inside `image` (docker run), so that every host
    runs identical software whatever it has installed. data_paths: files or directories (relative
    to each node's workdir) that every node needs; preflight checks they exist and are identical.
    """

    name: str
    nnodes: PositiveInt
    nproc_per_node: Annotated[int | Literal["auto"], PlainValidator(_nproc)] = 1
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    master_port: Annotated[int, Field(ge=1024, le=65535)] = 29500
    rdzv: Literal["static", "c10d"] = "static"
    entrypoint: Entrypoint
    env: dict[EnvName, str] = Field(default_factory=dict)
    image: str | None = None
    resources: Resources = Field(default_factory=Resources)
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 0
    timeouts: Timeouts = Field(default_factory=Timeouts)
    container: bool = False
    data_paths: list[str] = Field(default_factory=list)

    @field_validator("data_paths")
    @classmethod
    def _non_empty_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.strip():
                raise ValueError("data_paths entries must be non-empty paths")
        return paths

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if len(value) > 63 or not DNS1123_LABEL.match(value):
            raise ValueError(
                f"expected a DNS-1123 label (lower-case letters, digits and '-', starting and ending "
                f"with a letter or digit, at most 63 characters), got {value!r}"
            )
        return value

    @model_validator(mode="after")
    def _container_needs_image(self) -> JobSpec:
        if self.container and self.image is None:
            raise ValueError("container: true runs every node in `image:`; set image (e.g. registry/harness:0.1.0)")
        return self

    @field_validator("image")
    @classmethod
    def _image_ref(cls, value: str | None) -> str | None:
        if value is not None and not IMAGE_REF.match(value):
            raise ValueError(f"expected an image reference such as registry/name:tag, got {value!r}")
        return value


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job spec; problems are raised as SpecError with file:line:col."""
    return validate(JobSpec, load_document(path))
