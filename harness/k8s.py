"""Spec -> Kubernetes manifests: a headless Service and an Indexed Job, core objects only.

The pods run the same torchrun arguments and env contract as every other backend (plan.torchrun_args
and plan.node_env); only the node rank differs per pod, so it comes from the pod's completion index.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from harness import __version__
from harness.plan import TORCHRUN_MODULE, node_env, resolve_nproc, torchrun_args
from harness.spec import JobSpec
from harness.yamlsource import located

MAX_NAME = 63
WORKDIR = "/workspace"
SPEC_DIR = "/etc/harness"
CONTAINER = "torchrun"
IMAGE_UID = 1000  # docker/Dockerfile's user; fsGroup makes the shared volume writable for it
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
_RANK_SENTINEL = "\0node-rank\0"
# Pod 0 serves the rendezvous store; the others wait for its port, then torchrun replaces the shell
# so that it is PID 1 and receives the kubelet's SIGTERM itself.
START_SCRIPT = (
    'if [ "$NODE_RANK" != "0" ]; then '
    'python -m harness.waitport "$MASTER_ADDR" "$MASTER_PORT" --timeout "$HARNESS_RDZV_TIMEOUT" || exit 1; '
    'fi; exec "$@"'
)


def _short(name: str, limit: int) -> str:
    """Deterministic, still-unique shortening: a prefix plus a hash of the whole name."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def object_names(spec: JobSpec) -> dict[str, str]:
    """Pod hostnames are `<job>-<index>` and must stay DNS labels; Service names must start with a letter."""
    job = _short(spec.name, MAX_NAME - 1 - len(str(spec.nnodes - 1)))
    service = job if job[0].isalpha() else _short(f"svc-{job}", MAX_NAME)
    return {"job": job, "service": service, "configmap": f"{job}-spec", "pvc": f"{job}-work"}


def _escape(value: str) -> str:
    """The kubelet expands $(VAR) in command, args and env; `$$` is its escape for a literal `$`."""
    return value.replace("$", "$$").replace(_RANK_SENTINEL, "$(NODE_RANK)")


def _labels(names: dict[str, str]) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": names["job"],
        "app.kubernetes.io/instance": names["job"],
        "app.kubernetes.io/component": CONTAINER,
        "app.kubernetes.io/part-of": "harness",
        "app.kubernetes.io/managed-by": "harness",
        "app.kubernetes.io/version": __version__,
    }


def _selector(names: dict[str, str]) -> dict[str, str]:
    return {"app.kubernetes.io/instance": names["job"], "app.kubernetes.io/component": CONTAINER}


def _container(spec: JobSpec, names: dict[str, str], nproc: int) -> dict[str, Any]:
    master = f"{names['job']}-0.{names['service']}"
    argv = ["python", "-m", TORCHRUN_MODULE,
            *torchrun_args(spec, run_id=names["job"], master_addr=master, nproc=nproc, node_rank=_RANK_SENTINEL)]
    env = node_env(spec, run_id=names["job"], master_addr=master, nproc=nproc, node_rank=_RANK_SENTINEL)
    env["HARNESS_RDZV_TIMEOUT"] = str(int(spec.timeouts.rendezvous))
    env_list: list[dict[str, Any]] = [{"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}}]
    env_list += [{"name": k, "value": _escape(v)} for k, v in env.items() if k != "NODE_RANK"]
    limits: dict[str, str] = {}
    requests: dict[str, str] = {}
    for key, value in (("cpu", spec.resources.cpu), ("memory", spec.resources.memory)):
        if value is not None:
            limits[key] = requests[key] = value
    if spec.resources.gpus:
        limits["nvidia.com/gpu"] = str(spec.resources.gpus)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKDIR,
        "command": ["/bin/sh", "-c", START_SCRIPT, CONTAINER],
        "args": [_escape(a) for a in argv],
        "env": env_list,
        "ports": [{"name": "rendezvous", "containerPort": spec.master_port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "work", "mountPath": WORKDIR},
        ],
    }
    if limits:
        container["resources"] = {"limits": limits} | ({"requests": requests} if requests else {})
    return container


def render_manifests(spec: JobSpec, spec_text: str) -> list[dict[str, Any]]:
    """ConfigMap (the spec), PVC (data + checkpoints, so a re-applied Job resumes), Service, Job."""
    if spec.image is None:
        raise located(spec.source, ("image",), "required to render for Kubernetes: the container image every pod "
                                               "runs (e.g. registry/harness:0.1.0)")
    names = object_names(spec)
    nproc = resolve_nproc(spec, [spec.resources.gpus] * spec.nnodes, ["each pod (resources.gpus)"] * spec.nnodes)
    if spec.backend == "nccl" and not spec.resources.gpus:
        raise located(spec.source, ("resources", "gpus"), "backend nccl needs GPUs: set resources.gpus (GPUs per "
                                                          "pod) to render for Kubernetes")
    labels = _labels(names)
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.resources.shm_size:
        shm["sizeLimit"] = spec.resources.shm_size
    configmap = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": names["configmap"], "labels": labels},
        "data": {"job.yaml": spec_text},
    }
    pvc = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": names["pvc"], "labels": labels},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.resources.storage}}},
    }
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": names["service"], "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _selector(names),
            "ports": [{"name": "rendezvous", "port": spec.master_port, "targetPort": spec.master_port,
                       "protocol": "TCP"}],
        },
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": names["job"], "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": spec.nnodes,
            "parallelism": spec.nnodes,
            "backoffLimit": 0,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}},
                {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": names["service"],
                    "restartPolicy": "Never",
                    "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID,
                                        "fsGroup": IMAGE_UID},
                    "containers": [_container(spec, names, nproc)],
                    "volumes": [
                        {"name": "dshm", "emptyDir": shm},
                        {"name": "spec", "configMap": {"name": names["configmap"]}},
                        {"name": "work", "persistentVolumeClaim": {"claimName": names["pvc"]}},
                    ],
                },
            },
        },
    }
    return [configmap, pvc, service, job]


class _PlainDumper(yaml.SafeDumper):
    """No &anchors/*aliases: every object reads on its own, as people write manifests."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def manifests_yaml(spec: JobSpec, spec_text: str, source: str) -> str:
    header = f"# Rendered by `harness render {source} --target k8s`; do not edit, re-render.\n"
    docs = [yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, width=120)
            for doc in render_manifests(spec, spec_text)]
    return header + "---\n".join(docs)
