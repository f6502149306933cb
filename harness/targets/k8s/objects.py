"""What both kinds of Kubernetes render share (manifests.py: pods that run torchrun bare; supervised.py: the
harness's controller pod and its worker pods): where things are in a pod, names, labels, resources."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from harness import __version__
from harness.spec.job import JobSpec

MAX_NAME = 63
WORKDIR = "/workspace"
SPEC_DIR = "/etc/harness"  # the ConfigMap, read-only: job.yaml, pod.py and code/
CODE_SUBDIR = "code"
CODE_DIR = f"{SPEC_DIR}/{CODE_SUBDIR}"  # the shipped code: not under WORKDIR, which the volume hides
POD_SCRIPT = f"{SPEC_DIR}/pod.py"  # what a worker pod runs: node/pod.py, standard library only
CONTAINER = "torchrun"
IMAGE_UID = 1000  # docker/Dockerfile's user; fsGroup makes the shared volume writable for it
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"


@dataclass(frozen=True)
class Shipped:
    """What every pod gets from the ConfigMap: the volume's items, and annotations that name the code."""

    items: list[dict[str, str]]
    annotations: dict[str, str]


def short(name: str, limit: int) -> str:
    """Deterministic, still-unique shortening: a prefix plus a hash of the whole name."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def labels(names: dict[str, str], component: str = CONTAINER) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": names["job"],
        "app.kubernetes.io/instance": names["job"],
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "harness",
        "app.kubernetes.io/managed-by": "harness",
        "app.kubernetes.io/version": __version__,
    }


def secret_env(spec: JobSpec) -> list[dict[str, Any]]:
    """The job's secrets as a container's env: each from its Secret (JobSpec.secret_key), never a value; the
    pod does not start until the Secret exists, which `harness render` says how to create."""
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
            for name, ref in ((name, spec.secret_key(name)) for name in spec.secrets)]


def secret_commands(spec: JobSpec) -> list[str]:
    """For each Secret the pods read, the command that creates it (the values left for the user to fill in)."""
    keys: dict[str, list[str]] = {}
    for name in spec.secrets:
        ref = spec.secret_key(name)
        keys.setdefault(ref.secret, []).append(ref.key)
    return [f"kubectl create secret generic {secret} " + " ".join(f"--from-literal={key}=..." for key in names)
            for secret, names in keys.items()]


def pod_resources(spec: JobSpec) -> dict[str, Any]:
    """A node pod's resources: resources.cpu and memory as limits and requests, GPUs as limits."""
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    for key, value in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if value is not None:
            limits[key] = requests[key] = value
    if spec.resources.gpus:
        limits["nvidia.com/gpu"] = str(spec.resources.gpus)
    return ({"limits": limits} | ({"requests": requests} if requests else {})) if limits else {}


def hardened(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod spec as the Pod Security Standard "restricted" has it (a namespace that enforces it admits the pods):
    the image's user, never root, the runtime's seccomp profile; in each container no privilege escalation and no
    capability (py-spy reads the ranks as their own user: the agent is their ptracer); no service-account token,
    since nothing in the pods talks to the API. fsGroup makes the shared volume writable for the user."""
    container_security = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod | {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID,
                            "fsGroup": IMAGE_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container | {"securityContext": container_security} for container in pod["containers"]],
    }
