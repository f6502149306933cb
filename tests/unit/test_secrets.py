"""Secret env values (spec/secrets.py): where they come from, what the plan, the record, the renders and the
command lines show of them (nothing), and the errors of a secret that is not there. The values reaching the ranks
are proven on every target by launches the suite runs anyway (conftest.with_secret)."""

from __future__ import annotations

import json
import os

import pytest

from harness.errors import SpecError
from harness.plan.planner import plan_local
from harness.plan.render import render_json, render_text
from harness.spec.job import load_job
from harness.spec.secrets import MASK, looks_secret, masked_spec_text, secret_values
from harness.targets.agent_link import agent_argv, agent_program
from harness.targets.boot import BOOT
from harness.targets.k8s.manifests import manifests_yaml, render_manifests
from harness.targets.slurm.batch import batch_script

from conftest import harness

JOB = """\
name: tok
nnodes: 2
backend: gloo
image: registry.example/harness:0.1.0
entrypoint: {script: /opt/train.py}
env:
  WANDB_API_KEY: "in-clear-1"   # a value that looks secret, written in env
  LR: "0.1"
secrets:
  HF_TOKEN:
  DB_PASS: {file: ~/.db-pass}
  OTHER: {env: MY_OTHER, k8s: {secret: shared, key: other}}
"""


@pytest.fixture
def job(write_yaml):
    return write_yaml(JOB)


@pytest.mark.parametrize("name, secret", [("HF_TOKEN", True), ("WANDB_API_KEY", True), ("db_password", True),
                                          ("MY_SECRET_THING", True), ("aws_secret_access_key", True),
                                          ("LR", False), ("KEYBOARD", False), ("TOKENIZERS_PARALLELISM", False)])
def test_names_that_look_secret(name, secret):
    assert looks_secret(name) is secret


def test_values_come_from_the_launching_environment_or_a_file(job, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".db-pass").write_text("pa ss\n")
    spec = load_job(job)
    assert secret_values(spec, {"HF_TOKEN": "hf_1", "MY_OTHER": "o"}) == {"HF_TOKEN": "hf_1", "DB_PASS": "pa ss",
                                                                          "OTHER": "o"}


@pytest.mark.parametrize("environ, file, said", [
    ({"MY_OTHER": "o"}, "x", r"job.yaml:10:3: secrets.HF_TOKEN: HF_TOKEN is not set in the environment `harness "
                             r"launch` runs in: export it, or name a file"),
    ({"HF_TOKEN": "h"}, "x", r"job.yaml:12:3: secrets.OTHER: MY_OTHER is not set"),
    ({"HF_TOKEN": "h", "MY_OTHER": "o"}, None, r"job.yaml:11:\d+: secrets.DB_PASS.file: cannot read \S+/.db-pass: "
                                               r"No such file or directory"),
    ({"HF_TOKEN": "h", "MY_OTHER": "o"}, "\n", r"secrets.DB_PASS.file: \S+/.db-pass holds nothing: expected the "
                                               r"secret's value"),
])
def test_a_secret_that_is_not_there_is_named_at_its_key(job, tmp_path, monkeypatch, environ, file, said):
    monkeypatch.setenv("HOME", str(tmp_path))
    if file is not None:
        (tmp_path / ".db-pass").write_text(file)
    with pytest.raises(SpecError, match=said):
        secret_values(load_job(job), environ)


@pytest.mark.parametrize("secrets, said", [
    ("{HF_TOKEN: {env: A, file: b}}", r"secrets.HF_TOKEN.file: expected env or file, not both"),
    ("{LR: }", r"secrets.LR: LR is also in env: a value comes from env \(written in clear\) or from secrets"),
    ("{NODE_RANK: }", r"secrets.NODE_RANK: .*NODE_RANK is set by the harness/torchrun"),
    ("{HF_TOKEN: {k8s: {secret: Bad_Name, key: t}}}", r"secrets.HF_TOKEN.k8s.secret: expected the name of a "
                                                      r"Kubernetes Secret"),
    ("{HF_TOKEN: {vault: x}}", r"secrets.HF_TOKEN.vault"),
])
def test_a_wrong_secrets_entry_is_refused_at_its_key(write_yaml, secrets, said):
    text = JOB.split("secrets:")[0] + f"secrets: {secrets}\n"
    with pytest.raises(SpecError, match=said):
        load_job(write_yaml(text))


def test_the_runs_spec_copy_masks_what_looks_secret_and_keeps_the_rest_as_written():
    masked = masked_spec_text(JOB)
    assert "in-clear-1" not in masked
    assert f"  WANDB_API_KEY: '{MASK}'   # a value that looks secret, written in env\n" in masked
    assert masked.replace(f"'{MASK}'", '"in-clear-1"') == JOB
    block = "env:\n  DB_PASSWORD: |\n    two\n    lines\n  LR: '1'\n"
    assert masked_spec_text(block) == f"env:\n  DB_PASSWORD: '{MASK}'\n  LR: '1'\n"


def test_plans_name_the_secrets_and_show_no_value_that_looks_secret(job):
    plan = plan_local(load_job(job), run_id="tok-1", python="python3")
    for shown in (render_text(plan), render_json(plan)):
        assert "in-clear-1" not in shown and "0.1" in shown
    assert "# secrets, their values from the launch and never written: HF_TOKEN, DB_PASS, OTHER" in render_text(plan)
    node = json.loads(render_json(plan))["nodes"][0]
    assert (node["env"]["WANDB_API_KEY"], node["secrets"]) == (MASK, ["HF_TOKEN", "DB_PASS", "OTHER"])
    assert "HF_TOKEN" not in node["env"]


def test_a_nodes_secrets_travel_on_its_agents_stdin_not_its_command_line(job):
    node = plan_local(load_job(job), run_id="tok-1", python="python3").nodes[1]
    program = agent_program(node, 3, 10, 1, secrets={"HF_TOKEN": "hf_value_1"})
    assert b"hf_value_1" in program
    assert not any("hf_value_1" in word for word in agent_argv("python3", node)) and BOOT in agent_argv("python3", node)


def test_pods_take_each_secret_from_its_secret_and_the_render_says_which_to_create(job):
    spec = load_job(job)
    wanted = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok-secrets", "key": "HF_TOKEN"}}},
              {"name": "DB_PASS", "valueFrom": {"secretKeyRef": {"name": "tok-secrets", "key": "DB_PASS"}}},
              {"name": "OTHER", "valueFrom": {"secretKeyRef": {"name": "shared", "key": "other"}}}]
    for flavor in ("core", "jobset"):
        for supervised in (True, False):
            pods = [o for o in _pod_specs(render_manifests(spec, JOB, flavor, code={}, supervised=supervised))]
            workers = [p for p in pods if p["containers"][0]["name"] != "controller"]
            assert workers and all(p["containers"][0]["env"][-3:] == wanted for p in workers), (flavor, supervised)
            assert not any("secretKeyRef" in json.dumps(p) for p in pods if p not in workers)
    header = manifests_yaml(spec, JOB, "job.yaml", code={}).split("\n---\n")[0]
    assert ("# Needs its secrets in the namespace first: kubectl create secret generic tok-secrets "
            "--from-literal=HF_TOKEN=... --from-literal=DB_PASS=...") in header
    assert "kubectl create secret generic shared --from-literal=other=..." in header


def _pod_specs(objects: list[dict]) -> list[dict]:
    found = []

    def visit(value: object) -> None:
        if isinstance(value, dict):
            if "containers" in value:
                found.append(value)
            for item in value.values():
                visit(item)
        elif isinstance(value, list):
            for item in value:
                visit(item)

    visit(objects)
    return found


def test_a_rendered_batch_script_reads_each_secret_where_it_runs(job):
    script = batch_script(load_job(job), "job.yaml")
    assert ('HF_TOKEN="${HF_TOKEN:?is not set in the environment sbatch ran in (secrets.HF_TOKEN): export it before '
            'sbatch}"\nexport HF_TOKEN\n') in script
    assert "DB_PASS=$(cat -- ~/.db-pass) || exit 1\nexport DB_PASS\n" in script
    assert 'OTHER="${MY_OTHER:?' in script


def test_render_says_when_a_value_that_looks_secret_is_written_in_clear(job):
    for target in ("slurm", "k8s"):
        rendered = harness("render", str(job), "--target", target)
        assert rendered.returncode == 0, rendered.stderr
        assert (f"harness render: env.WANDB_API_KEY looks like a secret, and "
                f"{'the batch script' if target == 'slurm' else 'the manifests'} hold its value in clear: move it to "
                f"secrets: (docs/security.md)") in rendered.stderr


def test_a_launch_whose_secret_is_missing_fails_before_anything_starts(job, tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("HF_TOKEN", "MY_OTHER")}
    launched = harness("launch", str(job), "--runs-dir", str(tmp_path / "runs"), env=env)
    assert launched.returncode != 0
    assert f"{job}:10:3: secrets.HF_TOKEN: HF_TOKEN is not set" in launched.stderr, launched.stderr
    assert not (tmp_path / "runs").exists()
