"""Kubernetes manifests as a working job: both pods run as processes exactly as rendered, with only the
kubelet's substitutions, the user's code from the ConfigMap alone (the manifests: tests/unit/test_k8s.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from harness.targets.k8s.manifests import COMPLETION_INDEX, RESTART_ATTEMPT

from conftest import REPO, free_port
from k8s_jobs import SMALL, USER_FILES, USER_JOB, docs, job_spec, pod_dns, pod_process, render_in, run_pods, write_files


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
