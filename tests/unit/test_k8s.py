"""Kubernetes manifests: valid for the real API schemas, consistent with each other and with the
controllers' failure policies (the pods run as rendered: tests/integration/test_k8s_pods.py)."""

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
from kubernetes_validate.utils import latest_version

from harness import __version__
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
from harness.targets.k8s.objects import IMAGE_UID, MIN_KUBERNETES
from harness.targets.k8s.supervised import CONTROLLER, INFRA_EXIT, PROGRAM_EXIT, RUNS_DIR, WORKER
from testbed.kubelet import by_kind, in_pod, job_spec, jobs_by_name, materialize, pod_dns

from conftest import REPO, free_port, harness
from k8s_jobs import (
    SMALL,
    USER_FILES,
    USER_JOB,
    docs,
    render_in,
    write_files,
)

NEWEST = latest_version()  # the newest Kubernetes whose schemas the pinned kubernetes-validate has
# The JobSet API: kubeflow-trainer-api 2.3.0 (pinned in the test extra) carries models generated from the
# v1alpha2 Go types of sigs.k8s.io/jobset v0.12.0, the version Kubeflow Trainer 2.3.0's go.mod requires.
# The JobSet SDK itself is not on PyPI. Its annotation key for the restart attempt lives in the controller
# (pkg/constants RestartsKey, set as label and annotation on every pod), not in the API types.
RESTART_ATTEMPT_KEY = "jobset.sigs.k8s.io/restart-attempt"
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def small(write_yaml, extra: str = "", script: str = "train.py", name: str = "small", port: int = 29500) -> Path:
    """SMALL as a user has it: beside its script."""
    path = write_yaml(SMALL.format(name=name, port=port, script=script) + extra)
    if not script.startswith("/"):
        (path.parent / script).write_text("print('hello')\n")
    return path


def cifar(flavor: str, supervised: bool = False) -> list[dict]:
    """jobs/cifar.yaml rendered (k8s/ holds the supervised core flavor: test_committed_manifests_...)."""
    return docs(REPO / "jobs/cifar.yaml", flavor, supervised=supervised)


def as_the_api_gets_them(objects: list[dict]) -> list[dict]:
    """The objects of a render as the API server gets them: a JobSet's Job templates as the batch/v1 Jobs its
    controller makes of them (named as it names them); the JobSet itself is its API's (api_problems)."""
    found = [o for o in objects if o["kind"] != "JobSet"]
    for jobset in (o for o in objects if o["kind"] == "JobSet"):
        found += [{"apiVersion": "batch/v1", "kind": "Job",
                   "metadata": {"name": f"{jobset['metadata']['name']}-{replicated['name']}-0",
                                **replicated["template"]["metadata"]},
                   "spec": replicated["template"]["spec"]} for replicated in jobset["spec"]["replicatedJobs"]]
    return found


def schema_problems(objects: list[dict], version: str) -> list[str]:
    """Each object of a render against Kubernetes `version`'s own schemas, strict (an unknown field fails)."""
    problems = []
    for obj in as_the_api_gets_them(objects):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.absolute_path))
            problems.append(f"{obj['kind']} {obj['metadata']['name']}: {where}: {exc.message}")
    return problems


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
    kinds = {"core": ["Service", "Job"], "jobset": ["JobSet"]}[flavor] + ["NetworkPolicy"]
    assert [o["kind"] for o in objects] == ["ConfigMap", "PersistentVolumeClaim", *kinds]
    assert schema_problems(objects, NEWEST) == []


def test_strict_validation_rejects_an_unknown_field():
    """The validator is real: a typo'd field fails, so the test above can fail too."""
    job = by_kind(cifar("core"))["Job"]
    job["spec"]["template"]["spec"]["subDomain"] = job["spec"]["template"]["spec"].pop("subdomain")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, NEWEST, strict=True)


SMOKE = REPO / "jobs/k8s-smoke.yaml"
RENDERS = [("core", True), ("jobset", True), ("core", False), ("jobset", False)]  # (flavor, supervised)


