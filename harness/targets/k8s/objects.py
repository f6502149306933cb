"""What both kinds of Kubernetes render share (manifests.py: pods that run torchrun bare; supervised.py: the
harness's controller pod and its worker pods): where things are in a pod, names, labels, resources, the job's
volume and where it lets the pods run."""

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
# docker/Dockerfile's user: above the uids a node's own users have (from 1000), so that a process that escaped its
# container is none of theirs; fsGroup makes the shared volume writable for it.
IMAGE_UID = 10001
# What a pod may write besides its volumes: the root file system is read-only, these are emptyDirs of the pod's own.
TMP_DIR = "/tmp"  # torchrun's, the node agents' and torch's temporary files and caches
HOME_DIR = "/home/harness"  # the image's user's home, HOME in every container: ~/.cache, ~/.triton, the index of runs
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
# The oldest Kubernetes that takes every render as written: the API's schemas before 1.29 require onPodConditions
# in every podFailurePolicy rule, and the supervised workers' Job has backoffLimitPerIndex, beta and on by default
# from 1.29 (1.28's is alpha, off: the API server would drop it). tests/unit/test_k8s.py validates every render
# against the schemas of this version and of the newest.
MIN_KUBERNETES = "1.29"
# The one way to apply a render, said wherever one is: a client-side `kubectl apply` copies every object into an
# annotation of at most 256 KiB, too little for a ConfigMap that ships code; server-side apply keeps no such copy.
APPLY = "kubectl apply --server-side"


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
    create = f"kubectl create secret generic -n {spec.k8s.namespace}" if spec.k8s.namespace else \
        "kubectl create secret generic"
    return [f"{create} {secret} " + " ".join(f"--from-literal={key}=..." for key in names)
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


def disrupted() -> list[dict[str, str]]:
    """A podFailurePolicy rule's onPodConditions for a pod that Kubernetes itself ended (evicted, preempted, its node
    drained or lost). The status is written out: the schemas before 1.35 require it (the API server defaults it)."""
    return [{"type": "DisruptionTarget", "status": "True"}]


def volume_claim(spec: JobSpec, names: dict[str, str]) -> dict[str, Any]:
    """The job's volume (data, checkpoints, the run record): its size, k8s.access_mode and k8s.storage_class (unset:
    no storageClassName, so the cluster's default class provisions it; "": none, a PersistentVolume made by hand
    binds it)."""
    claim: dict[str, Any] = {"accessModes": [spec.k8s.access_mode]}
    if spec.k8s.storage_class is not None:
        claim["storageClassName"] = spec.k8s.storage_class
    claim["resources"] = {"requests": {"storage": spec.resources.storage}}
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": names["pvc"], "labels": labels(names)}, "spec": claim}


def on_the_volumes_node(spec: JobSpec, names: dict[str, str]) -> dict[str, Any]:
    """A pod spec's placement for k8s.access_mode ReadWriteOnce, where one node alone can mount the volume: every
    pod of the job (each mounts it) goes to a node that runs another of them, so all go to one node. The first
    one scheduled is exempt, as it matches its own term; the volume's own node affinity (a local volume's node,
    a cloud disk's zone) chooses where it goes. Nothing for ReadWriteMany: the pods may run anywhere."""
    if spec.k8s.access_mode != "ReadWriteOnce":
        return {}
    term = {"labelSelector": {"matchLabels": {"app.kubernetes.io/instance": names["job"]}},
            "topologyKey": "kubernetes.io/hostname"}
    return {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}}


def placement_note(spec: JobSpec, pods: int) -> str | None:
    """What a render of `pods` pods should say of where they run, when it constrains them."""
    if spec.k8s.access_mode != "ReadWriteOnce" or pods < 2:
        return None
    return (f"k8s.access_mode ReadWriteOnce: one node mounts the volume, so all {pods} pods of the job run on that "
            f"node, which needs room for every one of them")


def in_namespace(objects: list[dict[str, Any]], namespace: str | None) -> list[dict[str, Any]]:
    """Every object naming namespace (None: none, so that they go where `kubectl apply -n` or the context's says;
    kubectl refuses an object that names another namespace than -n)."""
    if namespace is None:
        return objects
    return [obj | {"metadata": {"name": obj["metadata"]["name"], "namespace": namespace, **obj["metadata"]}}
            for obj in objects]


def hardened(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod spec as the Pod Security Standard "restricted" has it (a namespace that enforces it admits the pods),
    and as a policy scanner would: the image's user (a high uid, never root), the runtime's seccomp profile; in
    each container no privilege escalation and no capability (py-spy reads the ranks as their own user: the agent
    is their ptracer), a read-only root file system with an emptyDir of the pod's own for temporary files
    (TMP_DIR) and for HOME (HOME_DIR, unless the job's env sets HOME); no service-account token, since nothing in
    the pods talks to the API. fsGroup makes the shared volume writable for the user."""
    container_security = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                          "readOnlyRootFilesystem": True}
    writable = [{"name": "tmp", "mountPath": TMP_DIR}, {"name": "home", "mountPath": HOME_DIR}]
    home = [{"name": "HOME", "value": HOME_DIR}]
    return pod | {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID,
                            "fsGroup": IMAGE_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container | {
            "env": (home if all(entry["name"] != "HOME" for entry in container["env"]) else []) + container["env"],
            "volumeMounts": [*container["volumeMounts"], *writable],
            "securityContext": container_security} for container in pod["containers"]],
        "volumes": [*pod["volumes"], *({"name": mount["name"], "emptyDir": {}} for mount in writable)],
    }


def selector(names: dict[str, str], component: str = CONTAINER) -> dict[str, str]:
    """The labels that choose the job's pods of one component (every pod of the job has them: labels())."""
    return {"app.kubernetes.io/instance": names["job"], "app.kubernetes.io/component": component}


def network_policy(names: dict[str, str], component: str, ingress: list[dict[str, Any]]) -> dict[str, Any]:
    """Ingress to the job's pods of component: only what ingress allows, where the cluster's network plugin enforces
    NetworkPolicy. Pods are told apart by their labels, which a pod of the same namespace can copy."""
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": f"{names['job']}-{component}", "labels": labels(names, component)},
        "spec": {"podSelector": {"matchLabels": selector(names, component)}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }
