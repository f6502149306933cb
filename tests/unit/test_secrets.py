"""Secret env values (spec/secrets.py): where they come from, what the plan, the record, the renders and the
command lines show of them (nothing), and the errors of a secret that is not there; the names that look secret
(looks_secret), whose values written in env: or given by --env are shown nowhere either: not in a plan, the run's
spec.yaml and its header, a --save-job file, a render, Slurm's job files, a node's line or a detached controller's
command line. The values reaching the ranks are proven on every target by launches the suite runs anyway
(conftest.with_secret, conftest.SECRET_LOOKING)."""

from __future__ import annotations

import ast
import io
import json
import os
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.control.detach import controller_argv, env_pairs_from
from harness.errors import SpecError, UsageError
from harness.plan.planner import plan_local
from harness.plan.render import render_json, render_text
from harness.spec.from_flags import ScriptFlags, spec_yaml
from harness.spec.job import load_job
from harness.spec.secrets import MASK, looks_secret, masked_spec_text, secret_values, shown_words
from harness.targets.agent_link import agent_argv, agent_program
from harness.targets.boot import BOOT
from harness.targets.k8s.manifests import manifests_yaml, render_manifests
from harness.targets.slurm.batch import batch_script
from harness.targets.slurm.job_file import job_environment, job_json, read_job

from conftest import SECRET_LOOKING, harness, secret_looking_env

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


@pytest.mark.parametrize("name", ["HF_TOKEN", *SECRET_LOOKING, "db_password", "MY_SECRET_THING", "aws_secret_access_key",
                                  "AWS_SESSION_TOKEN", "GHTOKEN", "hfToken", "OPENAI_APIKEY", "DBPASSWORD", "SMTP_PASS",
                                  "GITHUB_OAUTH", "DB_CREDS", "OP_SESSION_MY", "SSH_PRIVATE_KEY", "gpg-passphrase"])
def test_names_that_look_secret(name):
    assert looks_secret(name)


@pytest.mark.parametrize("name", ["LR", "KEYBOARD", "TOKENIZERS_PARALLELISM", "PWD", "OLDPWD", "PATH", "PYTHONPATH",
                                  "AUTHOR", "PASSES", "BYPASS_PROXY", "SESSIONS_DIR", "OMP_NUM_THREADS", "NCCL_DEBUG",
                                  "CUDA_VISIBLE_DEVICES", "HOME", "MONKEY_PATCH"])
def test_names_that_do_not_look_secret(name):
    """PWD alone is the shell's working directory; the other words are not whole parts of these names."""
    assert not looks_secret(name)


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


def _job_with(env: dict[str, str], secrets: bool = True) -> str:
    """JOB with env in its env: (LR kept), and its secrets: unless not secrets."""
    head, tail = JOB.split("env:\n")
    entries = "".join(f"  {name}: {value}\n" for name, value in env.items())
    text = head + "env:\n" + entries + '  LR: "0.1"\n' + "secrets:" + tail.split("secrets:")[1]
    return text if secrets else text.split("secrets:")[0]


def _agent_arguments(program: bytes) -> list[str]:
    """The arguments agent_program ships the agent (boot.shipped: ARGV in the line's program)."""
    text = ast.literal_eval(program.decode().strip().removeprefix("exec(").removesuffix(")"))
    return ast.literal_eval(next(line for line in text.splitlines() if line.startswith("ARGV = "))[7:])


@pytest.mark.parametrize("standby", [False, True])
def test_env_values_that_look_secret_reach_the_node_as_secrets_do_and_not_on_its_line(write_yaml, standby):
    """The agent runs the node's line as `sh -c LINE` (and LINE's `exec env K=V ...`): any user reads that command line
    in /proc while it runs, so the values of names that look secret are not in it but in the agent's SECRETS, which
    join the environment LINE runs in. Proven on a real launch by strace: tests/integration/test_script_launch.py."""
    env = secret_looking_env()
    node = plan_local(load_job(write_yaml(_job_with(env))), run_id="tok-1", python="python3").nodes[0]
    arguments = _agent_arguments(agent_program(node, 3, 10, 1, standby=standby, secrets={"HF_TOKEN": "hf_value_1"}))
    command, given = arguments[7], json.loads(arguments[11])
    assert "LR=0.1" in command and not any(value in command for value in env.values())
    assert given == env | {"HF_TOKEN": "hf_value_1"}


