"""Spec -> Kubernetes manifests for a supervised run: the harness's controller in a pod of its own, beside the
job's worker pods, supervising them as it does SSH hosts (targets/k8s/pods.py; docs/architecture.md says why
this shape).

- the controller: a Job of one pod in the project's image (`k8s.controller_image`, default the job's image)
  running `harness k8s-controller`, with small requests and limits (`k8s.controller_resources`); its end is
  the run's end, and its exit code what the Job's podFailurePolicy reads: 0 completes the Job, a program
  failure (1) and an infrastructure failure past the harness's own restarts (INFRA_EXIT) fail it at once
  (Kubernetes never retries what the harness decided); its pod evicted or its node lost is recreated and a
  new run resumes from the newest checkpoint;
- the workers: an Indexed Job of nnodes + k8s.spares pods in the job's image, each running node/pod.py from
  the ConfigMap (standard library only), which dials the controller and runs the node agents it is sent; a
  pod deleted, evicted or lost is recreated (up to restarts.max times per index) and dials in again;
- a Service for the controller (the pods dial its DNS name), and NetworkPolicies that let only the job's
  worker pods reach the controller's port, and only the job's own pods reach the workers.

core renders those as plain objects; jobset as one JobSet whose replicatedJobs are the controller and the
workers, which succeeds when the controller's Job does and never recreates the group itself.
"""

from __future__ import annotations

from typing import Any

from harness.plan.planner import planned_port
from harness.spec.job import JobSpec
from harness.targets.k8s.objects import (
    COMPLETION_INDEX,
    JOBSET_API,
    MAX_NAME,
    POD_SCRIPT,
    SPEC_DIR,
    WORKDIR,
    Shipped,
    disrupted,
    hardened,
    labels,
    network_policy,
    on_the_volumes_node,
    pod_resources,
    secret_env,
    selector,
    short,
)

CONTROLLER = "controller"  # the controller's container and replicatedJob
WORKER = "node"  # the workers' container, Job suffix and replicatedJob (as the unsupervised JobSet's)
RUNS_DIR = f"{WORKDIR}/.harness/runs"  # the run record, on the job's volume: every verb reads it there
TOOLS_DIR = f"{WORKDIR}/.harness/bin"  # py-spy, put there by the controller for the worker pods' agents
LINK_KEY = f"{WORKDIR}/.harness/link-key"  # the run's key for the pod link, written by the controller at its start
PROGRAM_EXIT = 1  # harness k8s-controller: the program failed (restarts.on did not cover it, or none left)
INFRA_EXIT = 3  # ... the machines failed it (or it hung) and the harness's restarts could not carry it on
GRACE_MARGIN = 20  # seconds beyond the harness's own stop: the controller's stop reaches every node first


def worker_names(spec: JobSpec, job: str) -> str:
    """The workers' Job: pod hostnames `<job>-node-<index>` stay DNS labels."""
    last = str(spec.nnodes + spec.k8s.spares - 1)
    name = f"{job}-{WORKER}"
    return name if len(name) + 1 + len(last) <= MAX_NAME else short(name, MAX_NAME - 1 - len(last))


def _volumes(names: dict[str, str], shipped: Shipped, shm: bool) -> list[dict[str, Any]]:
    return [*([{"name": "dshm", "emptyDir": {"medium": "Memory"}}] if shm else []),
            {"name": "spec", "configMap": {"name": names["configmap"], "items": shipped.items}},
            {"name": "work", "persistentVolumeClaim": {"claimName": names["pvc"]}}]


def _mounts(shm: bool) -> list[dict[str, Any]]:
    return [*([{"name": "dshm", "mountPath": "/dev/shm"}] if shm else []),
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "work", "mountPath": WORKDIR}]


def _controller_resources(spec: JobSpec) -> dict[str, dict[str, str]]:
    """k8s.controller_resources as the container's, less those set to null."""
    wanted = spec.k8s.controller_resources
    sides = {"limits": wanted.limits.model_dump(exclude_none=True),
             "requests": wanted.requests.model_dump(exclude_none=True)}
    return {side: values for side, values in sides.items() if values}