@pytest.mark.parametrize("job", ["cifar.yaml", "k8s-smoke.yaml"])
@pytest.mark.parametrize(("flavor", "supervised"), RENDERS)
def test_every_render_passes_the_schemas_of_the_oldest_kubernetes_it_names_and_of_the_newest(job, flavor, supervised):
    """MIN_KUBERNETES, which the docs and every render's header name, is the oldest Kubernetes whose schemas take
    every render: the one before it refuses them."""
    objects = docs(REPO / "jobs" / job, flavor, supervised=supervised)
    assert schema_problems(objects, MIN_KUBERNETES) == []
    assert schema_problems(objects, NEWEST) == []
    major, minor = MIN_KUBERNETES.split(".")
    assert schema_problems(objects, f"{major}.{int(minor) - 1}"), "an older Kubernetes takes them: lower MIN_KUBERNETES"


def test_the_docs_and_the_manifests_name_the_oldest_kubernetes():
    assert f"Kubernetes {MIN_KUBERNETES} or newer" in (REPO / "docs/kubernetes.md").read_text()
    assert (REPO / "k8s/cifar.yaml").read_text().splitlines()[0].endswith(f"For Kubernetes {MIN_KUBERNETES} or newer.")


def quota_refusals(objects: list[dict]) -> list[str]:
    """What a ResourceQuota on requests.cpu, requests.memory, limits.cpu and limits.memory (Kubernetes' own example
    of a compute quota) refuses: each container that does not give each of them. The API server takes a limit for
    a request left out."""
    refused = []
    for name, job in jobs_by_name(objects).items():
        for container in job["template"]["spec"]["containers"]:
            limits = container.get("resources", {}).get("limits", {})
            requests = limits | container.get("resources", {}).get("requests", {})
            refused += [f"{name}: {container['name']}: no {side}.{key}"
                        for side, given in (("requests", requests), ("limits", limits)) for key in ("cpu", "memory")
                        if key not in given]
    return refused


