"""Kubernetes manifests: valid for the real API schemas, consistent, and a working job when run."""

from __future__ import annotations

import base64
import os
import re
import struct
import subprocess
import sys
import sysconfig
import textwrap
import typing
from pathlib import Path
from typing import Any

import kubernetes_validate
import pydantic
import pytest
import yaml
from kubeflow_trainer_api.models import (
    JobsetV1alpha2FailurePolicy,
    JobsetV1alpha2FailurePolicyRule,
    JobsetV1alpha2JobSet,
)

from harness.errors import SpecError
from harness.spec.job import DNS1123_LABEL, load_job
from harness.targets.k8s.manifests import (
    CODE_DIGEST,
    CODE_DIR,
    COMPLETION_INDEX,
    JOBSET_API,
    MAX_CONFIGMAP,
    POD_FAILURE_POLICY,
    RDZV_WAIT_EXIT,
    REPLICATED_JOB,
    RESTART_ATTEMPT,
    START_SCRIPT,
    code_files,
    manifests_yaml,
    object_names,
    render_manifests,
)

from conftest import REPO, free_port, harness

K8S_VERSION = "1.37.0"
# The JobSet API: kubeflow-trainer-api 2.3.0 (pinned in the test extra) carries models generated from the
# v1alpha2 Go types of sigs.k8s.io/jobset v0.12.0, the version Kubeflow Trainer 2.3.0's go.mod requires.
# The JobSet SDK itself is not on PyPI. Its annotation key for the restart attempt lives in the controller
# (pkg/constants RestartsKey, set as label and annotation on every pod), not in the API types.
RESTART_ATTEMPT_KEY = "jobset.sigs.k8s.io/restart-attempt"
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
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
# A user's own job, as a directory `harness render` runs in: a DDP script, the module beside it and its
# configs (text and binary), listed under files:. Pods get it from the ConfigMap alone.
USER_FILES = {
    "train.py": textwrap.dedent("""\
        import importlib.util
        import json
        import os
        import struct
        import sys
        from pathlib import Path

        import torch
        import torch.distributed as dist

        from model import build  # model.py, beside this script

        here = Path(__file__).parent
        config = json.loads((here / "configs" / "run.json").read_text())
        init = struct.unpack("<5f", (here / "configs" / "weights" / "init.bin").read_bytes()[1:])
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        print(f"rank {rank}: harness importable: {importlib.util.find_spec('harness') is not None}; "
              f"cwd {os.getcwd()}; PYTHONPATH {os.environ.get('PYTHONPATH')}; args {sys.argv[1:]}", flush=True)
        model = torch.nn.parallel.DistributedDataParallel(build(init))
        opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
        target = torch.tensor([1.0, -2.0, 3.0, 0.5])
        for step in range(config["steps"]):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step * 2 + rank))
            loss = ((model(x).squeeze(1) - x @ target) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        weights = model.module.weight.detach().flatten().tolist()
        print(f"rank {rank} final loss {loss.item():.4f} weights {weights}", flush=True)
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # as tests/scripts/ddp_sum.py: no finalization under a gloo thread
        """).encode(),
    "model.py": textwrap.dedent("""\
        import torch


        def build(init):
            layer = torch.nn.Linear(4, 1)
            with torch.no_grad():
                layer.weight.copy_(torch.tensor([init[:4]]))
                layer.bias.fill_(init[4])
            return layer
        """).encode(),
    "configs/run.json": b'{"steps": 6, "lr": 0.05}\n',
    "configs/weights/init.bin": b"\xff" + struct.pack("<5f", 0.5, -0.5, 0.25, 1.0, 0.0),  # not UTF-8: binaryData
}
USER_JOB = """
name: own
nnodes: 2
backend: gloo
master_port: {port}
image: python:3.11-slim
entrypoint:
  script: train.py
  args: [--tag, "two words"]
files: [model.py, configs/]
env:
  PYTHONPATH: /opt/site
"""


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(content)


