"""Spec -> Kubernetes manifests: the ConfigMap (the spec, node/pod.py, the job's code) and the volume every
pod shares, then the pods. Supervised (the default, k8s.supervised): the harness's controller pod and its worker
pods (supervised.py). Unsupervised: pods that run torchrun bare, in one of two flavors around the same Indexed
Job of nnodes pods: core, a headless Service and the Indexed Job, core objects only; jobset, the same Job as
the one replicatedJob of a JobSet (jobset.x-k8s.io/v1alpha2), which restarts the whole group up to
restarts.max times (it needs the JobSet controller installed in the cluster). Either with a NetworkPolicy: torch's
store has no authentication, so only the job's own pods may reach them.

Bare pods run the same torchrun arguments and env contract as every other backend (plan.torchrun_args and
plan.node_env); values known only in the pod (node rank, restart attempt) come from the downward API.

The pods need nothing of the harness: the wait for the master (or, supervised, the link to the controller) is
node/pod.py's source, and the job's own code (a relative entrypoint.script, `files:`) travels in the job's
ConfigMap with the spec, read from disk by code_files alone, so that the rendering itself stays pure.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml

from harness.plan.planner import TORCHRUN_MODULE, node_env, planned_port, resolve_nproc, torchrun_args
from harness.plan.setup_script import setup_script, with_setup
from harness.spec.job import JobSpec
from harness.spec.yamlsource import KeyPath, located
from harness.targets.k8s.objects import (
    CODE_DIR,
    CODE_SUBDIR,
    COMPLETION_INDEX,
    CONTAINER,
    JOBSET_API,
    MAX_NAME,
    MIN_KUBERNETES,
    POD_SCRIPT,
    SPEC_DIR,
    WORKDIR,
    Shipped,
    disrupted,
    hardened,
    in_namespace,
    labels,
    network_policy,
    on_the_volumes_node,
    placement_note,
    pod_resources,
    secret_commands,
    secret_env,
    selector,
    short,
    volume_claim,
)
from harness.targets.k8s.supervised import supervised_core, supervised_jobset

Flavor = Literal["core", "jobset"]
POD_SOURCE = (Path(__file__).parents[2] / "node" / "pod.py").read_text(encoding="utf-8")
MAX_CONFIGMAP = 1 << 20  # Kubernetes' limit on a ConfigMap's data and binaryData together, in bytes
CODE_DIGEST = "harness/code-sha256"  # pod template annotation: which code the pods were given
REPLICATED_JOB = "node"  # pods are <jobset>-node-0-<index>: node <index> of the one Job
# The JobSet controller labels and annotates every pod with how often it restarted the whole set
# (jobset.status.restarts: 0, 1, ...), i.e. the 0-based attempt. Annotation, as for the completion index.
RESTART_ATTEMPT = "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"
# How a pod's failure tells the infrastructure from the program (see POD_FAILURE_POLICY): torchrun is
# the container's PID 1 and exits 1 when a worker fails; these exit codes can only mean something else.
RDZV_WAIT_EXIT = 75  # EX_TEMPFAIL: a worker gave up waiting for the master's rendezvous port
SIGNAL_EXITS = tuple(range(129, 193))  # 128 + N: torchrun killed by signal N (e.g. 137: OOM-killed, SIGKILL)
_RANK_SENTINEL = "\0node-rank\0"
# Pod 0 serves the rendezvous store; the others wait for its port (isolated: stdlib only, whatever the
# image or the job's PYTHONPATH holds), then torchrun replaces the shell so that it is PID 1 and receives
# the kubelet's SIGTERM itself. Shipped code comes first on PYTHONPATH, before the job's or the image's own
# (the kubelet's $(PYTHONPATH) would only see the job's env).
START_SCRIPT = (
    'if [ "$NODE_RANK" != "0" ]; then '
    f'python -I {POD_SCRIPT} wait "$MASTER_ADDR" "$MASTER_PORT" --timeout "$HARNESS_RDZV_TIMEOUT" '
    f'|| exit {RDZV_WAIT_EXIT}; '
    'fi; '
    f'[ ! -d {CODE_DIR} ] || export PYTHONPATH="{CODE_DIR}${{PYTHONPATH:+:$PYTHONPATH}}"; '
    'exec "$@"'
)
# backoffLimit 0: any failed pod fails the whole Job (a static rendezvous cannot take one pod back).
# The rules only decide the Job's failure reason, which is what a JobSet's failure policy can see:
# the program exited non-zero -> reason PodFailurePolicy; the infrastructure failed the pod (evicted,
# preempted, its node drained or lost: DisruptionTarget; torchrun killed by a signal; the master never
# reachable) or it failed without an exit code -> counted -> reason BackoffLimitExceeded.
POD_FAILURE_POLICY: dict[str, Any] = {"rules": [
    {"action": "Count", "onPodConditions": disrupted()},
    {"action": "Count", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                        "values": [RDZV_WAIT_EXIT, *SIGNAL_EXITS]}},
    {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]}},
]}


def object_names(spec: JobSpec) -> dict[str, str]:
    """Pod hostnames must stay DNS labels: `<job>-<index>` (core) and `<jobset>-node-0-<index>` (JobSet,
    whose pod names add a 5-character suffix). Service names, and so JobSet names (the JobSet names
    its Service, Jobs and pods after itself), must start with a letter."""
    last = str(spec.nnodes - 1)
    job = short(spec.name, MAX_NAME - 1 - len(last))
    service = job if job[0].isalpha() else short(f"svc-{job}", MAX_NAME)
    jobset = short(spec.name if spec.name[0].isalpha() else f"js-{spec.name}",
                    MAX_NAME - len(f"-{REPLICATED_JOB}-0-{last}-xxxxx"))
    # One claim name for both flavors: switching flavor keeps the data and checkpoints.
    return {"job": job, "service": service, "jobset": jobset, "configmap": f"{job}-spec", "pvc": f"{job}-work"}


def _escape(value: str) -> str:
    """The kubelet expands $(VAR) in command, args and env; `$$` is its escape for a literal `$`."""
    return value.replace("$", "$$").replace(_RANK_SENTINEL, "$(NODE_RANK)")


def _container(spec: JobSpec, run_id: str, master: str, nproc: int, downward: dict[str, str]) -> dict[str, Any]:
    """downward: env name -> the pod field it comes from; first in the list, so later values can use $(NAME)."""
    # The job's setup runs once the master is up (pod 0: at once), so on the shared volume pod 0 does
    # it and the others find it done.
    argv = with_setup(["python", "-m", TORCHRUN_MODULE,
                       *torchrun_args(spec, run_id=run_id, master_addr=master, nproc=nproc, node_rank=_RANK_SENTINEL)],
                      setup_script(spec.setup, spec.data_paths))
    env = node_env(spec, run_id=run_id, master_addr=master, nproc=nproc, node_rank=_RANK_SENTINEL,
                   interface=spec.network.interface)
    env["HARNESS_RDZV_TIMEOUT"] = str(int(spec.timeouts.rendezvous))
    env_list: list[dict[str, Any]] = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                                      for k, path in downward.items()]
    env_list += [{"name": k, "value": _escape(v)} for k, v in env.items() if k not in downward]
    env_list += secret_env(spec)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKDIR,
        "command": ["/bin/sh", "-c", START_SCRIPT, CONTAINER],
        "args": [_escape(a) for a in argv],
        "env": env_list,
        "ports": [{"name": "rendezvous", "containerPort": planned_port(spec), "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "spec", "mountPath": SPEC_DIR, "readOnly": True},
            {"name": "work", "mountPath": WORKDIR},
        ],
    }
    if resources := pod_resources(spec):
        container["resources"] = resources
    return container


def _indexed_job_spec(spec: JobSpec, names: dict[str, str], nproc: int, shipped: Shipped, *, master: str,
                      subdomain: str, downward: dict[str, str]) -> dict[str, Any]:
    """The Job of both flavors: nnodes pods at once, node rank = completion index, none ever retried alone."""
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.resources.shm_size:
        shm["sizeLimit"] = spec.resources.shm_size
    metadata: dict[str, Any] = {"labels": labels(names)}
    if shipped.annotations:
        metadata["annotations"] = shipped.annotations
    return {
        "completionMode": "Indexed",
        "completions": spec.nnodes,
        "parallelism": spec.nnodes,
        "backoffLimit": 0,
        "podFailurePolicy": copy.deepcopy(POD_FAILURE_POLICY),
        "template": {
            "metadata": metadata,
            "spec": hardened({
                "subdomain": subdomain,
                # Explicit: a JobSet would default it to OnFailure, restarting one node's container alone.
                "restartPolicy": "Never",
                "containers": [_container(spec, names["job"], master, nproc, downward)],
                **on_the_volumes_node(spec, names),
                "volumes": [
                    {"name": "dshm", "emptyDir": shm},
                    {"name": "spec", "configMap": {"name": names["configmap"], "items": shipped.items}},
                    {"name": "work", "persistentVolumeClaim": {"claimName": names["pvc"]}},
                ],
            }),
        },
    }


def _core(spec: JobSpec, names: dict[str, str], nproc: int, shipped: Shipped) -> list[dict[str, Any]]:
    """A headless Service for the pods' DNS names, the bare Job (no restarts: HARNESS_ATTEMPT is 0) and the
    NetworkPolicy that lets the job's own pods alone reach them."""
    common = labels(names)
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": names["service"], "labels": common},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(names),
            "ports": [{"name": "rendezvous", "port": planned_port(spec), "targetPort": planned_port(spec),
                       "protocol": "TCP"}],
        },
    }
    master = f"{names['job']}-0.{names['service']}"
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": names["job"], "labels": common},
        "spec": _indexed_job_spec(spec, names, nproc, shipped, master=master, subdomain=names["service"],
                                  downward={"NODE_RANK": COMPLETION_INDEX}),
    }
    return [service, job, _own_pods_only(names)]