def test_the_k8s_smoke_example_renders_as_printed_and_every_object_passes_the_schemas():
    """jobs/k8s-smoke.yaml as its comment prints it, from the repository's root: CPU-only pods over gloo, in the image
    `make image` builds, on a volume any default StorageClass provisions, admitted by a compute ResourceQuota."""
    command = "harness render jobs/k8s-smoke.yaml --target k8s"
    assert f"#   {command} | kubectl apply --server-side -f -" in SMOKE.read_text()
    result = harness(*command.split()[1:])
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"# Rendered by `{command}`")
    objects = list(yaml.safe_load_all(result.stdout))
    assert [o["kind"] for o in objects] == ["ConfigMap", "PersistentVolumeClaim", "Service", "Job", "Job",
                                            "NetworkPolicy", "NetworkPolicy"]
    assert schema_problems(objects, MIN_KUBERNETES) == schema_problems(objects, NEWEST) == []
    make = dict(re.findall(r"^(REGISTRY|IMAGE) \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE))
    spec = load_job(SMOKE)
    assert spec.image == f"{make['REGISTRY']}/{make['IMAGE']}:{__version__}"
    assert spec.backend == "gloo" and spec.resources.gpus == 0 and spec.nnodes == 2 and not spec.setup
    assert "synthetic" in spec.entrypoint.args  # nothing to download
    assert by_kind(objects)["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "storageClassName" not in by_kind(objects)["PersistentVolumeClaim"]["spec"]  # the cluster's default class
    assert all("affinity" in job["template"]["spec"] for job in jobs_by_name(objects).values())
    assert quota_refusals(objects) == []


def test_the_controller_pod_gives_the_requests_and_limits_a_resource_quota_asks_for(write_yaml):
    objects = docs(small(write_yaml), supervised=True)
    controller = jobs_by_name(objects)["small"]["template"]["spec"]["containers"][0]
    assert controller["resources"] == {"limits": {"cpu": "1", "memory": "1Gi"},
                                       "requests": {"cpu": "250m", "memory": "512Mi"}}
    # SMALL's workers ask for nothing (resources.cpu and memory are the job's to give): only they are refused.
    assert quota_refusals(objects) == [f"small-node: node: no {side}.{key}" for side in ("requests", "limits")
                                       for key in ("cpu", "memory")]
    own = docs(small(write_yaml, "k8s: {controller_resources: {requests: {memory: 256Mi}, limits: {cpu: null}}}\n"),
               supervised=True)
    assert jobs_by_name(own)["small"]["template"]["spec"]["containers"][0]["resources"] == \
        {"limits": {"memory": "1Gi"}, "requests": {"cpu": "250m", "memory": "256Mi"}}
    assert schema_problems(own, MIN_KUBERNETES) == []


@pytest.mark.parametrize(("extra", "claim"), [
    ("", {"accessModes": ["ReadWriteMany"]}),
    ("k8s: {storage_class: efs-sc}\n", {"accessModes": ["ReadWriteMany"], "storageClassName": "efs-sc"}),
    ('k8s: {storage_class: "", access_mode: ReadWriteOnce}\n', {"accessModes": ["ReadWriteOnce"],
                                                                "storageClassName": ""}),
])
def test_the_volume_claim_takes_k8s_storage_class_and_access_mode(write_yaml, extra, claim):
    """Unset, no storageClassName (the cluster's default class provisions the volume); "", none (a PersistentVolume
    made by hand binds it); else that class."""
    for flavor, supervised in RENDERS:
        objects = docs(small(write_yaml, extra), flavor, supervised=supervised)
        assert by_kind(objects)["PersistentVolumeClaim"]["spec"] == claim | {"resources": {"requests": {"storage": "50Gi"}}}
        assert schema_problems(objects, MIN_KUBERNETES) == []


@pytest.mark.parametrize(("flavor", "supervised"), RENDERS)
def test_read_write_once_puts_every_pod_of_the_job_on_one_node(write_yaml, flavor, supervised):
    """One node mounts a ReadWriteOnce volume, so every pod of the job requires a node that runs another of them,
    and every pod matches every pod's term: the first one scheduled goes where the volume can be (it is exempt, as
    it matches its own term), the others to its node. The render's header says so."""
    path = small(write_yaml, "k8s: {access_mode: ReadWriteOnce, spares: 1}\n")
    objects = docs(path, flavor, supervised=supervised)
    pods = [job["template"] for job in jobs_by_name(objects).values()]
    assert len(pods) == (2 if supervised else 1)
    for pod in pods:
        terms = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert [term["topologyKey"] for term in terms] == ["kubernetes.io/hostname"]
        assert all(terms[0]["labelSelector"]["matchLabels"].items() <= other["metadata"]["labels"].items()
                   for other in pods)
    assert schema_problems(objects, MIN_KUBERNETES) == schema_problems(objects, NEWEST) == []
    if flavor == "jobset":
        assert api_problems(by_kind(objects)["JobSet"]) == []
    spec = load_job(path)
    header = manifests_yaml(spec, path.read_text(), str(path), flavor, code=code_files(spec, path.parent),  # type: ignore[arg-type]
                            supervised=supervised).split("\napiVersion:")[0]
    assert f"# k8s.access_mode ReadWriteOnce: one node mounts the volume, so all {4 if supervised else 2} pods of " \
           f"the job run on that node" in header
    default = docs(small(write_yaml), flavor, supervised=supervised)
    assert not any("affinity" in job["template"]["spec"] for job in jobs_by_name(default).values())


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
    objects = cifar("core")
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
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"] == IMAGE_UID
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
    node_rank = next(at for at, entry in enumerate(env) if entry["name"] == "NODE_RANK")
    env.insert(node_rank + 1, {"name": "HARNESS_ATTEMPT", "valueFrom": {"fieldRef": {"fieldPath": RESTART_ATTEMPT}}})
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
        (("env:\n", "k8s: {access_mode: ReadWriteOncePod}\nenv:\n"), SpecError,
         "job.yaml:9:7: k8s.access_mode: expected ReadWriteMany (pods on any nodes share the volume: NFS, EFS, CephFS, "
         "...) or ReadWriteOnce (one node mounts the volume, and every pod of the job runs on that node); "
         "ReadWriteOncePod lets a single pod mount the volume"),
        (("env:\n", "k8s: {storage_class: EFS_SC}\nenv:\n"), SpecError,
         "job.yaml:9:7: k8s.storage_class: expected the name of a StorageClass (a DNS-1123 subdomain such as efs-sc"),
        (("env:\n", "k8s: {controller_resources: {requests: {memory: 2Gi}}}\nenv:\n"), SpecError,
         "job.yaml:9:41: k8s.controller_resources.requests.memory: expected at most limits.memory (1Gi): Kubernetes "
         "refuses a pod that requests more than its limit, got 2Gi"),
    ],
)
def test_bad_specs_fail_at_render_time(write_yaml, edit, error, message):
    path = write_yaml(SMALL.format(name="small", port=29500, script="t.py").replace(*edit))
    with pytest.raises(error, match=re.escape(message)):
        render_manifests(load_job(path), path.read_text(), code={})


def test_two_jobs_rendered_into_one_folder_are_applied_one_at_a_time_by_the_printed_command(write_yaml, tmp_path):
    """What render prints applies its own job's objects and nothing of another rendered beside it (server-side: a
    client-side apply would copy the shipped code into an annotation of at most 256 KiB); `make k8s` puts any job
    but cifar's outside k8s/'s own files, which `kubectl apply --server-side -f k8s/` applies."""
    out = tmp_path / "out"
    for name in ("first", "second"):
        path = small(write_yaml, script="t.py", name=name)
        result = render_in(tmp_path, str(path), "--target", "k8s", "--out", str(out))
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"wrote {out}/{name}.yaml; apply with: kubectl apply --server-side -f {out}/{name}.yaml\n"
        applied = list(yaml.safe_load_all((out / f"{name}.yaml").read_text()))
        assert applied and {o["metadata"]["labels"]["app.kubernetes.io/instance"] for o in applied} == {name}, applied
    assert sorted(p.name for p in out.iterdir()) == ["first.yaml", "second.yaml"]
    make = subprocess.run(["make", "-s", "--no-print-directory", "-n", "k8s", "JOB=jobs/k8s-smoke.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert make.stdout.splitlines()[-1].endswith("harness render jobs/k8s-smoke.yaml --target k8s --out k8s/k8s-smoke"), \
        make.stdout
    assert sorted(p.name for p in (REPO / "k8s").glob("*.yaml")) == ["cifar.yaml"]


def test_a_refused_render_writes_nothing(write_yaml, tmp_path):
    bad = harness("render", str(write_yaml("name: x\nnnodes: 1\nentrypoint: {module: m}\n", "bad.yaml")),
                  "--target", "k8s", "--out", str(tmp_path / "none"))
    assert bad.returncode == 2 and "image" in bad.stderr and not (tmp_path / "none").exists()


def test_cli_renders_the_jobset_flavor(write_yaml, tmp_path):
    path = small(write_yaml, script="t.py")
    result = render_in(tmp_path, str(path), "--target", "k8s", "--flavor", "jobset", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "small.yaml").read_text()
    assert text.startswith(f"# Rendered by `harness render {path} --target k8s --flavor jobset`")
    assert [o["kind"] for o in yaml.safe_load_all(text)] == ["ConfigMap", "PersistentVolumeClaim", "JobSet",
                                                             "NetworkPolicy", "NetworkPolicy"]
    default = render_in(tmp_path, str(path), "--target", "k8s")
    assert default.returncode == 0 and default.stdout == render_in(tmp_path, str(path), "--target", "k8s",
                                                                   "--flavor", "core").stdout
    assert [o["kind"] for o in yaml.safe_load_all(default.stdout)] == ["ConfigMap", "PersistentVolumeClaim", "Service",
                                                                       "Job", "Job", "NetworkPolicy", "NetworkPolicy"]
    bare = render_in(tmp_path, str(path), "--target", "k8s", "--flavor", "jobset", "--unsupervised")
    assert bare.stdout.startswith(f"# Rendered by `harness render {path} --target k8s --flavor jobset --unsupervised`")
    assert [o["kind"] for o in yaml.safe_load_all(bare.stdout)] == ["ConfigMap", "PersistentVolumeClaim", "JobSet",
                                                                    "NetworkPolicy"]
    refused = harness("render", str(path), "--unsupervised")
    assert refused.returncode == 2 and "--unsupervised is for --target k8s" in refused.stderr


@pytest.mark.parametrize("args, message", [
    (["--flavor", "jobset"], "--flavor is for --target k8s"),
    (["--target", "torchrun", "--flavor", "core"], "--flavor is for --target k8s"),
    (["--target", "k8s", "--flavor", "volcano"], "invalid choice: 'volcano'"),
])
def test_cli_flavor_usage_errors(write_yaml, args, message):
    result = harness("render", str(write_yaml(SMALL.format(name="small", port=29500, script="t.py"))), *args)
    assert result.returncode == 2 and message in result.stderr and result.stdout == ""


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
    assert [item["path"] for item in volume["items"]] == ["job.yaml", "pod.py", *(f"code/{p}" for p in shipped)]
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
    assert (etc / "pod.py").read_bytes() == (REPO / "harness/node/pod.py").read_bytes()
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
        len((REPO / "harness/node/pod.py").read_bytes())
    assert big.returncode == 2 and f"job.yaml:9:1: files: the ConfigMap own-spec would hold {size} bytes (the spec " \
        f"and 5 shipped file(s)), over Kubernetes' limit of 1048576 (1 MiB); bake the code into the image" in big.stderr
    assert not (tmp_path / "k8s").exists()


def test_the_metrics_port_is_opened_to_the_pods_k8s_metrics_from_names_and_else_to_nobody(write_yaml):
    text = (REPO / "jobs/cifar.yaml").read_text() + "health: {metrics_port: 9400}\n"
    for extra, expected in (("", []), ("k8s: {metrics_from: {app.kubernetes.io/name: prometheus}}\n",
                                       [({"app.kubernetes.io/name": "prometheus"}, 9400)])):
        spec = load_job(write_yaml(text + extra))
        policy = next(o for o in render_manifests(spec, text + extra, code={}) if o["kind"] == "NetworkPolicy")
        assert [(rule["from"][0]["podSelector"]["matchLabels"], rule["ports"][0]["port"])
                for rule in policy["spec"]["ingress"][1:]] == expected


@pytest.mark.parametrize("flavor", ["core", "jobset"])
def test_supervised_objects_pass_the_api_schemas_and_agree_with_each_other(flavor, write_yaml):
    """The controller's Job (the run: named after the job; its exit codes the failure policy's), the workers'
    Indexed Job (nnodes + spares pods dialing the controller's Service), the NetworkPolicy that lets only the
    job's pods reach the controller; every Job against Kubernetes' schema, the JobSet against its API."""
    spec_text = (REPO / "jobs/cifar.yaml").read_text() + "k8s: {spares: 1, port: 29444}\n"
    spec = load_job(write_yaml(spec_text))
    objects = render_manifests(spec, spec_text, flavor, code={})
    kinds = {"core": ["Service", "Job", "Job"], "jobset": ["JobSet"]}[flavor] + ["NetworkPolicy"] * 2
    assert [o["kind"] for o in objects] == ["ConfigMap", "PersistentVolumeClaim", *kinds]
    jobs = jobs_by_name(objects)
    controller, workers = (jobs["cifar"], jobs["cifar-node"]) if flavor == "core" else \
        (jobs[CONTROLLER], jobs[WORKER])
    assert schema_problems(objects, NEWEST) == []
    for obj in objects:
        if obj["kind"] == "JobSet":
            assert api_problems(obj) == []
            assert obj["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": [CONTROLLER]}
            assert obj["spec"]["failurePolicy"] == {"maxRestarts": 0}

    lead = controller["template"]["spec"]["containers"][0]
    assert lead["command"] == ["harness", "k8s-controller", "/etc/harness/job.yaml"] and lead["image"] == spec.image
    assert {"name": "HARNESS_RUNS_DIR", "value": RUNS_DIR} in lead["env"]  # `kubectl exec` finds the run there
    assert lead["lifecycle"]["preStop"]["exec"]["command"][:3] == ["harness", "stop", "latest"]
    assert int(lead["lifecycle"]["preStop"]["exec"]["command"][-1]) < \
        controller["template"]["spec"]["terminationGracePeriodSeconds"]
    rules = controller["podFailurePolicy"]["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert [(r["action"], r["onExitCodes"]["values"], r["onExitCodes"]["containerName"]) for r in rules[1:]] == \
        [("FailJob", [PROGRAM_EXIT], lead["name"]), ("FailJob", [INFRA_EXIT], lead["name"])]
    assert controller["backoffLimit"] == 0 and "completionMode" not in controller

    assert workers["completionMode"] == "Indexed" and workers["completions"] == workers["parallelism"] == 3
    worker = workers["template"]["spec"]["containers"][0]
    assert worker["command"] == ["python", "-I", "/etc/harness/pod.py"] and worker["image"] == spec.image
    dialed, port = worker["args"][1], int(worker["args"][2])
    assert worker["args"][0] == "serve" and port == 29444 == lead["ports"][0]["containerPort"]
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in worker["env"] if "valueFrom" in e} == \
        {"POD_NAME": "metadata.name", "POD_INDEX": COMPLETION_INDEX, "NODE_NAME": "spec.nodeName"}
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    controller_labels = controller["template"]["metadata"]["labels"]
    if flavor == "core":
        service = by_kind(objects)["Service"]
        assert dialed == service["metadata"]["name"] and service["spec"]["ports"][0]["port"] == port
        assert service["spec"]["selector"].items() <= controller_labels.items()
        assert not service["spec"]["selector"].items() <= workers["template"]["metadata"]["labels"].items()
    else:
        jobset = by_kind(objects)["JobSet"]
        assert dialed == f"cifar-{CONTROLLER}-0-0.{jobset['spec']['network']['subdomain']}"
    # Ingress to the controller from the job's workers alone, to its port alone; to the workers from the job's own
    # pods alone (a pod is chosen by labels: who matches which, not which strings).
    worker_labels = workers["template"]["metadata"]["labels"]

    def chosen(selector: dict) -> list[str]:
        return [name for name, pod in (("controller", controller_labels), ("workers", worker_labels))
                if selector["podSelector"]["matchLabels"].items() <= pod.items()]

    policies = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy"]
    assert [chosen(policy) for policy in policies] == [["controller"], ["workers"]]
    to_controller, to_workers = policies
    assert [(chosen(rule["from"][0]), rule["ports"]) for rule in to_controller["ingress"]] == \
        [(["workers"], [{"port": port, "protocol": "TCP"}])]
    assert [[chosen(peer) for peer in rule["from"]] for rule in to_workers["ingress"]] == [[["controller"], ["workers"]]]
    assert all("ports" not in rule for rule in to_workers["ingress"]), "the workers' collectives use any port"


@pytest.mark.parametrize("flavor", ["core", "jobset"])
def test_unsupervised_pods_are_reached_by_the_jobs_own_pods_alone_on_any_port(flavor, write_yaml):
    """torch's store has no authentication: one NetworkPolicy lets only the job's own pods reach them, on every
    port (the store's, and gloo's and NCCL's, which are ephemeral); there is no metrics port (no harness runs
    there). Chosen by labels: the job's pods match, another job's in the namespace do not. With k8s.namespace,
    the policy is in it, as every object is, and the API's schemas take them."""
    objects = docs(small(write_yaml, extra="k8s: {namespace: ml-jobs}\n"), flavor)
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 1 and schema_problems(objects, NEWEST) == []
    assert {o["metadata"]["namespace"] for o in objects} == {"ml-jobs"}
    policy = policies[0]["spec"]
    own = job_spec(objects)["template"]["metadata"]["labels"]
    other = job_spec(docs(small(write_yaml, name="other"), flavor))["template"]["metadata"]["labels"]

    def chosen(selector: dict) -> list[str]:
        return [name for name, pod in (("own", own), ("other", other))
                if selector["matchLabels"].items() <= pod.items()]

    assert chosen(policy["podSelector"]) == ["own"] and policy["policyTypes"] == ["Ingress"]
    assert [[(chosen(peer["podSelector"]), sorted(peer)) for peer in rule["from"]] for rule in policy["ingress"]] == \
        [[(["own"], ["podSelector"])]]
    assert all("ports" not in rule for rule in policy["ingress"]), "the collectives' data plane uses any port"
    ports = {p["containerPort"] for c in job_spec(objects)["template"]["spec"]["containers"] for p in c["ports"]}
    assert ports == {29500}, "the store's port alone is named: nothing serves metrics"