def docs(spec_path: Path, flavor: str = "core") -> list[dict]:
    """The manifests `harness render` makes in the spec's directory (its code read from there)."""
    spec = load_job(spec_path)
    return render_manifests(spec, spec_path.read_text(), flavor, code=code_files(spec, spec_path.parent))


def small(write_yaml, extra: str = "", script: str = "train.py", name: str = "small", port: int = 29500) -> Path:
    """SMALL as a user has it: beside its script."""
    path = write_yaml(SMALL.format(name=name, port=port, script=script) + extra)
    if not script.startswith("/"):
        (path.parent / script).write_text("print('hello')\n")
    return path


def render_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`harness render` run in directory (where the job's code is), with this checkout's harness."""
    return harness("render", *args, cwd=directory, env=os.environ | {"PYTHONPATH": str(REPO)})


def cifar(flavor: str) -> list[dict]:
    """jobs/cifar.yaml as committed under k8s/ (core), or rendered fresh (jobset)."""
    if flavor == "core":
        return list(yaml.safe_load_all((REPO / "k8s/cifar.yaml").read_text()))
    return docs(REPO / "jobs/cifar.yaml", flavor)


def template_as_job(jobset: dict) -> dict:
    """The JobSet's Job template as the batch/v1 Job the controller makes of it (named as it names it)."""
    replicated = jobset["spec"]["replicatedJobs"][0]
    name = f"{jobset['metadata']['name']}-{replicated['name']}-0"
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, **replicated["template"]["metadata"]},
            "spec": replicated["template"]["spec"]}


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


def test_committed_manifests_match_a_fresh_render():
    spec = load_job(REPO / "jobs/cifar.yaml")
    fresh = manifests_yaml(spec, (REPO / "jobs/cifar.yaml").read_text(), "jobs/cifar.yaml", code=code_files(spec, REPO))
    assert (REPO / "k8s/cifar.yaml").read_text() == fresh, "k8s/ drifted from jobs/cifar.yaml: run `make k8s`"
    assert sorted(p.name for p in (REPO / "k8s").iterdir()) == ["cifar.yaml"]


@pytest.mark.parametrize("flavor", ["core", "jobset"])
@pytest.mark.parametrize("source", ["cifar", "small"])
def test_strict_schema_validation(source, flavor, write_yaml, tmp_path):
    """Every core object, and the JobSet's Job template as a Job, against Kubernetes' own schema."""
    if source == "small":
        write_files(tmp_path, USER_FILES)
        spec_text = SMALL.format(name="small", port=29500, script="train.py") + "files: [model.py, configs/]\n"
        objects = docs(write_yaml(spec_text), flavor)
        assert by_kind(objects)["ConfigMap"]["binaryData"]
    else:
        objects = cifar(flavor)
    kinds = {"core": ["Service", "Job"], "jobset": ["JobSet"]}[flavor]
    assert [o["kind"] for o in objects] == ["ConfigMap", "PersistentVolumeClaim", *kinds]
    for obj in objects:
        kubernetes_validate.validate(template_as_job(obj) if obj["kind"] == "JobSet" else obj, K8S_VERSION,
                                     strict=True)


def test_strict_validation_rejects_an_unknown_field():
    """The validator is real: a typo'd field fails, so the test above can fail too."""
    job = by_kind(list(yaml.safe_load_all((REPO / "k8s/cifar.yaml").read_text())))["Job"]
    job["spec"]["template"]["spec"]["subDomain"] = job["spec"]["template"]["spec"].pop("subdomain")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def field_problems(model: type[pydantic.BaseModel], data: dict, path: str) -> list[str]:
    """Every key, at any depth, that the API's model does not declare, and every required one missing
    (its from_dict drops the first silently and fills the second in with '')."""
    declared = {field.alias or name: field.annotation for name, field in model.model_fields.items()}
    required = [field.alias or name for name, field in model.model_fields.items() if field.is_required()]
    found = [f"{path}.{key}: required" for key in required if key not in data]
    for key, value in data.items():
        if key in declared:
            found += _problems_in(declared[key], value, f"{path}.{key}")
        else:
            found.append(f"{path}.{key}")
    return found