def _own_pods_only(names: dict[str, str]) -> dict[str, Any]:
    """The job's pods reached by the job's own pods alone, on any port: torchrun's store (the rendezvous port) and
    its collectives' data plane (gloo's and NCCL's sockets, on ephemeral ports of each pod). There is no metrics
    port: nothing of the harness runs in these pods."""
    return network_policy(names, CONTAINER, [{"from": [{"podSelector": {"matchLabels": selector(names)}}]}])


def _failure_rules(spec: JobSpec) -> list[dict[str, Any]]:
    """restarts.on as JobSet failure-policy rules, read from the Job's failure reason (POD_FAILURE_POLICY).

    program among the kinds: every failure restarts the set. Otherwise a program failure
    (PodFailurePolicy) fails the set, anything else restarts it (Kubernetes cannot tell a hang).
    Each restart counts against maxRestarts (= restarts.max).
    """
    restart = {"name": "restartOnFailure", "action": "RestartJobSet"}
    if "program" in spec.restarts.on:
        return [restart]
    return [{"name": "failOnProgramFailure", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
            restart | {"name": "restartOnInfraFailure"}]


def _jobset(spec: JobSpec, names: dict[str, str], nproc: int, shipped: Shipped) -> dict[str, Any]:
    """The core Job as the one replicatedJob of a JobSet that recreates it whole on failure.

    No Service of ours: network.enableDNSHostnames makes the JobSet controller create the headless
    Service `subdomain` (publishNotReadyAddresses) itself, owned by the JobSet, so it goes with it.
    The c10d rendezvous id stays the same on every attempt: each attempt's store is new, on the new pod 0.
    """
    subdomain = names["jobset"]
    master = f"{names['jobset']}-{REPLICATED_JOB}-0-0.{subdomain}"  # <jobset>-<replicatedJob>-<job>-<pod>
    job_spec = _indexed_job_spec(spec, names, nproc, shipped, master=master, subdomain=subdomain,
                                 downward={"NODE_RANK": COMPLETION_INDEX, "HARNESS_ATTEMPT": RESTART_ATTEMPT})
    return {
        "apiVersion": JOBSET_API, "kind": "JobSet",
        "metadata": {"name": names["jobset"], "labels": labels(names)},
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": subdomain},
            # Recreate (JobSet's default, explicit here): a restart deletes every Job with its pods and
            # creates them anew, the next attempt in HARNESS_ATTEMPT; a resuming payload (--resume)
            # goes on from the newest checkpoint on the shared volume. restarts.backoff has no JobSet
            # equivalent: a restart starts as soon as the old pods are gone.
            "failurePolicy": {"maxRestarts": spec.restarts.max, "restartStrategy": "Recreate",
                              "rules": _failure_rules(spec)},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"metadata": {"labels": labels(names)}, "spec": job_spec},
            }],
        },
    }