def test_every_name_that_looks_secret_is_masked_wherever_the_harness_shows_or_keeps_its_value(write_yaml, tmp_path):
    """A plan (plan.txt, plan.json, render), the run's spec.yaml (the spec file's copy, or the spec --env made with
    its `# Made by:` header), a --save-job file (which takes them from secrets: instead), Slurm's batch script and
    job.json: none holds a value; what needs one gets it from the environment."""
    env = secret_looking_env() | {"HF_TOKEN": "hf_in_env_1"}
    text = _job_with(env, secrets=False)
    spec = load_job(write_yaml(text))
    plan = plan_local(spec, run_id="tok-1", python="python3")
    words = ["harness", "launch", "train.py", *(f"--env={name}={value}" for name, value in env.items()), "--env=LR=1"]
    flags = ScriptFlags(script="train.py", env=[f"{name}={value}" for name, value in env.items()] + ["LR=1"])
    command = " ".join(shown_words(words))
    saved = spec_yaml(flags, command, str(tmp_path / "job.yaml"))
    kept = {"plan.txt": render_text(plan), "plan.json": render_json(plan), "spec.yaml": masked_spec_text(text),
            "spec.yaml of --env": masked_spec_text(spec_yaml(flags, command)), "--save-job": saved,
            "batch script": batch_script(spec, "job.yaml", command), "job.json": job_json(spec)}
    for where, shown in kept.items():
        assert not [name for name, value in env.items() if value in shown], where
    assert "LR=0.1" in kept["plan.txt"]
    assert all(f"--env={name}=***" in command for name in env) and "--env=LR=1" in command
    assert kept["spec.yaml of --env"].startswith(f"# Made by: {command}\n")
    for name in env:
        assert (f"'{name}=***'" in kept["plan.txt"] and json.loads(kept["plan.json"])["nodes"][0]["env"][name] == MASK
                and f"  {name}: '***'" in kept["spec.yaml"] and f"  {name}: '***'" in kept["spec.yaml of --env"])
        assert f'{name}="${{{name}:?is not set in the environment sbatch ran in (env.{name} looks like a secret' in \
            kept["batch script"]
    again = load_job(write_yaml(saved, "saved.yaml"))
    assert (list(again.secrets), again.env) == (list(env), {"LR": "1"})
    assert f"# {', '.join(env)}: given by --env, and written nowhere: each is read from the environment" in saved


def test_slurms_job_json_holds_no_value_and_the_batch_step_takes_each_from_its_environment(write_yaml, tmp_path):
    """sbatch hands the job's environment on (job_environment: what the launch adds to sbatch's); the batch step's
    controller takes the values out of its own, which srun would pass on to every step."""
    env = secret_looking_env()
    spec = load_job(write_yaml(_job_with(env, secrets=False)))
    (tmp_path / "job.json").write_text(job_json(spec))
    handed = job_environment(spec)
    assert sorted(handed.values()) == sorted(env.values()) and not any(v in (tmp_path / "job.json").read_text()
                                                                       for v in env.values())
    environ = {"PATH": "/bin", **handed}
    assert read_job(tmp_path / "job.json", environ).env == spec.env and environ == {"PATH": "/bin"}
    with pytest.raises(Exception, match=r"the job's environment lacks HARNESS_SLURM_ENV_GITHUB_PAT, .*: the values of "
                                        r"env names that look secret travel there, not in job.json"):
        read_job(tmp_path / "job.json", {})


