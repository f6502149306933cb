"""Every pod the harness renders passes the Pod Security Standard "restricted"
(kubernetes.io/docs/concepts/security/pod-security-standards): a namespace that enforces it (the label
pod-security.kubernetes.io/enforce: restricted) admits them. The rules below are the standard's controls, Baseline's
and Restricted's, each with the fields it restricts and the values it allows, as its text gives them. Beyond the
standard, what policy scanners flag (kube-score, Checkov, kubesec): a low uid or gid, a writable root file system,
an object without a namespace, an image by tag."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from harness.spec.job import load_job
from harness.targets.k8s.manifests import manifests_yaml, render_manifests
from harness.targets.k8s.objects import HOME_DIR, TMP_DIR
from testbed.kubelet import jobs_by_name

from conftest import REPO

# Baseline, "Capabilities": what a container may add.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                         "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
# Baseline, "SELinux": the types a pod or container may ask for.
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# Baseline, "Sysctls": the safe set.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
# Restricted, "Volume Types": the only ones allowed.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}
HIGH_ID = 10000  # scanners' line (kube-score, Checkov CKV_K8S_40): above it, no host user's uid or gid
RENDERS = [("core", True), ("jobset", True), ("core", False), ("jobset", False)]  # (flavor, supervised)


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What in a pod spec the standard's "restricted" level refuses (empty: the pod is admitted)."""
    found: list[str] = []
    pod_context = pod.get("securityContext", {})
    containers = [(f"{kind}[{c.get('name')}]", c) for kind in ("containers", "initContainers", "ephemeralContainers")
                  for c in pod.get(kind, [])]
    contexts = [(name, c.get("securityContext", {})) for name, c in containers]
    # Baseline
    for where, context in [("pod", pod_context), *contexts]:
        if context.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{where}: HostProcess")
        if (context.get("seLinuxOptions", {}).get("type") or "") not in SELINUX_TYPES or \
                {"user", "role"} & context.get("seLinuxOptions", {}).keys():
            found.append(f"{where}: SELinux options")
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{where}: seccomp Unconfined")
        if context.get("appArmorProfile", {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            found.append(f"{where}: AppArmor profile")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            found.append(f"pod: {key}")
    for name, context in contexts:
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if set(context.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES:
            found.append(f"{name}: capabilities beyond Baseline's")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount")
    found += [f"{name}: hostPort" for name, c in containers for port in c.get("ports", []) if port.get("hostPort")]
    found += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    found += [f"pod: sysctl {s['name']}" for s in pod_context.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    # Restricted
    for volume in pod.get("volumes", []):
        if not (volume.keys() - {"name"}) <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: type {sorted(volume.keys() - {'name'})}")
    for name, context in contexts:
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []) or set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities not dropped (drop [ALL], add NET_BIND_SERVICE at most)")
        if context.get("runAsNonRoot") is False or (not pod_context.get("runAsNonRoot") and
                                                    not context.get("runAsNonRoot")):
            found.append(f"{name}: may run as root (runAsNonRoot)")
        if 0 in (pod_context.get("runAsUser"), context.get("runAsUser")):
            found.append(f"{name}: runAsUser 0")
        seccomp = context.get("seccompProfile", pod_context.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccomp profile {seccomp} (RuntimeDefault or Localhost)")
    return found


def rendered_pods(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(the Job's name, its pod spec) of every Job and JobSet replicated Job, and every bare Pod."""
    for name, job in jobs_by_name(objects).items():
        yield name, job["template"]["spec"]
    for pod in (o for o in objects if o["kind"] == "Pod"):
        yield pod["metadata"]["name"], pod["spec"]


@pytest.mark.parametrize("job", ["cifar.yaml", "k8s-smoke.yaml"])  # k8s-smoke: the controller's resources, ReadWriteOnce
@pytest.mark.parametrize(("flavor", "supervised"), RENDERS)
def test_every_rendered_pod_passes_the_restricted_standard(job: str, flavor: str, supervised: bool) -> None:
    path = REPO / "jobs" / job
    objects = render_manifests(load_job(path), path.read_text(), flavor, code={},  # type: ignore[arg-type]
                               supervised=supervised)
    pods = dict(rendered_pods(objects))
    assert len(pods) == (2 if supervised else 1), pods.keys()
    assert {name: restricted_violations(pod) for name, pod in pods.items()} == {name: [] for name in pods}
    assert all(pod["automountServiceAccountToken"] is False for pod in pods.values()), "nothing in them calls the API"


def test_the_committed_manifests_pass_it_and_the_rules_refuse_what_the_standard_refuses() -> None:
    objects = list(yaml.safe_load_all((REPO / "k8s" / "cifar.yaml").read_text()))
    pods = dict(rendered_pods(objects))
    assert pods and all(restricted_violations(pod) == [] for pod in pods.values())
    pod = next(iter(pods.values()))
    container = pod["containers"][0]
    loose = {**pod, "hostNetwork": True, "securityContext": {"runAsUser": 0},
             "volumes": [*pod["volumes"], {"name": "host", "hostPath": {"path": "/"}}],
             "containers": [{**container, "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
                             "ports": [{"containerPort": 1, "hostPort": 80}]}]}
    name = f"containers[{container['name']}]"
    assert restricted_violations(loose) == [
        "pod: hostNetwork", f"{name}: privileged", f"{name}: capabilities beyond Baseline's", f"{name}: hostPort",
        "volume host: hostPath", "volume host: type ['hostPath']", f"{name}: allowPrivilegeEscalation is not false",
        f"{name}: capabilities not dropped (drop [ALL], add NET_BIND_SERVICE at most)",
        f"{name}: may run as root (runAsNonRoot)", f"{name}: runAsUser 0",
        f"{name}: seccomp profile None (RuntimeDefault or Localhost)"]


def scanner_findings(objects: list[dict[str, Any]]) -> list[str]:
    """What a policy scanner flags in a render: an object without a namespace, a pod or container whose uid or gid
    may be a host user's (below HIGH_ID, or unset), a container whose root file system is writable, an image by
    tag; and a pod that could not run so: HOME or /tmp not on a volume of its own."""
    found = [f"{o['kind']} {o['metadata']['name']}: no namespace" for o in objects if "namespace" not in o["metadata"]]
    for name, pod in rendered_pods(objects):
        pod_context = pod.get("securityContext", {})
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        for container in pod["containers"]:
            where, context = f"{name}/{container['name']}", container.get("securityContext", {})
            for key in ("runAsUser", "runAsGroup"):
                if context.get(key, pod_context.get(key, 0)) < HIGH_ID:
                    found.append(f"{where}: {key} below {HIGH_ID}")
            if context.get("readOnlyRootFilesystem") is not True:
                found.append(f"{where}: writable root file system")
            if "@sha256:" not in container["image"]:
                found.append(f"{where}: image by tag")
            env = {entry["name"]: entry.get("value") for entry in container["env"]}
            own = {mount["mountPath"] for mount in container["volumeMounts"] if "emptyDir" in volumes[mount["name"]]}
            if not {TMP_DIR, env.get("HOME")} <= own:
                found.append(f"{where}: HOME ({env.get('HOME')}) or {TMP_DIR} not an emptyDir of its own")
    return found


DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(("flavor", "supervised"), RENDERS)
def test_a_scanner_finds_nothing_in_a_render_with_a_namespace_and_images_by_digest(write_yaml, flavor: str,
                                                                                    supervised: bool) -> None:
    """High uid and gid (the image's own: test_image.py), a read-only root file system with HOME and /tmp on
    emptyDirs of the pod's own, every object in the namespace k8s.namespace names, images by digest. The same job
    without them: the scanner's rules are real (each finding is there), and the header says how to pin the tag."""
    text = (REPO / "jobs/cifar.yaml").read_text().replace("image: ghcr.io/example/harness:0.1.0",
                                                           f"image: ghcr.io/example/harness@{DIGEST}")
    assert f"@{DIGEST}" in text
    pinned = write_yaml(text + "k8s: {namespace: ml-jobs}\n")
    objects = render_manifests(load_job(pinned), pinned.read_text(), flavor, code={},  # type: ignore[arg-type]
                               supervised=supervised)
    assert scanner_findings(objects) == []
    assert {o["metadata"]["namespace"] for o in objects} == {"ml-jobs"}
    pods = dict(rendered_pods(objects))
    assert all(env["value"] == HOME_DIR for pod in pods.values() for container in pod["containers"]
               for env in container["env"] if env["name"] == "HOME")

    path = REPO / "jobs/cifar.yaml"
    tagged = render_manifests(load_job(path), path.read_text(), flavor, code={},  # type: ignore[arg-type]
                              supervised=supervised)
    findings = scanner_findings(tagged)
    assert {f.split(": ", 1)[1] for f in findings} == {"no namespace", "image by tag"}
    assert sum(f.endswith("image by tag") for f in findings) == len(pods)
    loose = {**pods[next(iter(pods))], "securityContext": {}}
    loose["containers"] = [{**c, "securityContext": {}, "volumeMounts": c["volumeMounts"][:1]} for c in loose["containers"]]
    name = loose["containers"][0]["name"]
    assert {f.split(": ", 1)[1] for f in scanner_findings([{"kind": "Pod", "metadata": {"name": "p", "namespace": "n"},
                                                           "spec": loose}]) if f.startswith(f"p/{name}")} == {
        f"runAsUser below {HIGH_ID}", f"runAsGroup below {HIGH_ID}", "writable root file system",
        f"HOME ({HOME_DIR}) or {TMP_DIR} not an emptyDir of its own"}


def test_the_header_says_the_namespace_or_where_the_objects_go_and_how_to_pin_an_image_by_tag(write_yaml) -> None:
    path = REPO / "jobs/cifar.yaml"
    header = [line for line in manifests_yaml(load_job(path), path.read_text(), "jobs/cifar.yaml", code={}).splitlines()
              if line.startswith("#")]
    assert header[1] == "# No namespace named: the objects go to kubectl's (-n NAME, else the context's); " \
                        "k8s.namespace names one."
    assert header[2:4] == [
        "# The image ghcr.io/example/harness:0.1.0 is named by a tag, which may name another image by the time a pod "
        "pulls it;",
        "# pin it with `image: ghcr.io/example/harness@sha256:DIGEST`, DIGEST as `docker buildx imagetools inspect "
        "ghcr.io/example/harness:0.1.0` prints it."]
    text = path.read_text().replace("image: ghcr.io/example/harness:0.1.0", f"image: ghcr.io/example/harness@{DIGEST}")
    text += "k8s: {namespace: ml-jobs}\nsecrets: {HF_TOKEN: }\n"
    pinned = write_yaml(text)
    header = [line for line in manifests_yaml(load_job(pinned), text, str(pinned), code={}).splitlines()
              if line.startswith("#")]
    assert header[1:] == ["# Namespace ml-jobs, which every object names.",
                          "# Needs its secrets in the namespace first: kubectl create secret generic -n ml-jobs "
                          "cifar-secrets --from-literal=HF_TOKEN=..."]