def _files(path: Path) -> Iterator[Path]:
    """path, or the files under it in sorted order without caches and dot-files. A link to a directory
    inside is yielded, not followed (links can loop), and so refused as not a file."""
    if not path.is_dir():
        yield path
        return
    for child in sorted(path.iterdir()):
        if not (child.name.startswith(".") or child.name == "__pycache__" or child.suffix == ".pyc"):
            yield from [child] if child.is_symlink() else _files(child)


def code_files(spec: JobSpec, root: Path) -> dict[str, bytes]:
    """What the pods cannot take from the image, whose /workspace the volume hides: a relative
    entrypoint.script and the `files:` entries, read from root (where `harness render` runs) as
    relative path -> content. An absolute script is the image's. The one reader of the disk here."""
    entries: list[tuple[KeyPath, str]] = [(("files", index), entry) for index, entry in enumerate(spec.files)]
    script = spec.entrypoint.script
    if script is not None and not script.startswith("/"):
        if ".." in PurePosixPath(script).parts:
            raise located(spec.source, ("entrypoint", "script"), f"{script}: a path with '..' cannot be shipped "
                                                                 f"to the pods; run `harness render` in a directory "
                                                                 f"that holds the script and give its path from "
                                                                 f"there, or an absolute path inside the image")
        entries.insert(0, (("entrypoint", "script"), script))
    found: dict[str, bytes] = {}
    for key_path, entry in entries:
        if not (root / entry).exists():
            fix = ("run `harness render` where the script is, or give an absolute path inside the image"
                   if key_path[0] == "entrypoint" else "run `harness render` where it is, or remove it from files:")
            raise located(spec.source, key_path, f"{entry}: not found in {root}; {fix}")
        for path in _files(root / entry):
            relative = path.relative_to(root).as_posix()
            if not path.is_file():
                fix = f"list {relative} under files: itself to follow the link" if path.is_symlink() else \
                    "list the files beside it instead"
                raise located(spec.source, key_path, f"{relative} is not a regular file; {fix}")
            try:
                found[relative] = path.read_bytes()
            except OSError as exc:
                raise located(spec.source, key_path, f"cannot read {relative}: {exc.strerror}") from None
    return dict(sorted(found.items()))