def _problems_in(annotation: Any, value: Any, path: str) -> list[str]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, typing.Annotated):  # Optional[X], Annotated[str, Strict()]
        return _problems_in(next(a for a in args if a is not type(None)), value, path)
    if origin is list:
        return [f for i, item in enumerate(value) for f in _problems_in(args[0], item, f"{path}[{i}]")]
    if origin is dict:
        return [f for key, item in value.items() for f in _problems_in(args[1], item, f"{path}[{key}]")]
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel) \
            and "actual_instance" not in annotation.model_fields:  # oneOf wrappers (quantities) hold plain values
        return field_problems(annotation, value, path)
    return []


def api_problems(jobset: dict) -> list[str]:
    """The JobSet against the published v1alpha2 API: unknown fields anywhere, wrong types and missing
    required fields (pydantic), and values outside the enums that the API documents."""
    problems = field_problems(JobsetV1alpha2JobSet, jobset, "JobSet")
    try:
        JobsetV1alpha2JobSet.from_dict(jobset)
    except pydantic.ValidationError as exc:
        problems.append(str(exc))
    actions = re.search(r"Valid values are ([\w, ]+)\.", JobsetV1alpha2FailurePolicyRule.model_fields["action"].description)
    assert actions is not None, "the API no longer lists the valid actions"
    policy = jobset["spec"].get("failurePolicy", {})
    problems += [f"action {r['action']!r} is not one of {actions.group(1)}" for r in policy.get("rules", [])
                 if r["action"] not in actions.group(1).split(", ")]
    strategy = JobsetV1alpha2FailurePolicy.model_fields["restart_strategy"].description
    if policy.get("restartStrategy") not in (None, *re.findall(r"Defaults to (\w+)\.", strategy)):
        problems.append(f"restartStrategy {policy['restartStrategy']!r} is not the API's documented default")
    return problems


@pytest.mark.parametrize("source", ["cifar", "small"])
def test_jobset_fields_match_the_published_api(source, write_yaml):
    objects = docs(small(write_yaml), "jobset") if source == "small" else cifar("jobset")
    jobset = by_kind(objects)["JobSet"]
    assert jobset["apiVersion"] == JOBSET_API == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
    assert api_problems(jobset) == []


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda s: s["failurePolicy"].update(maxRestart=s["failurePolicy"].pop("maxRestarts")), "JobSet.spec.failurePolicy.maxRestart"),
        (lambda s: s["network"].update(enableDnsHostnames=True), "JobSet.spec.network.enableDnsHostnames"),
        (lambda s: s["replicatedJobs"][0]["template"]["spec"]["template"]["spec"].update(subDomain="x"),
         "JobSet.spec.replicatedJobs[0].template.spec.template.spec.subDomain"),
        (lambda s: s["failurePolicy"].update(maxRestarts="2"), "maxRestarts\n  Input should be a valid integer"),
        (lambda s: s["failurePolicy"]["rules"][0].pop("name"), "JobSet.spec.failurePolicy.rules[0].name: required"),
        (lambda s: s["failurePolicy"]["rules"][0].update(action="RestartGroup"), "action 'RestartGroup' is not one of"),
        (lambda s: s["failurePolicy"].update(restartStrategy="Restart"), "restartStrategy 'Restart'"),
    ],
)
def test_api_check_rejects_what_the_api_does_not_have(edit, problem):
    """The API check is real: a typo'd or mistyped field or an unknown value fails it, at any depth."""
    jobset = by_kind(cifar("jobset"))["JobSet"]
    edit(jobset["spec"])
    assert any(problem in p for p in api_problems(jobset)), api_problems(jobset)


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
    assert job["spec"]["podFailurePolicy"] == POD_FAILURE_POLICY
    assert env["HARNESS_ATTEMPT"]["value"] == "0"  # no restarts: backoffLimit 0, nothing recreates the Job
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


