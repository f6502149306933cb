"""Kubernetes manifests: valid for the real API schemas, consistent, and a working job when run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
from harness.k8s import (
    COMPLETION_INDEX,
    JOBSET_API,
    POD_FAILURE_POLICY,
    RDZV_WAIT_EXIT,
    REPLICATED_JOB,
    RESTART_ATTEMPT,
    START_SCRIPT,
    manifests_yaml,
    object_names,
    render_manifests,
)
from harness.spec import DNS1123_LABEL, load_job

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


def docs(spec_path: Path, flavor: str = "core") -> list[dict]:
    return render_manifests(load_job(spec_path), spec_path.read_text(), flavor)


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
    fresh = manifests_yaml(load_job(REPO / "jobs/cifar.yaml"), (REPO / "jobs/cifar.yaml").read_text(), "jobs/cifar.yaml")
    assert (REPO / "k8s/cifar.yaml").read_text() == fresh, "k8s/ drifted from jobs/cifar.yaml: run `make k8s`"
    assert sorted(p.name for p in (REPO / "k8s").iterdir()) == ["cifar.yaml"]


@pytest.mark.parametrize("flavor", ["core", "jobset"])
@pytest.mark.parametrize("source", ["cifar", "small"])
def test_strict_schema_validation(source, flavor, write_yaml):
    """Every core object, and the JobSet's Job template as a Job, against Kubernetes' own schema."""
    if source == "small":
        objects = docs(write_yaml(SMALL.format(name="small", port=29500, script="train.py")), flavor)
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
    if source == "small":
        objects = docs(write_yaml(SMALL.format(name="small", port=29500, script="train.py")), "jobset")
    else:
        objects = cifar("jobset")
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
        text = SMALL.format(name="small", port=29500, script="t.py") + f"restarts: {{max: 3, on: {on}}}\n"
        objects = docs(write_yaml(text), "jobset")
        jobset = by_kind(objects)["JobSet"]
        assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3
        assert jobset_action(jobset, job_failure_reason(job_spec(objects), exit_code, conditions)) == action, on


def test_a_worker_that_never_reaches_the_master_exits_as_infra():
    """The start script's own exit code, which the podFailurePolicy counts as an infrastructure failure."""
    env = {"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "HARNESS_RDZV_TIMEOUT": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(["/bin/sh", "-c", START_SCRIPT, "torchrun", "true"], env=env, cwd=REPO,
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
        render_manifests(load_job(path), path.read_text())


def test_cli_writes_manifests_atomically(write_yaml, tmp_path):
    path = write_yaml(SMALL.format(name="small", port=29500, script="t.py"))
    result = harness("render", str(path), "--target", "k8s", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["small.yaml"]
    bad = harness("render", str(write_yaml("name: x\nnnodes: 1\nentrypoint: {module: m}\n", "bad.yaml")),
                  "--target", "k8s", "--out", str(tmp_path / "none"))
    assert bad.returncode == 2 and "image" in bad.stderr and not (tmp_path / "none").exists()


def test_cli_renders_the_jobset_flavor(write_yaml, tmp_path):
    path = write_yaml(SMALL.format(name="small", port=29500, script="t.py"))
    result = harness("render", str(path), "--target", "k8s", "--flavor", "jobset", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "small.yaml").read_text()
    assert text.startswith(f"# Rendered by `harness render {path} --target k8s --flavor jobset`")
    assert [o["kind"] for o in yaml.safe_load_all(text)] == ["ConfigMap", "PersistentVolumeClaim", "JobSet"]
    default = harness("render", str(path), "--target", "k8s")
    assert default.returncode == 0 and default.stdout == harness("render", str(path), "--target", "k8s",
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


def pod_process(container: dict, fields: dict[str, str], master_dns: str) -> tuple[list[str], dict[str, str]]:
    """What the kubelet would exec in a pod whose downward-API fields have these values, with the master's
    DNS name mapped to loopback."""
    env: dict[str, str] = {}
    for entry in container["env"]:
        if "valueFrom" in entry:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = kubelet_expand(entry["value"], env)
    argv = [kubelet_expand(a, env) for a in container["command"] + container["args"]]
    swap = {master_dns: "127.0.0.1"}
    argv = [a.replace(master_dns, swap[master_dns]) for a in argv]
    env = {k: v.replace(master_dns, "127.0.0.1") for k, v in env.items()}
    assert container["workingDir"] == "/workspace"
    return argv, env


@pytest.mark.parametrize("flavor", ["core", "jobset"])
def test_pods_run_as_rendered_form_a_working_ddp_job(write_yaml, flavor, tmp_path):
    """Both pods' command, args and env exactly as written; only the kubelet's substitutions applied. The
    job's setup runs once on the volume they share (here: one directory)."""
    script = REPO / "tests/scripts/ddp_sum.py"
    setup = f"setup:\n  - python -c \"import sys; print('set up by', sys.executable, '{tmp_path}')\"\n"
    objects = docs(write_yaml(SMALL.format(name="sim", port=free_port(), script=script) + setup), flavor)
    container = job_spec(objects)["template"]["spec"]["containers"][0]
    master_dns = pod_dns(objects, 0)
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python` is the image's interpreter
    procs = []
    try:
        for index in (1, 0):  # the worker first: it must wait for the master's port
            argv, env = pod_process(container, {COMPLETION_INDEX: str(index), RESTART_ATTEMPT: "1"}, master_dns)
            assert env["NODE_RANK"] == str(index) and env["HARNESS_ATTEMPT"] == {"core": "0", "jobset": "1"}[flavor]
            procs.append(subprocess.Popen(argv, env=env | {"PATH": path}, cwd=tmp_path, stdout=subprocess.PIPE,
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
    assert f"set up by {sys.executable} {tmp_path}\n" in master and "harness setup: done before" in worker
    assert "; args=['--tag', 'two words', '$(not-a-var)', '$$', '${local_rank}']" in master
    finals = re.findall(r"\[rank(\d)\]: rank \1 final loss \S+ weights (\[.*\])", master + worker)
    assert sorted(r for r, _ in finals) == ["0", "1"] and len({w for _, w in finals}) == 1
