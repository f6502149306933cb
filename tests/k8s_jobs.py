"""Jobs rendered for Kubernetes for both tiers: tests/unit/test_k8s.py (the manifests) and
tests/integration/test_k8s_pods.py (the pods run, as testbed/kubelet.py runs them)."""

from __future__ import annotations

import os
import struct
import subprocess
import textwrap
from pathlib import Path

from harness.spec.job import load_job
from harness.targets.k8s.manifests import code_files, render_manifests

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


def docs(spec_path: Path, flavor: str = "core", supervised: bool = False) -> list[dict]:
    """The manifests `harness render` makes in the spec's directory (its code read from there); unsupervised
    unless asked."""
    spec = load_job(spec_path)
    return render_manifests(spec, spec_path.read_text(), flavor, code=code_files(spec, spec_path.parent),
                            supervised=supervised)


def render_in(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`harness render` run in directory (where the job's code is), with this checkout's harness."""
    return harness("render", *args, cwd=directory, env=os.environ | {"PYTHONPATH": str(REPO)})