def _controller_job(spec: JobSpec, names: dict[str, str], shipped: Shipped, code_dir: str | None) -> dict[str, Any]:
    stop_s = int(spec.timeouts.stop_grace) * 2 + GRACE_MARGIN  # the harness's stop, within the pod's grace period
    env = [{"name": "HARNESS_RUNS_DIR", "value": RUNS_DIR}, {"name": "HARNESS_K8S_TOOLS", "value": TOOLS_DIR},
           {"name": "HARNESS_K8S_LINK_KEY", "value": LINK_KEY}]
    if code_dir is not None:
        env.append({"name": "HARNESS_K8S_CODE", "value": code_dir})
    ports = [{"name": "link", "containerPort": spec.k8s.port, "protocol": "TCP"}]
    if spec.health.metrics_port is not None:
        ports.append({"name": "metrics", "containerPort": spec.health.metrics_port, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": CONTROLLER,
        "image": spec.k8s.controller_image or spec.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKDIR,
        "command": ["harness", "k8s-controller", f"{SPEC_DIR}/job.yaml"],
        "env": env,
        "ports": ports,
        "volumeMounts": _mounts(shm=False),
        # The pod deleted (with its Job or JobSet) or evicted: before its SIGTERM, the kubelet runs this, the stop
        # a user asks for, so that the run is recorded as stopped, every rank stopped first.
        "lifecycle": {"preStop": {"exec": {"command": ["harness", "stop", "latest", "--timeout", str(stop_s)]}}},
    }
    if resources := _controller_resources(spec):
        container["resources"] = resources
    metadata: dict[str, Any] = {"labels": labels(names, CONTROLLER)}
    return {
        "backoffLimit": 0,
        "podFailurePolicy": {"rules": [
            # evicted, preempted, its node drained or lost: a new controller pod, a new run from the newest checkpoint
            {"action": "Ignore", "onPodConditions": disrupted()},
            {"action": "FailJob", "onExitCodes": {"containerName": CONTROLLER, "operator": "In",
                                                  "values": [PROGRAM_EXIT]}},
            {"action": "FailJob", "onExitCodes": {"containerName": CONTROLLER, "operator": "In",
                                                  "values": [INFRA_EXIT]}},
        ]},
        "template": {
            "metadata": metadata,
            "spec": hardened({
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": stop_s + GRACE_MARGIN,
                "containers": [container],
                **on_the_volumes_node(spec, names),
                "volumes": _volumes(names, shipped, shm=False),
            }),
        },
    }


def _worker_job(spec: JobSpec, names: dict[str, str], shipped: Shipped, controller: str,
                code_dir: str | None) -> dict[str, Any]:
    pods = spec.nnodes + spec.k8s.spares
    args = ["serve", controller, str(spec.k8s.port), "--timeout", str(int(spec.timeouts.rendezvous)),
            "--tools", TOOLS_DIR, "--key", LINK_KEY]
    if code_dir is not None:
        args += ["--code", code_dir]
    field = {"POD_NAME": "metadata.name", "POD_INDEX": COMPLETION_INDEX, "NODE_NAME": "spec.nodeName"}
    container: dict[str, Any] = {
        "name": WORKER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKDIR,
        "command": ["python", "-I", POD_SCRIPT],
        "args": args,
        "env": [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in field.items()]
        + secret_env(spec),  # the pod's agents and ranks inherit them (node/pod.py)
        "ports": [{"name": "rendezvous", "containerPort": planned_port(spec), "protocol": "TCP"}],
        "volumeMounts": _mounts(shm=True),
    }
    if resources := pod_resources(spec):
        container["resources"] = resources
    volumes = _volumes(names, shipped, shm=True)
    if spec.resources.shm_size:
        volumes[0]["emptyDir"]["sizeLimit"] = spec.resources.shm_size
    metadata: dict[str, Any] = {"labels": labels(names, WORKER)}
    if shipped.annotations:
        metadata["annotations"] = shipped.annotations
    return {
        "completionMode": "Indexed",
        "completions": pods,
        "parallelism": pods,
        # A pod that failed (deleted, its program killed) is recreated under a new name, up to restarts.max
        # times per index; evicted, preempted or on a lost node, always. The controller takes it back.
        "backoffLimitPerIndex": spec.restarts.max,
        "podFailurePolicy": {"rules": [{"action": "Ignore", "onPodConditions": disrupted()}]},
        "template": {
            "metadata": metadata,
            "spec": hardened({
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": int(spec.timeouts.stop_grace) + GRACE_MARGIN,
                "containers": [container],
                **on_the_volumes_node(spec, names),
                "volumes": volumes,
            }),
        },
    }


def _network_policies(spec: JobSpec, names: dict[str, str]) -> list[dict[str, Any]]:
    """Where the cluster's network plugin enforces NetworkPolicy: the controller's port reached by the job's worker
    pods alone (its metrics port by the pods k8s.metrics_from names, else by nobody), the workers by the job's own
    pods alone (their rendezvous and collectives). Pods are told apart by their labels, which a pod of the same
    namespace can copy: the policies narrow who can reach the pods; the pod link's proofs hold without them
    (node/pod.py)."""
    workers = {"podSelector": {"matchLabels": selector(names, WORKER)}}
    ingress: list[dict[str, Any]] = [{"from": [workers], "ports": [{"port": spec.k8s.port, "protocol": "TCP"}]}]
    if spec.health.metrics_port is not None and spec.k8s.metrics_from:
        ingress.append({"from": [{"podSelector": {"matchLabels": spec.k8s.metrics_from}}],
                        "ports": [{"port": spec.health.metrics_port, "protocol": "TCP"}]})
    own = [{"podSelector": {"matchLabels": selector(names, component)}} for component in (CONTROLLER, WORKER)]
    return [network_policy(names, CONTROLLER, ingress), network_policy(names, WORKER, [{"from": own}])]


def supervised_core(spec: JobSpec, names: dict[str, str], shipped: Shipped,
                    code_dir: str | None) -> list[dict[str, Any]]:
    """The controller's Service, its Job (named after the job: `kubectl get job <job>` is the run), the
    workers' Job and the NetworkPolicy."""
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": names["service"], "labels": labels(names, CONTROLLER)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(names, CONTROLLER),
            "ports": [{"name": "link", "port": spec.k8s.port, "targetPort": spec.k8s.port, "protocol": "TCP"}],
        },
    }
    controller = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": names["job"], "labels": labels(names, CONTROLLER)},
        "spec": _controller_job(spec, names, shipped, code_dir),
    }
    workers = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": worker_names(spec, names["job"]), "labels": labels(names, WORKER)},
        "spec": _worker_job(spec, names, shipped, names["service"], code_dir),
    }
    return [service, controller, workers, *_network_policies(spec, names)]


def supervised_jobset(spec: JobSpec, names: dict[str, str], shipped: Shipped,
                      code_dir: str | None) -> list[dict[str, Any]]:
    """One JobSet: its replicatedJobs the controller and the workers; it succeeds when the controller's Job
    does and fails when either fails (maxRestarts 0: the harness restarts in place, never the whole group)."""
    subdomain = names["jobset"]
    controller = f"{names['jobset']}-{CONTROLLER}-0-0.{subdomain}"  # <jobset>-<replicatedJob>-<job>-<pod>
    jobset = {
        "apiVersion": JOBSET_API, "kind": "JobSet",
        "metadata": {"name": names["jobset"], "labels": labels(names, CONTROLLER)},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": subdomain},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [CONTROLLER]},
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [
                {"name": CONTROLLER, "replicas": 1,
                 "template": {"metadata": {"labels": labels(names, CONTROLLER)},
                              "spec": _controller_job(spec, names, shipped, code_dir)}},
                {"name": WORKER, "replicas": 1,
                 "template": {"metadata": {"labels": labels(names, WORKER)},
                              "spec": _worker_job(spec, names, shipped, controller, code_dir)}},
            ],
        },
    }
    return [jobset, *_network_policies(spec, names)]