def _code_key(index: int, path: str) -> str:
    """ConfigMap keys allow only [-._a-zA-Z0-9]: a numbered, readable stand-in; its item restores the path."""
    return f"code-{index}-" + re.sub(r"[^-._a-zA-Z0-9]", "_", PurePosixPath(path).name)[:100]  # keys: <= 253


def _configmap(spec: JobSpec, spec_text: str, names: dict[str, str], code: Mapping[str, bytes]
               ) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """The ConfigMap (spec, pod.py, code: text as data, anything else as binaryData) and the volume
    items that lay it out under SPEC_DIR."""
    data = {"job.yaml": spec_text, "pod.py": POD_SOURCE}
    binary: dict[str, str] = {}
    items = [{"key": key, "path": key} for key in data]
    for index, (path, content) in enumerate(sorted(code.items())):
        key = _code_key(index, path)
        try:
            data[key] = content.decode("utf-8")
        except UnicodeDecodeError:
            binary[key] = base64.b64encode(content).decode("ascii")
        items.append({"key": key, "path": f"{CODE_SUBDIR}/{path}"})
    size = len(spec_text.encode()) + len(POD_SOURCE.encode()) + sum(len(content) for content in code.values())
    if size > MAX_CONFIGMAP:
        raise located(spec.source, ("files",) if spec.files else ("entrypoint", "script"),
                      f"the ConfigMap {names['configmap']} would hold {size} bytes (the spec and {len(code)} "
                      f"shipped file(s)), over Kubernetes' limit of {MAX_CONFIGMAP} (1 MiB); bake the code into the "
                      f"image and give entrypoint.script as an absolute path there")
    configmap = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": names["configmap"], "labels": labels(names)},
        "data": data,
    }
    if binary:
        configmap["binaryData"] = binary
    return configmap, items


def _code_digest(code: Mapping[str, bytes]) -> str:
    digest = hashlib.sha256()
    for path, content in sorted(code.items()):
        digest.update(f"{path}\0{len(content)}\0".encode() + content)
    return digest.hexdigest()


