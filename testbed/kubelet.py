"""A kubelet's part, played on this machine: what it makes of rendered Kubernetes manifests (the ConfigMap's
files, the downward API, $(VAR) expansion, the container's command, env and working directory) and pods run
as processes exactly so, for the tests (tests/integration/test_k8s_pods.py) and the benchmarks (bench/k8s.py).
Optionally each pod on a host of a testbed Cluster, a network namespace of its own, where the controller's
Service name resolves as the cluster's DNS would resolve it."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import subprocess
import time
from pathlib import Path

from harness.targets.k8s.objects import COMPLETION_INDEX, TMP_DIR
from testbed.cluster import Cluster

SHARED_PATHS = (TMP_DIR, "/dev/shm")  # an emptyDir here is played by this machine's own directory


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def pod_dns(objects: list[dict], index: int) -> str:
    """Pod `index`'s DNS name as the cluster makes it: hostname (core: the Job's pod hostname
    `<job>-<index>`; JobSet: `<jobset>-<replicatedJob>-<jobIndex>-<index>`) + its Service (subdomain)."""
    kinds = by_kind(objects)
    if "JobSet" in kinds:
        jobset = kinds["JobSet"]
        hostname = f"{jobset['metadata']['name']}-{jobset['spec']['replicatedJobs'][0]['name']}-0-{index}"
        return f"{hostname}.{jobset['spec']['network']['subdomain']}"
    return f"{kinds['Job']['metadata']['name']}-{index}.{kinds['Service']['metadata']['name']}"


def job_spec(objects: list[dict]) -> dict:
    kinds = by_kind(objects)
    return kinds["Job"]["spec"] if "Job" in kinds else kinds["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: `$$` is a literal `$`, unknown references stay as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i)) != -1:
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def materialize(objects: list[dict], root: Path) -> dict[str, str]:
    """What the kubelet writes for the pod's ConfigMap volume: every item's value at its path under the
    mount, here under root; and an empty directory under root for each emptyDir but those at a path every process
    of this machine has alike (/tmp, /dev/shm), which stand for themselves. Returns mount path -> the directory
    standing for it."""
    configmap = by_kind(objects)["ConfigMap"]
    pod = job_spec(objects)["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {}
    for mount in pod["containers"][0]["volumeMounts"]:
        if "emptyDir" in volumes[mount["name"]] and mount["mountPath"] not in SHARED_PATHS:
            (local := root / mount["mountPath"].lstrip("/")).mkdir(parents=True, exist_ok=True)
            mounts[mount["mountPath"]] = str(local)
        source = volumes[mount["name"]].get("configMap")
        if source is None:
            continue
        assert source["name"] == configmap["metadata"]["name"] and mount["readOnly"]
        local = root / mount["mountPath"].lstrip("/")
        for item in source["items"]:
            assert not item["path"].startswith("/") and ".." not in item["path"].split("/")  # the API's rules
            target = local / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            if item["key"] in configmap["data"]:
                target.write_bytes(configmap["data"][item["key"]].encode())
            else:
                target.write_bytes(base64.b64decode(configmap["binaryData"][item["key"]]))
        mounts[mount["mountPath"]] = str(local)
    return mounts


def in_pod(text: str, mounts: dict[str, str]) -> str:
    """text with each mount path swapped for the directory that stands for it here."""
    for mount_path, local in mounts.items():
        text = text.replace(mount_path, local)
    return text


def value_from(source: dict, fields: dict[str, str], secrets: dict[tuple[str, str], str]) -> str:
    """An env entry's valueFrom: a downward-API field, or a key of a Secret of the namespace (secrets: (name, key) ->
    value); a Secret or key that is not there keeps the container from starting (CreateContainerConfigError)."""
    if "fieldRef" in source:
        return fields[source["fieldRef"]["fieldPath"]]
    ref = source["secretKeyRef"]
    if (ref["name"], ref["key"]) not in secrets:
        raise LookupError(f"CreateContainerConfigError: secret {ref['name']!r} has no key {ref['key']!r}")
    return secrets[ref["name"], ref["key"]]


def pod_process(container: dict, fields: dict[str, str], master_dns: str, mounts: dict[str, str],
                secrets: dict[tuple[str, str], str] | None = None) -> tuple[list[str], dict[str, str]]:
    """What the kubelet would exec in a pod whose downward-API fields have these values (and the namespace these
    Secrets), with the master's DNS name mapped to loopback and the ConfigMap's mount paths to where materialize
    wrote them."""
    env: dict[str, str] = {}
    for entry in container["env"]:
        if "valueFrom" in entry:
            env[entry["name"]] = value_from(entry["valueFrom"], fields, secrets or {})
        else:
            env[entry["name"]] = kubelet_expand(entry["value"], env)
    argv = [kubelet_expand(a, env) for a in container["command"] + container["args"]]
    swap = mounts | {master_dns: "127.0.0.1"}
    argv = [in_pod(a, swap) for a in argv]
    env = {k: in_pod(v, swap) for k, v in env.items()}
    assert container["workingDir"] == "/workspace"
    return argv, env


def run_pods(objects: list[dict], fields: dict[str, str], root: Path, workspace: Path, path: str,
             secrets: dict[tuple[str, str], str] | None = None) -> list[str]:
    """Both pods as real processes, the worker first (it must wait for the master's port), in workspace
    (their shared volume) with `python` found on path; their outputs, worker first, once both exit 0."""
    container = job_spec(objects)["template"]["spec"]["containers"][0]
    mounts = materialize(objects, root)
    procs = []
    try:
        for index in (1, 0):
            argv, env = pod_process(container, fields | {COMPLETION_INDEX: str(index)}, pod_dns(objects, 0), mounts,
                                    secrets)
            assert env["NODE_RANK"] == str(index)
            procs.append(subprocess.Popen(argv, env=env | {"PATH": path}, cwd=workspace, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs


def jobs_by_name(objects: list[dict]) -> dict[str, dict]:
    """Every Job's spec by its name, a JobSet's replicatedJobs' by theirs."""
    found = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Job"}
    for jobset in (o for o in objects if o["kind"] == "JobSet"):
        found |= {r["name"]: r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]}
    return found