def test_a_detached_controllers_command_line_holds_no_env_value():
    """Its --env pairs come on its stdin (control/detach.py): /proc shows its command line to every user for the whole run;
    the script's own arguments after `--` stay as they are. Proven on a real launch: tests/integration/test_detach.py."""
    rerun = ["launch", "--env=GITHUB_PAT=v1", "--env=LR=1", "--nnodes=2", "train.py", "--", "--env=x"]
    argv = controller_argv(rerun, Path("/r"), "train-1")
    assert argv == [sys.executable, "-m", "harness.cli", "launch", "--runs-dir=/r", "--run-id=train-1",
                    "--detached-controller", "--nnodes=2", "train.py", "--", "--env=x"]
    assert env_pairs_from(io.StringIO('["GITHUB_PAT=v1", "LR=1"]')) == ["GITHUB_PAT=v1", "LR=1"]
    for wrong in ("", "GITHUB_PAT=v1", '{"a": 1}', "[1]", "[" + '"x",' * (1 << 19) + '"x"]'):
        with pytest.raises(UsageError, match=r"--detached-controller: expected the launch's --env pairs on stdin as a "
                                             r"JSON list of strings \(at most 1048576 bytes\)$"):
            env_pairs_from(io.StringIO(wrong))


def test_a_usage_errors_suggestion_masks_what_looks_secret(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "train.py", "--env", "GITHUB_PAT=v_in_clear", "--env", "LR=1", "--steps", "5"])
    error = capsys.readouterr().err
    assert "harness launch '--env=GITHUB_PAT=***' --env=LR=1 train.py -- --steps 5" in error
    assert "v_in_clear" not in error


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
    said = {"k8s": "harness render: env.WANDB_API_KEY looks like a secret, and the manifests hold its value in clear: "
                   "move it to secrets: (docs/security.md)",
            "slurm": "harness render: env.WANDB_API_KEY looks like a secret: the batch script holds no value of it and "
                     "takes WANDB_API_KEY from the environment sbatch runs in (export it before sbatch), or move it to "
                     "secrets: (docs/security.md)"}
    for target in ("slurm", "k8s"):
        rendered = harness("render", str(job), "--target", target)
        assert rendered.returncode == 0, rendered.stderr
        assert rendered.stderr.count(said[target]) == 1, rendered.stderr
        assert "in-clear-1" not in rendered.stderr


@pytest.mark.parametrize("target", ["torchrun", "slurm"])
def test_a_scripts_render_and_saved_job_hold_no_value_given_by_env(tmp_path, target):
    """The plan and the batch script (headed by the command, its values masked) and the --save-job file hold none;
    the file takes them from the launching environment, and render says how to launch it. (A script is not rendered
    for Kubernetes: its image is a spec file's key; the manifests hold env values, as render says above.)"""
    env = secret_looking_env()
    rendered = harness("render", "train.py", "--nnodes", "2", "--target", target, "--env=LR=1",
                       *(f"--env={name}={value}" for name, value in env.items()), "--save-job", "job.yaml", cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    shown = rendered.stdout + rendered.stderr + (tmp_path / "job.yaml").read_text()
    assert not [name for name, value in env.items() if value in shown]
    assert all(f"'{name}=***'" in rendered.stdout if target == "torchrun" else f"--env={name}=***" in rendered.stdout
               for name in env), rendered.stdout
    assert f"export {'=... '.join(env)}=...; harness launch job.yaml (the values of --env names" in rendered.stderr
    assert list(load_job(tmp_path / "job.yaml").secrets) == list(env)


def test_a_launch_whose_secret_is_missing_fails_before_anything_starts_and_says_what_looks_secret(job, tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("HF_TOKEN", "MY_OTHER")}
    launched = harness("launch", str(job), "--runs-dir", str(tmp_path / "runs"), env=env)
    assert launched.returncode != 0
    assert f"{job}:10:3: secrets.HF_TOKEN: HF_TOKEN is not set" in launched.stderr, launched.stderr
    assert not (tmp_path / "runs").exists()
    # launch says what render says of a value that looks secret written in env, once, without it
    assert launched.stderr.count(f"harness: env.WANDB_API_KEY looks like a secret: the harness shows it as *** and puts "
                                 f"it on no command line, but {job} holds it in clear; secrets: takes it from your "
                                 f"environment or a file instead (docs/security.md#secrets)") == 1, launched.stderr
    assert "in-clear-1" not in launched.stderr