def render_manifests(spec: JobSpec, spec_text: str, flavor: Flavor = "core", *, code: Mapping[str, bytes],
                     supervised: bool | None = None) -> list[dict[str, Any]]:
    """ConfigMap (the spec, pod.py and code: what code_files collected), PVC (data + checkpoints, so a
    re-applied job resumes), then the flavor's objects. supervised (default: k8s.supervised): the controller
    and worker pods of targets/k8s/supervised.py; else pods that run torchrun bare: Service + Job (core) or
    JobSet (jobset)."""
    if spec.image is None:
        raise located(spec.source, ("image",), "required to render for Kubernetes: the container image every pod "
                                               "runs (e.g. registry/harness:0.1.0)")
    names = object_names(spec)
    nproc = resolve_nproc(spec, [spec.resources.gpus] * spec.nnodes, ["each pod (resources.gpus)"] * spec.nnodes)
    if spec.backend == "nccl" and not spec.resources.gpus:
        raise located(spec.source, ("resources", "gpus"), "backend nccl needs GPUs: set resources.gpus (GPUs per "
                                                          "pod) to render for Kubernetes")
    configmap, items = _configmap(spec, spec_text, names, code)
    pvc = volume_claim(spec, names)
    shipped = Shipped(items, {CODE_DIGEST: _code_digest(code)} if code else {})
    if spec.k8s.supervised if supervised is None else supervised:
        render = supervised_jobset if flavor == "jobset" else supervised_core
        objects = render(spec, names, shipped, CODE_DIR if code else None)
    elif flavor == "jobset":
        objects = [_jobset(spec.script_under(CODE_DIR), names, nproc, shipped), _own_pods_only(names)]
    else:
        objects = _core(spec.script_under(CODE_DIR), names, nproc, shipped)
    return in_namespace([configmap, pvc, *objects], spec.k8s.namespace)


def pin_note(image: str) -> str:
    """What a render's header says of an image named by tag ("" for one named by digest): a tag names whatever
    was pushed under it last, and each pod pulls the image when it starts, so the pods of one job may run different
    images; a digest names one image. Tags are taken, as people write them, and the header says how to pin one."""
    if "@" in image:
        return ""
    name = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    return (f"# The image {image} is named by a tag, which may name another image by the time a pod pulls it;\n"
            f"# pin it with `image: {name}@sha256:DIGEST`, DIGEST as `docker buildx imagetools inspect {image}` "
            f"prints it.\n")


class _PlainDumper(yaml.SafeDumper):
    """No &anchors/*aliases: every object reads on its own, as people write manifests."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.Node:
    """Lists of numbers (exit codes) on one line, as [129, 130, ...]; everything else in block style."""
    numbers = bool(data) and all(isinstance(item, int) for item in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=numbers)


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    """Text of several lines (the spec, code) as a literal block, as written; PyYAML quotes what a block
    cannot hold exactly."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_PlainDumper.add_representer(list, _list)
_PlainDumper.add_representer(str, _str)


def manifests_yaml(spec: JobSpec, spec_text: str, source: str, flavor: Flavor = "core", *,
                   code: Mapping[str, bytes], command: str | None = None, supervised: bool | None = None) -> str:
    """source: the spec file; command: the command that renders them, where the spec came from flags instead."""
    command = command or \
        f"harness render {source} --target k8s" + (f" --flavor {flavor}" if flavor != "core" else "") + \
        (" --unsupervised" if supervised is False else "")
    header = f"# Rendered by `{command}`; do not edit, re-render. For Kubernetes {MIN_KUBERNETES} or newer.\n"
    header += f"# Namespace {spec.k8s.namespace}, which every object names.\n" if spec.k8s.namespace else \
        "# No namespace named: the objects go to kubectl's (-n NAME, else the context's); k8s.namespace names one.\n"
    header += "".join(f"# Needs its secrets in the namespace first: {line}\n" for line in secret_commands(spec))
    is_supervised = spec.k8s.supervised if supervised is None else supervised
    images = dict.fromkeys([spec.image, *([spec.k8s.controller_image] if is_supervised else [])])
    header += "".join(pin_note(image) for image in images if image)
    pods = 1 + spec.nnodes + spec.k8s.spares if is_supervised else spec.nnodes
    if note := placement_note(spec, pods):
        header += f"# {note}.\n"
    docs = [yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, width=120)
            for doc in render_manifests(spec, spec_text, flavor, code=code, supervised=supervised)]
    return header + "---\n".join(docs)