class SupervisedPods:
    """A supervised job's pods as processes, each with exactly its container's command, args, env and working
    directory, and only the kubelet's substitutions: the downward API's fields, the ConfigMap's files and the
    volume (under root and workspace). With a cluster, worker pod i runs on its host i (a network namespace
    of its own, with its hostname), the controller's pod on the machine's own namespace (the bridge's gateway
    address), and the controller's Service name resolves to it on every host (their /etc/hosts, as the
    cluster's DNS would); without one, every pod is on loopback and that name is 127.0.0.1 in their args.
    secrets: the namespace's Secrets, (name, key) -> value, for the pods' secretKeyRefs.
    The caller plays the Job controller: a deleted pod (SIGTERM, its grace period, SIGKILL) is recreated with
    its index under a new name. python: the `python` (and `harness`) each image has, a directory put first on
    PATH. A context manager: on exit every pod is killed and the hosts' files restored."""

    def __init__(self, objects: list[dict], root: Path, workspace: Path, controller_path: Path,
                 worker_path: Path, cluster: Cluster | None = None,
                 secrets: dict[tuple[str, str], str] | None = None) -> None:
        jobs = jobs_by_name(objects)
        self.controller_job = next(spec for name, spec in jobs.items() if not _is_workers(spec))
        self.worker_job = next(spec for spec in jobs.values() if _is_workers(spec))
        jobset = next((o["metadata"]["name"] for o in objects if o["kind"] == "JobSet"), None)
        workers = next(name for name, spec in jobs.items() if _is_workers(spec))
        self.worker_prefix = f"{jobset}-{workers}-0" if jobset else workers  # <jobset>-<replicatedJob>-<job index>
        self.mounts = materialize(objects, root) | {"/workspace": str(workspace)}
        self.workspace = workspace
        self.paths = {"controller": controller_path, "worker": worker_path}
        self.controller_dns = self.worker_job["template"]["spec"]["containers"][0]["args"][1]
        self.cluster = cluster
        self.secrets = secrets or {}  # the namespace's Secrets: (name, key) -> value
        self.processes: dict[str, subprocess.Popen[str]] = {}
        self.containers: dict[str, tuple[dict, dict[str, str], Path]] = {}
        self.logs: dict[str, Path] = {}
        self._made = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> SupervisedPods:
        if self.cluster is not None:
            for host in self.cluster.hosts:
                self._stack.enter_context(self.cluster.hosts_entries(host, [f"{self.cluster.gateway} "
                                                                            f"{self.controller_dns}"]))
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
        self._stack.close()

    def _exec(self, container: dict, fields: dict[str, str], path: Path,
              command: list[str]) -> tuple[list[str], dict[str, str]]:
        """A command as the kubelet runs it in the container: $(VAR) expanded, the container's env (downward API
        fields filled in), the mounts mapped to here (and the controller's name, on loopback)."""
        env: dict[str, str] = {}
        for entry in container.get("env", []):
            if "valueFrom" in entry:
                env[entry["name"]] = value_from(entry["valueFrom"], fields, self.secrets)
            else:
                env[entry["name"]] = in_pod(kubelet_expand(entry["value"], env), self.mounts)
        argv = [kubelet_expand(a, env) for a in command]
        loopback = self.cluster is None
        argv = ["127.0.0.1" if loopback and a == self.controller_dns else in_pod(a, self.mounts) for a in argv]
        assert container["workingDir"] == "/workspace"
        return argv, {"PATH": f"{path}:{os.environ['PATH']}", "HOME": str(self.workspace.parent)} | env

    def _start(self, name: str, container: dict, fields: dict[str, str], path: Path,
               index: int | None = None) -> subprocess.Popen[str]:
        argv, env = self._exec(container, fields, path, container["command"] + container.get("args", []))
        if self.cluster is not None and index is not None:  # in the host's namespaces, in the pod's workingDir
            argv = self.cluster.login(self.cluster.hosts[index], ["env", "-C", str(self.workspace), *argv])
        log = self.workspace.parent / f"{name}.log"
        self.logs[name] = log
        self.containers[name] = (container, fields, path)
        with log.open("w") as out:
            process = subprocess.Popen(argv, env=env, cwd=self.workspace, stdout=out, stderr=subprocess.STDOUT,
                                       text=True, start_new_session=True)
        self.processes[name] = process
        return process

    def pre_stop(self, name: str, timeout: float) -> subprocess.CompletedProcess[str] | None:
        """The container's preStop hook, run as the kubelet runs it before the pod's SIGTERM (None: it has none)."""
        container, fields, path = self.containers[name]
        hook = container.get("lifecycle", {}).get("preStop", {}).get("exec")
        if hook is None:
            return None
        argv, env = self._exec(container, fields, path, hook["command"])
        return subprocess.run(argv, env=env, cwd=self.workspace, capture_output=True, text=True, timeout=timeout)

    def controller(self, name: str = "controller") -> subprocess.Popen[str]:
        """The controller's pod; name: a later one's, as the Job controller makes it when the first is lost."""
        container = self.controller_job["template"]["spec"]["containers"][0]
        return self._start(name, container, {}, self.paths["controller"])

    def lose(self, name: str) -> int:
        """The pod gone with its Kubernetes node: every process of it killed at once, no hook, no SIGTERM."""
        process = self.processes[name]
        os.killpg(process.pid, 9)
        return process.wait()

    def worker(self, index: int, dials: tuple[str, int] | None = None) -> str:
        """A worker pod with completion index `index`, named as the Job controller names it; its name. dials: where
        the controller's Service name leads it instead (an address and port another process answers at)."""
        self._made += 1
        name = f"{self.worker_prefix}-{index}-p{self._made:04d}"
        container = self.worker_job["template"]["spec"]["containers"][0]
        if dials is not None:
            args = list(container["args"])
            args[1:3] = [dials[0], str(dials[1])]
            container = container | {"args": args}
        self._start(name, container, {"metadata.name": name, COMPLETION_INDEX: str(index),
                                      "spec.nodeName": f"kube-node-{index}"}, self.paths["worker"], index)
        return name

    def grace(self, name: str) -> float:
        """The pod's terminationGracePeriodSeconds."""
        job = self.controller_job if name.startswith("controller") else self.worker_job
        return float(job["template"]["spec"]["terminationGracePeriodSeconds"])

    def delete(self, name: str) -> int:
        """What `kubectl delete pod` does to it: its preStop hook, SIGTERM, then SIGKILL once its grace period
        has passed; its exit code."""
        started = time.monotonic()
        self.pre_stop(name, self.grace(name))
        process = self.processes[name]
        process.terminate()
        try:
            return process.wait(timeout=max(0.0, self.grace(name) - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            return process.wait()

    def output(self, name: str) -> str:
        return self.logs[name].read_text()

    def end(self) -> None:
        """Whatever still runs is killed, its process group with it (a test's failure leaves nothing)."""
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, 9)
                process.wait()


def _is_workers(job: dict) -> bool:
    return job.get("completionMode") == "Indexed"


def wait_for_line(pods: SupervisedPods, name: str, pattern: str, timeout: float) -> re.Match[str]:
    """The first match of pattern (multi-line) in a pod's output so far, as soon as it is there."""
    deadline = time.monotonic() + timeout
    while True:
        if found := re.search(pattern, pods.output(name), re.M):
            return found
        if pods.processes[name].poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{pattern!r} not in {name}'s output:\n{pods.output(name)}")
        time.sleep(0.1)