def test_the_jobset_runs_the_core_job():
    """One Job builder: the JobSet's template is the core Job but for where the master is and the attempt."""
    core, jobset = cifar("core"), cifar("jobset")
    core_text = yaml.safe_dump(job_spec(core)).replace(pod_dns(core, 0), pod_dns(jobset, 0))
    core_text = core_text.replace(f"subdomain: {by_kind(core)['Service']['metadata']['name']}",
                                  f"subdomain: {by_kind(jobset)['JobSet']['spec']['network']['subdomain']}")
    expected = yaml.safe_load(core_text)
    env = expected["template"]["spec"]["containers"][0]["env"]
    env.remove({"name": "HARNESS_ATTEMPT", "value": "0"})
    env.insert(1, {"name": "HARNESS_ATTEMPT", "valueFrom": {"fieldRef": {"fieldPath": RESTART_ATTEMPT}}})
    assert job_spec(jobset) == expected


def test_jobset_agrees_with_itself():
    objects = cifar("jobset")
    jobset = by_kind(objects)["JobSet"]
    spec = jobset["spec"]
    replicated = spec["replicatedJobs"][0]
    job = replicated["template"]["spec"]
    pod = job["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    labels = jobset["metadata"]["labels"]
    assert [r["replicas"] for r in spec["replicatedJobs"]] == [1]
    assert replicated["template"]["metadata"]["labels"] == pod["metadata"]["labels"] == labels
    assert labels["app.kubernetes.io/instance"] == "cifar"  # `kubectl logs -l app.kubernetes.io/instance=cifar` as in core
    # The JobSet's own headless Service (named subdomain, selecting its pods) gives every pod its DNS name.
    assert spec["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": "cifar"}
    assert pod["spec"]["subdomain"] == spec["network"]["subdomain"]
    master = pod_dns(objects, 0)
    assert master == "cifar-node-0-0.cifar"
    assert env["MASTER_ADDR"]["value"] == master and f"--master-addr={master}" in container["args"]
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    assert env["HARNESS_ATTEMPT"]["valueFrom"]["fieldRef"]["fieldPath"] == RESTART_ATTEMPT \
        == f"metadata.annotations['{RESTART_ATTEMPT_KEY}']"
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == 2
    assert job["backoffLimit"] == 0 and pod["spec"]["restartPolicy"] == "Never"  # JobSet's default would be OnFailure
    restarts = load_job(REPO / "jobs/cifar.yaml").restarts
    assert spec["failurePolicy"]["maxRestarts"] == restarts.max == 2
    assert spec["failurePolicy"]["restartStrategy"] == "Recreate"
    names = [o["metadata"]["name"] for o in objects] + [f"{jobset['metadata']['name']}-{replicated['name']}-0-1-abcde"]
    assert all(DNS1123_LABEL.fullmatch(n) and len(n) <= 63 for n in names)


def job_failure_reason(job: dict, exit_code: int | None, conditions: tuple[str, ...]) -> str:
    """Kubernetes' Job controller on one failed pod: the first podFailurePolicy rule that matches decides;
    FailJob fails the Job with reason PodFailurePolicy, Count (or no match) counts against backoffLimit."""
    for rule in job["podFailurePolicy"]["rules"]:
        if "onPodConditions" in rule:
            matched = any(c["type"] in conditions for c in rule["onPodConditions"])
        else:
            codes = rule["onExitCodes"]
            matched = exit_code is not None and (exit_code in codes["values"]) == (codes["operator"] == "In")
        if matched:
            if rule["action"] == "FailJob":
                return "PodFailurePolicy"
            assert rule["action"] == "Count"
            break
    assert job["backoffLimit"] == 0
    return "BackoffLimitExceeded"


def jobset_action(jobset: dict, reason: str) -> str:
    """JobSet's controller on a failed Job: the first rule whose reasons match, else RestartJobSet."""
    for rule in jobset["spec"]["failurePolicy"]["rules"]:
        if not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"]:
            return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize(
    "exit_code, conditions, on_infra, on_any",
    [
        (1, (), "FailJobSet", "RestartJobSet"),  # torchrun: a worker failed (the program)
        (2, (), "FailJobSet", "RestartJobSet"),  # any other exit code: the program, to be safe
        (1, ("DisruptionTarget",), "RestartJobSet", "RestartJobSet"),  # evicted, preempted, node drained or lost
        (137, (), "RestartJobSet", "RestartJobSet"),  # torchrun killed by SIGKILL (OOM-killed)
        (RDZV_WAIT_EXIT, (), "RestartJobSet", "RestartJobSet"),  # the master's port never answered
        (None, (), "RestartJobSet", "RestartJobSet"),  # the pod failed before its container ran
    ],
)
def test_restarts_on_maps_to_the_failure_policies(write_yaml, exit_code, conditions, on_infra, on_any):
    """What the two controllers do with the rendered policies when one pod fails this way."""
    for on, action in (("infra", on_infra), ("any", on_any)):
        objects = docs(small(write_yaml, f"restarts: {{max: 3, on: {on}}}\n"), "jobset")
        jobset = by_kind(objects)["JobSet"]
        assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3
        assert jobset_action(jobset, job_failure_reason(job_spec(objects), exit_code, conditions)) == action, on


def test_a_worker_that_never_reaches_the_master_exits_as_infra(write_yaml, tmp_path):
    """The start script's own exit code, which the podFailurePolicy counts as an infrastructure failure."""
    mounts = materialize(docs(small(write_yaml)), tmp_path / "root")
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "HARNESS_RDZV_TIMEOUT": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["/bin/sh", "-c", in_pod(START_SCRIPT, mounts), "torchrun", "true"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == RDZV_WAIT_EXIT, result.stderr
    assert "not reachable after 1 s" in result.stderr


def test_long_names_are_shortened_deterministically_and_stay_unique(write_yaml):
    base = "a" * 60
    first = load_job(write_yaml(SMALL.format(name=base + "-x1", port=29500, script="t.py").replace("nnodes: 2", "nnodes: 100")))
    second = load_job(write_yaml(SMALL.format(name=base + "-x2", port=29500, script="t.py").replace("nnodes: 2", "nnodes: 100")))
    a, b = object_names(first), object_names(second)
    assert a == object_names(first) and a["job"] != b["job"] and a["jobset"] != b["jobset"]
    assert len(a["job"]) + len("-99") <= 63 and DNS1123_LABEL.fullmatch(a["job"])
    longest_pod = f"{a['jobset']}-{REPLICATED_JOB}-0-99-abcde"  # JobSet's webhook checks exactly this name
    assert len(longest_pod) <= 63 and DNS1035_LABEL.fullmatch(longest_pod)


def test_service_and_jobset_names_start_with_a_letter(write_yaml):
    names = object_names(load_job(write_yaml(SMALL.format(name="7b-finetune", port=29500, script="t.py"))))
    assert names["job"] == "7b-finetune" and names["service"] == "svc-7b-finetune"
    assert names["jobset"] == "js-7b-finetune" and names["pvc"] == "7b-finetune-work"


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
        render_manifests(load_job(path), path.read_text(), code={})


def test_cli_writes_manifests_atomically(write_yaml, tmp_path):
    path = small(write_yaml, script="t.py")
    result = render_in(tmp_path, str(path), "--target", "k8s", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["small.yaml"]
    # Client-side apply would copy the shipped code into an annotation of at most 256 KiB.
    assert result.stdout == f"wrote {tmp_path}/out/small.yaml; apply with: kubectl apply --server-side -f {tmp_path}/out/\n"
    bad = harness("render", str(write_yaml("name: x\nnnodes: 1\nentrypoint: {module: m}\n", "bad.yaml")),
                  "--target", "k8s", "--out", str(tmp_path / "none"))
    assert bad.returncode == 2 and "image" in bad.stderr and not (tmp_path / "none").exists()


def test_cli_renders_the_jobset_flavor(write_yaml, tmp_path):
    path = small(write_yaml, script="t.py")
    result = render_in(tmp_path, str(path), "--target", "k8s", "--flavor", "jobset", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "small.yaml").read_text()
    assert text.startswith(f"# Rendered by `harness render {path} --target k8s --flavor jobset`")
    assert [o["kind"] for o in yaml.safe_load_all(text)] == ["ConfigMap", "PersistentVolumeClaim", "JobSet"]
    default = render_in(tmp_path, str(path), "--target", "k8s")
    assert default.returncode == 0 and default.stdout == render_in(tmp_path, str(path), "--target", "k8s",
                                                                   "--flavor", "core").stdout
    assert [o["kind"] for o in yaml.safe_load_all(default.stdout)][-1] == "Job"


@pytest.mark.parametrize("args, message", [
    (["--flavor", "jobset"], "--flavor is for --target k8s"),
    (["--target", "torchrun", "--flavor", "core"], "--flavor is for --target k8s"),
    (["--target", "k8s", "--flavor", "volcano"], "invalid choice: 'volcano'"),
])
def test_cli_flavor_usage_errors(write_yaml, args, message):
    result = harness("render", str(write_yaml(SMALL.format(name="small", port=29500, script="t.py"))), *args)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""


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
    mount, here under root. Returns mount path -> the directory standing for it."""
    configmap = by_kind(objects)["ConfigMap"]
    pod = job_spec(objects)["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {}
    for mount in pod["containers"][0]["volumeMounts"]:
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


def pod_process(container: dict, fields: dict[str, str], master_dns: str,
                mounts: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """What the kubelet would exec in a pod whose downward-API fields have these values, with the master's
    DNS name mapped to loopback and the ConfigMap's mount paths to where materialize wrote them."""
    env: dict[str, str] = {}
    for entry in container["env"]:
        if "valueFrom" in entry:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = kubelet_expand(entry["value"], env)
    argv = [kubelet_expand(a, env) for a in container["command"] + container["args"]]
    swap = mounts | {master_dns: "127.0.0.1"}
    argv = [in_pod(a, swap) for a in argv]
    env = {k: in_pod(v, swap) for k, v in env.items()}
    assert container["workingDir"] == "/workspace"
    return argv, env


def run_pods(objects: list[dict], fields: dict[str, str], root: Path, workspace: Path, path: str) -> list[str]:
    """Both pods as real processes, the worker first (it must wait for the master's port), in workspace
    (their shared volume) with `python` found on path; their outputs, worker first, once both exit 0."""
    container = job_spec(objects)["template"]["spec"]["containers"][0]
    mounts = materialize(objects, root)
    procs = []
    try:
        for index in (1, 0):
            argv, env = pod_process(container, fields | {COMPLETION_INDEX: str(index)}, pod_dns(objects, 0), mounts)
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


@pytest.mark.parametrize("flavor", ["core", "jobset"])
def test_pods_run_as_rendered_form_a_working_ddp_job(write_yaml, flavor, tmp_path):
    """Both pods' command, args and env exactly as written; only the kubelet's substitutions applied. The
    job's setup runs once on the volume they share (here: one directory)."""
    script = REPO / "tests/scripts/ddp_sum.py"
    setup = f"setup:\n  - python -c \"import sys; print('set up by', sys.executable, '{tmp_path}')\"\n"
    objects = docs(write_yaml(SMALL.format(name="sim", port=free_port(), script=script) + setup), flavor)
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python` is the image's interpreter
    worker, master = run_pods(objects, {RESTART_ATTEMPT: "1"}, tmp_path / "root", tmp_path, path)
    container = job_spec(objects)["template"]["spec"]["containers"][0]
    _, env = pod_process(container, {COMPLETION_INDEX: "1", RESTART_ATTEMPT: "1"}, pod_dns(objects, 0), {})
    assert env["HARNESS_ATTEMPT"] == {"core": "0", "jobset": "1"}[flavor]
    assert "waiting for the master's rendezvous port" in worker
    assert f"set up by {sys.executable} {tmp_path}\n" in master and "harness setup: done before" in worker
    assert "; args=['--tag', 'two words', '$(not-a-var)', '$$', '${local_rank}']" in master
    finals = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", master + worker)
    assert sorted(r for r, _ in finals) == ["0", "1"] and len({w for _, w in finals}) == 1


@pytest.mark.parametrize("script, shipped", [
    ("train.py", ["train.py"]),
    ("./sub/train.py", ["sub/train.py"]),
    ("/opt/job/train.py", []),  # the image's own: not read here, not shipped
])
def test_a_relative_script_is_shipped_and_run_from_the_code_directory(write_yaml, tmp_path, script, shipped):
    (tmp_path / "sub").mkdir()
    spec_path = small(write_yaml, script=script)
    code = code_files(load_job(spec_path), tmp_path)
    assert list(code) == shipped
    objects = docs(spec_path)
    pod = job_spec(objects)["template"]
    args = pod["spec"]["containers"][0]["args"]
    assert args[-6] == (f"{CODE_DIR}/{shipped[0]}" if shipped else script)  # SMALL's 5 arguments follow it
    volume = next(v["configMap"] for v in pod["spec"]["volumes"] if v["name"] == "spec")
    assert [item["path"] for item in volume["items"]] == ["job.yaml", "waitport.py", *(f"code/{p}" for p in shipped)]
    assert (CODE_DIGEST in pod["metadata"].get("annotations", {})) == bool(shipped)


def test_files_and_binary_files_land_in_the_configmap_laid_out_by_the_volume_items(write_yaml, tmp_path):
    write_files(tmp_path, USER_FILES | {"configs/__pycache__/run.cpython-311.pyc": b"\0", "configs/old.pyc": b"\0",
                                        "configs/.secret": b"x", "configs/.git/HEAD": b"x", "notes.txt": b"unlisted"})
    spec_path = write_yaml(USER_JOB.format(port=29500))
    spec = load_job(spec_path)
    code = code_files(spec, tmp_path)
    assert code == USER_FILES  # the script, model.py and configs/ without caches and dot-files
    objects = docs(spec_path)
    configmap = by_kind(objects)["ConfigMap"]
    assert all(re.fullmatch(r"[-._a-zA-Z0-9]+", key) for key in [*configmap["data"], *configmap["binaryData"]])
    assert len(configmap["binaryData"]) == 1 and "init.bin" in next(iter(configmap["binaryData"]))
    etc = Path(materialize(objects, tmp_path / "root")["/etc/harness"])
    assert {p.relative_to(etc / "code").as_posix(): p.read_bytes() for p in (etc / "code").rglob("*")
            if p.is_file()} == USER_FILES
    assert (etc / "job.yaml").read_bytes() == spec_path.read_bytes()
    assert (etc / "waitport.py").read_bytes() == (REPO / "harness/node/waitport.py").read_bytes()
    template = job_spec(objects)["template"]
    assert {"name": "spec", "mountPath": "/etc/harness", "readOnly": True} in template["spec"]["containers"][0]["volumeMounts"]
    edited = render_manifests(spec, spec_path.read_text(), code=code | {"model.py": b"# edited\n"})
    assert job_spec(edited)["template"]["metadata"]["annotations"][CODE_DIGEST] != \
        template["metadata"]["annotations"][CODE_DIGEST]


@pytest.mark.parametrize("edit, message", [
    (("script: train.py", "script: missing.py"), "job.yaml:7:3: entrypoint.script: missing.py: not found in {dir}; "
                                                  "run `harness render` where the script is, or give an absolute path "
                                                  "inside the image"),
    (("[model.py, configs/]", "[model.py, conf/]"), "job.yaml:9:19: files[1]: conf/: not found in {dir}; run "
                                                    "`harness render` where it is, or remove it from files:"),
    (("script: train.py", "script: ../train.py"), "job.yaml:7:3: entrypoint.script: ../train.py: a path with '..' "
                                                  "cannot be shipped to the pods; run `harness render` in a directory "
                                                  "that holds the script"),
    (("[model.py, configs/]", "[model.py, linked/]"), "job.yaml:9:19: files[1]: linked/weights is not a regular file; "
                                                      "list linked/weights under files: itself to follow the link"),
])
def test_code_that_cannot_be_shipped_is_a_located_error(write_yaml, tmp_path, edit, message):
    write_files(tmp_path, USER_FILES)
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "weights").symlink_to(tmp_path / "configs" / "weights")
    spec = load_job(write_yaml(USER_JOB.format(port=29500).replace(*edit)))
    with pytest.raises(SpecError) as info:
        code_files(spec, tmp_path)
    assert message.format(dir=tmp_path) in str(info.value)


def test_cli_refuses_missing_or_oversized_code_and_writes_nothing(write_yaml, tmp_path):
    spec_path = write_yaml(USER_JOB.format(port=29500))
    missing = render_in(tmp_path, "job.yaml", "--target", "k8s", "--out", "k8s")
    assert missing.returncode == 2 and "job.yaml:7:3: entrypoint.script: train.py: not found in" in missing.stderr
    write_files(tmp_path, USER_FILES | {"configs/big.bin": bytes(MAX_CONFIGMAP)})
    big = render_in(tmp_path, "job.yaml", "--target", "k8s", "--out", "k8s")
    size = MAX_CONFIGMAP + sum(map(len, USER_FILES.values())) + len(spec_path.read_bytes()) + \
        len((REPO / "harness/node/waitport.py").read_bytes())
    assert big.returncode == 2 and f"job.yaml:9:1: files: the ConfigMap own-spec would hold {size} bytes (the spec " \
        f"and 5 shipped file(s)), over Kubernetes' limit of 1048576 (1 MiB); bake the code into the image" in big.stderr
    assert not (tmp_path / "k8s").exists()


def plain_python(directory: Path) -> Path:
    """`python` as a plain Python image with torch installed has it: a venv of this interpreter whose
    site-packages reaches this one's packages by a path-only .pth line, so that no .pth file there runs
    (the editable install's finder of the harness is one). Returns its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=60)
    site = Path(sysconfig.get_paths(vars={"base": str(directory)})["purelib"])
    (site / "torch-here.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return directory / "bin"


def test_a_user_script_shipped_by_the_renderer_runs_in_an_image_without_the_harness(tmp_path):
    """The user's directory -> `harness render` there -> what the kubelet makes of the ConfigMap -> both pods,
    run with an interpreter that has torch but cannot import the harness, on a workspace that starts empty."""
    project, workspace = tmp_path / "project", tmp_path / "workspace"
    write_files(project, USER_FILES | {"job.yaml": USER_JOB.format(port=free_port()).encode()})
    workspace.mkdir()
    rendered = render_in(project, "job.yaml", "--target", "k8s", "--out", "k8s")
    assert rendered.returncode == 0, rendered.stderr
    objects = list(yaml.safe_load_all((project / "k8s/own.yaml").read_text()))
    image = plain_python(tmp_path / "image")
    control = subprocess.run([image / "python", "-c", "import torch, harness"], cwd=workspace, capture_output=True,
                             text=True, timeout=120)
    assert "No module named 'harness'" in control.stderr and "torch" not in control.stderr, control.stderr
    worker, master = run_pods(objects, {}, tmp_path / "root", workspace, f"{image}:{os.environ['PATH']}")
    assert "waiting for the master's rendezvous port" in worker
    code = tmp_path / "root/etc/harness/code"
    for rank, output in (("1", worker), ("0", master)):
        assert f"rank {rank}: harness importable: False; cwd {workspace}; PYTHONPATH {code}:/opt/site; " \
               f"args ['--tag', 'two words']" in output, output
    finals = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", master + worker)
    assert sorted(r for r, _ in finals) == ["0", "1"] and len({w for _, w in finals}) == 1
    assert list(workspace.iterdir()) == []  # the volume got no code: it came from the ConfigMap
