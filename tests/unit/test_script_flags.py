"""A job from torchrun-style flags (harness.spec.from_flags, cli's `--`): the spec they make, the file
--save-job writes, the errors that name the flag; and master_port auto where the port is picked on the
nodes (sbatch) or fixed (pods)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from harness import cli
from harness.commands import Job, job_of
from harness.errors import UsageError
from harness.node.store_port import ephemeral_start
from harness.plan.planner import TORCHRUN_PORT
from harness.spec.from_flags import ScriptFlags, job_name, spec_from_flags, spec_yaml
from harness.spec.job import JobSpec, load_job
from harness.targets.k8s.manifests import render_manifests
from harness.targets.slurm.batch import batch_script


@pytest.mark.parametrize(("entry", "name"), [
    ("train.py", "train"), ("scripts/Train_DDP.py", "train-ddp"), ("pkg.sub.fine_tune", "fine-tune"),
    ("./__init__.py", "init"), ("___.py", "job"), ("x" * 80 + ".py", "x" * 63),
])
def test_the_job_name_comes_from_the_script_or_module(entry: str, name: str) -> None:
    assert job_name(entry) == name


def test_the_saved_file_loads_as_the_spec_the_flags_make(write_yaml) -> None:
    flags = ScriptFlags(script="train.py", args=["--lr", "1.10", "yes", "0123", "$HOME", "a b"], nnodes=2,
                        nproc_per_node="auto", master_port=29999, rdzv="c10d", backend="gloo", max_restarts=3,
                        env=["A=1", "B=x=y", "EMPTY="])
    made = spec_from_flags(flags)
    text = spec_yaml(flags, "harness launch train.py ...", "job.yaml")
    assert text.startswith("# Made by: harness launch train.py ...\n# Launch with: harness launch job.yaml")
    assert load_job(write_yaml(text)).model_dump() == made.model_dump()
    assert made.entrypoint.args == ["--lr", "1.10", "yes", "0123", "$HOME", "a b"]  # exactly as typed
    assert (made.env, made.restarts.max, made.rdzv, made.master_port) == \
        ({"A": "1", "B": "x=y", "EMPTY": ""}, 3, "c10d", 29999)


def test_only_what_the_flags_set_is_written() -> None:
    text = spec_yaml(ScriptFlags(module="pkg.train"), "harness launch -m pkg.train")
    assert text.splitlines()[1:] == ["name: train", "nnodes: 1", "entrypoint:", "  module: pkg.train"]
    assert spec_from_flags(ScriptFlags(module="pkg.train")).master_port == "auto"


@pytest.mark.parametrize(("flags", "message"), [
    (ScriptFlags(script="t.py", nnodes=0), "--nnodes: expected an integer from 1 to 4096, got 0"),
    (ScriptFlags(script="t.py", nproc_per_node=0), "--nproc-per-node: expected an integer from 1 to 1024"),
    (ScriptFlags(script="t.py", master_port=80), "--master-port: expected a port from 1024 to 65535, or auto"),
    (ScriptFlags(script="t.py", max_restarts=1000), "--max-restarts: Input should be less than or equal to 100"),
    (ScriptFlags(script="t.py", name="Bad_Name"), "--name: expected a DNS-1123 label"),
    (ScriptFlags(script="t.py", env=["MASTER_ADDR=x"]), "--env: MASTER_ADDR is set by the harness/torchrun"),
    (ScriptFlags(script="t.py", env=["=1"]), "--env: expected KEY=VALUE, got '=1'"),
    (ScriptFlags(script="-t.py"), "the script: script '-t.py' starts with '-'"),
    (ScriptFlags(module="not a module"), "-m: module must be a dotted Python module name"),
    (ScriptFlags(script="t.py", args=["a\0b"]), "the script's arguments: contains a NUL byte"),
    (ScriptFlags(script="t.py", stall=-1), "--stall: Input should be greater than or equal to 0, got -1"),
    (ScriptFlags(script="t.py", stall=86401), "--stall: Input should be less than or equal to 86400, got 86401"),
    (ScriptFlags(script="t.py", stall=float("nan")), "--stall: expected a finite number of seconds, got nan"),
    (ScriptFlags(script="t.py", slow=100.5), "--slow: Input should be less than or equal to 100, got 100.5"),
])
def test_a_bad_flag_is_named(flags: ScriptFlags, message: str) -> None:
    with pytest.raises(UsageError) as error:
        spec_from_flags(flags)
    assert str(error.value).startswith(message), error.value


def test_stall_and_slow_set_the_health_section_and_are_saved(write_yaml) -> None:
    flags = ScriptFlags(script="t.py", stall=0, slow=12.5)
    spec = spec_from_flags(flags)
    assert (spec.health.stall, spec.health.slow, spec.health.watched) == (0, 12.5, True)
    text = spec_yaml(flags, "harness launch t.py --stall 0 --slow 12.5", "job.yaml")
    assert text.endswith("health:\n  stall: 0\n  slow: 12.5\n"), text
    assert load_job(write_yaml(text)).health == spec.health
    assert spec_from_flags(ScriptFlags(script="t.py", stall=60)).health.slow == 20, "the other keeps its default"


def _spec_file_job(write_yaml, *flags: str) -> Job:
    path = write_yaml("name: x\nnnodes: 1\nentrypoint: {script: t.py}\nhealth: {stall: 30, slow: 50}\n")
    args = _main_args(["launch", str(path), *flags])
    args.rerun = ["launch", *cli.command_line(args.verbs.choices["launch"], args, {"verbs"})]
    return job_of(args)


def test_stall_and_slow_win_over_a_spec_files_health_keys(write_yaml) -> None:
    job = _spec_file_job(write_yaml, "--stall", "600")
    assert (job.spec.health.stall, job.spec.health.slow) == (600, 50)
    assert job.text.startswith(f"# Launched with: harness launch --stall=600 {job.source} (its flags override this file's keys)\n"), job.text
    assert job.text.endswith("health: {stall: 30, slow: 50}\n"), "the file's text follows as it is"
    untouched = _spec_file_job(write_yaml)
    assert (untouched.spec.health.stall, untouched.text[:5]) == (30, "name:")
    assert _spec_file_job(write_yaml, "--slow", "0").spec.health.slow == 0
    with pytest.raises(UsageError, match=r"^--slow: Input should be less than or equal to 100, got 101$"):
        _spec_file_job(write_yaml, "--slow", "101")
    with pytest.raises(UsageError, match=r"^--save-job is for a script launch"):
        _spec_file_job(write_yaml, "--stall", "1", "--save-job", "x.yaml")


@pytest.mark.parametrize("argv", [["launch", "t.py", "--stall", "x"], ["render", "j.yaml", "--slow", "1e"]])
def test_a_stall_or_slow_that_is_no_number_is_a_usage_error(argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"argument {argv[2]}: expected a number, got '{argv[3]}'" in result.stderr, \
        result.stderr


def test_nnodes_min_colon_n_is_torchruns_elastic_range_as_restarts_min_nnodes() -> None:
    args = _main_args(["launch", "t.py", "--nnodes", "2:3", "--max-restarts", "1"])
    assert (args.nnodes.fewest, args.nnodes.nodes, str(args.nnodes)) == (2, 3, "2:3")
    spec = spec_from_flags(ScriptFlags(script="t.py", nnodes=3, min_nnodes=2, max_restarts=1))
    assert (spec.nnodes, spec.restarts.min_nnodes, spec.fewest_nnodes, spec.restarts.max) == (3, 2, 2, 1)
    text = spec_yaml(ScriptFlags(script="t.py", nnodes=3, min_nnodes=2), "harness launch t.py --nnodes 2:3")
    assert "restarts:\n  min_nnodes: 2\n" in text
    with pytest.raises(UsageError, match=r"^--nnodes: expected at most nnodes \(3\)"):
        spec_from_flags(ScriptFlags(script="t.py", nnodes=3, min_nnodes=4))


def _main_args(argv: list[str]):
    given, trailing = cli._split_script_args(argv)
    args, rest = cli.parser().parse_known_args(given)
    assert rest == []
    if args.job is None and args.module is None and trailing:
        args.job = trailing.pop(0)
    args.script_args = trailing
    return args


@pytest.mark.parametrize("argv", [
    ["launch", "train.py", "--nnodes", "2", "--", "--lr", "0.1", "--", "x"],
    ["launch", "--nnodes=2", "-m", "pkg.train", "--env", "A=1", "--env", "B=2", "--", "--flag"],
    ["launch", "--hosts", "h.yaml", "--", "-odd.yaml"],
    ["launch", "--nproc_per_node", "auto", "--master_port", "auto", "t.py"],
    ["launch", "t.py", "--nnodes", "2:3", "--max-restarts", "2"],
    ["launch", "t.py", "--stall", "0", "--slow", "12.5", "--", "--stall", "1"],
])
def test_a_detached_script_launch_re_runs_its_words(argv: list[str]) -> None:
    args = _main_args(argv)
    again = _main_args(["launch", *cli.command_line(args.verbs.choices["launch"], args, {"verbs"})])
    assert {k: v for k, v in vars(again).items() if k != "verbs"} == {k: v for k, v in vars(args).items() if k != "verbs"}


@pytest.mark.parametrize("verb", ["launch", "render"])
def test_launch_and_render_help_document_every_argument(verb: str) -> None:
    result = subprocess.run([sys.executable, "-m", "harness.cli", verb, "--help"], capture_output=True, text=True,
                            timeout=60)
    options = re.findall(r"^  (-[-\w]+|JOB\|SCRIPT)", result.stdout, re.M)
    assert {"JOB|SCRIPT", "-m", "--nnodes", "--nproc-per-node", "--master-port", "--save-job", "--hosts", "--stall",
            "--slow"} <= set(options), result.stdout
    assert "these win over its health: keys" in result.stdout, result.stdout
    undocumented = re.findall(r"^  (\S+(?: \S+)?)\n(?!  {10,})", result.stdout, re.M)
    assert undocumented == [], undocumented


def _auto_spec(**extra: object) -> JobSpec:
    return JobSpec.model_validate({"name": "s", "nnodes": 2, "entrypoint": {"script": "t.py"}} | extra)


def test_sbatch_picks_the_auto_port_on_the_master_node() -> None:
    script = batch_script(_auto_spec(backend="gloo"), "job.yaml")
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert '--master-port="$MASTER_PORT"' in script and "export MASTER_PORT=" not in script
    picking = script[script.index("MASTER_PORT=$("):script.index('export MASTER_PORT PET_MASTER_PORT')]
    picked = subprocess.run(["bash", "-c", picking.replace("python3", sys.executable) + 'echo "$MASTER_PORT"'],
                            capture_output=True, text=True, timeout=60)
    assert 20000 <= int(picked.stdout) < ephemeral_start(), picked.stderr
    fixed = batch_script(_auto_spec(master_port=29411), "job.yaml")
    assert "export MASTER_PORT=29411\n" in fixed and "MASTER_PORT=$(" not in fixed


def test_pods_rendezvous_on_torchruns_port_when_auto() -> None:
    docs = render_manifests(_auto_spec(image="registry/h:1"), "", "core", code={}, supervised=False)
    text = str(docs)
    assert f"'containerPort': {TORCHRUN_PORT}" in text and f"--master-port={TORCHRUN_PORT}" in text


def test_the_flags_given_are_named_as_typed() -> None:
    flags = ScriptFlags(script="t.py", rdzv="c10d", max_restarts=0, env=["A=1"], nproc_per_node="auto")
    assert flags.given() == ["--nproc-per-node", "--rdzv-backend", "--max-restarts", "--env"]
    assert ScriptFlags(script="t.py", args=["--x"]).given() == []
