"""Jobs rendered for Kubernetes, and what a kubelet makes of the manifests, for both tiers:
tests/unit/test_k8s.py (the manifests) and tests/integration/test_k8s_pods.py (the pods run)."""

from __future__ import annotations

import base64
import os
import struct
import subprocess
import textwrap
from pathlib import Path

from harness.spec.job import load_job
from harness.targets.k8s.manifests import COMPLETION_INDEX, code_files, render_manifests

from conftest import REPO, harness

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


def render_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`harness render` run in directory (where the job's code is), with this checkout's harness."""
    return harness("render", *args, cwd=directory, env=os.environ | {"PYTHONPATH": str(REPO)})


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
