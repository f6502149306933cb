"""Kubernetes manifests: valid for the real API schemas, consistent, and a working job when run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from harness.errors import SpecError
from harness.k8s import COMPLETION_INDEX, manifests_yaml, object_names, render_manifests
from harness.spec import DNS1123_LABEL, load_job

from conftest import REPO, free_port, harness

K8S_VERSION = "1.37.0"
SMALL = """
name: {name}
nnodes: 2
backend: gloo
master_port: {port}
image: registry.example/harness:0.1.0
entrypoint:
  script: {script}
  args: [--tag, "two words", "$(not-a-var)", "$$", "${{local_rank}}"]
env:
  STEPS: "6"
"""


def docs(spec_path: Path) -> list[dict]:
    return render_manifests(load_job(spec_path), spec_path.read_text())


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def test_committed_manifests_match_a_fresh_render():
    fresh = manifests_yaml(load_job(REPO / "jobs/cifar.yaml"), (REPO / "jobs/cifar.yaml").read_text(), "jobs/cifar.yaml")
    assert (REPO / "k8s/cifar.yaml").read_text() == fresh, "k8s/ drifted from jobs/cifar.yaml: run `make k8s`"
    assert sorted(p.name for p in (REPO / "k8s").iterdir()) == ["cifar.yaml"]


@pytest.mark.parametrize("source", ["k8s/cifar.yaml", "small"])
def test_strict_schema_validation(source, write_yaml):
    if source == "small":
        objects = docs(write_yaml(SMALL.format(name="small", port=29500, script="train.py")))
    else:
        objects = list(yaml.safe_load_all((REPO / source).read_text()))
    assert [o["kind"] for o in objects] == ["ConfigMap", "PersistentVolumeClaim", "Service", "Job"]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field():
    """The validator is real: a typo'd field fails, so the test above can fail too."""
    job = by_kind(list(yaml.safe_load_all((REPO / "k8s/cifar.yaml").read_text())))["Job"]
    job["spec"]["template"]["spec"]["subDomain"] = job["spec"]["template"]["spec"].pop("subdomain")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def test_objects_agree_with_each_other():
    objects = list(yaml.safe_load_all((REPO / "k8s/cifar.yaml").read_text()))
    kinds = by_kind(objects)
    service, job = kinds["Service"], kinds["Job"]
    pod = job["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    names = [o["metadata"]["name"] for o in objects]
    assert len(set(zip([o["kind"] for o in objects], names, strict=True))) == len(objects)
    assert all(DNS1123_LABEL.fullmatch(n) and len(n) <= 63 for n in names)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert pod["spec"]["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 0
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"] == 1000
    assert {r["action"] for r in job["spec"]["podFailurePolicy"]["rules"]} == {"FailJob"}
    port = service["spec"]["ports"][0]["port"]
    assert port == container["ports"][0]["containerPort"] == int(env["MASTER_PORT"]["value"])
    assert f"--master-port={port}" in container["args"]
    master = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert env["MASTER_ADDR"]["value"] == master and f"--master-addr={master}" in container["args"]
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    assert "--node-rank=$(NODE_RANK)" in container["args"]
    assert container["command"][:2] == ["/bin/sh", "-c"] and 'exec "$@"' in container["command"][2]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "--nproc-per-node=8" in container["args"]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/dev/shm", "/workspace"}
    labels = job["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "harness" and labels["app.kubernetes.io/instance"] == "cifar"


def test_long_names_are_shortened_deterministically_and_stay_unique(write_yaml):
    base = "a" * 60
    first = load_job(write_yaml(SMALL.format(name=base + "-x1", port=29500, script="t.py").replace("nnodes: 2", "nnodes: 100")))
    second = load_job(write_yaml(SMALL.format(name=base + "-x2", port=29500, script="t.py").replace("nnodes: 2", "nnodes: 100")))
    a, b = object_names(first), object_names(second)
    assert a == object_names(first) and a["job"] != b["job"]
    assert len(a["job"]) + len("-99") <= 63 and DNS1123_LABEL.fullmatch(a["job"])


def test_service_name_starts_with_a_letter(write_yaml):
    names = object_names(load_job(write_yaml(SMALL.format(name="7b-finetune", port=29500, script="t.py"))))
    assert names["job"] == "7b-finetune" and names["service"] == "svc-7b-finetune"


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (("image: registry.example/harness:0.1.0\n", ""), SpecError, "job.yaml:1:1: image: required to render for "
                                                                     "Kubernetes"),
        (("backend: gloo", "backend: nccl"), SpecError, "resources.gpus: backend nccl needs GPUs"),
        (("env:\n", "resources: {memory: 4GB}\nenv:\n"), SpecError, "expected a Kubernetes quantity"),
        (("name: small", "name: Small_Job"), SpecError, "expected a DNS-1123 label"),
    ],
)
def test_bad_specs_fail_at_render_time(write_yaml, edit, error, message):
    path = write_yaml(SMALL.format(name="small", port=29500, script="t.py").replace(*edit))
    with pytest.raises(error, match=re.escape(message)):
        render_manifests(load_job(path), path.read_text())


def test_cli_writes_manifests_atomically(write_yaml, tmp_path):
    path = write_yaml(SMALL.format(name="small", port=29500, script="t.py"))
    result = harness("render", str(path), "--target", "k8s", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["small.yaml"]
    bad = harness("render", str(write_yaml("name: x\nnnodes: 1\nentrypoint: {module: m}\n", "bad.yaml")),
                  "--target", "k8s", "--out", str(tmp_path / "none"))
    assert bad.returncode == 2 and "image" in bad.stderr and not (tmp_path / "none").exists()


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


def pod_process(container: dict, index: int, master_dns: str, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """What the kubelet would exec for completion index `index`, with the master's DNS name mapped to loopback."""
    env: dict[str, str] = {}
    for entry in container["env"]:
        if "valueFrom" in entry:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
            env[entry["name"]] = str(index)
        else:
            env[entry["name"]] = kubelet_expand(entry["value"], env)
    argv = [kubelet_expand(a, env) for a in container["command"] + container["args"]]
    swap = {master_dns: "127.0.0.1"}
    argv = [a.replace(master_dns, swap[master_dns]) for a in argv]
    env = {k: v.replace(master_dns, "127.0.0.1") for k, v in env.items()}
    assert container["workingDir"] == "/workspace"
    return argv, env


def test_pods_run_as_rendered_form_a_working_ddp_job(write_yaml, tmp_path):
    """Both pods' command, args and env exactly as written; only the kubelet's substitutions applied."""
    script = REPO / "tests/scripts/ddp_sum.py"
    objects = by_kind(docs(write_yaml(SMALL.format(name="sim", port=free_port(), script=script))))
    container = objects["Job"]["spec"]["template"]["spec"]["containers"][0]
    master_dns = f"{objects['Job']['metadata']['name']}-0.{objects['Service']['metadata']['name']}"
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python` is the image's interpreter
    procs = []
    try:
        for index in (1, 0):  # the worker first: it must wait for the master's port
            argv, env = pod_process(container, index, master_dns, tmp_path)
            procs.append(subprocess.Popen(argv, env=env | {"PATH": path}, cwd=REPO, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    worker, master = outputs
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "waiting for the master's rendezvous port" in worker
    assert "; args=['--tag', 'two words', '$(not-a-var)', '$$', '${local_rank}']" in master
    finals = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", master + worker)
    assert sorted(r for r, _ in finals) == ["0", "1"] and len({w for _, w in finals}) == 1
