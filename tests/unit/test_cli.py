"""The command line: every verb documents itself, and a detached launch re-runs exactly the arguments
it was given (cli.command_line), from the parser's own definition rather than a second list of flags."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from harness import cli

VERBS = ["render", "launch", "stop", "status", "report", "preflight"]


def _parsed(argv: list[str]) -> argparse.Namespace:
    args, rest = cli.parser().parse_known_args(argv)
    assert rest == []
    return args


def _rerun(argv: list[str]) -> list[str]:
    args = _parsed(argv)
    return [args.verb, *cli.command_line(args.verbs.choices[args.verb], args, {"detach", "run_id", "runs_dir"})]


@pytest.mark.parametrize("argv", [
    ["launch", "jobs/smoke.yaml"],
    ["launch", "job.yaml", "--hosts", "h.yaml", "--known-hosts", "kh", "--accept-new-host-keys", "--skip-preflight"],
    ["launch", "jobs/cifar.yaml", "--target", "slurm", "--partition", "gpu", "--time", "01:00:00", "--qos=-odd"],
    ["launch", "a b.yaml", "--hosts=--weird=name.yaml"],
    ["launch", "--hosts", "h.yaml", "--", "-odd.yaml"],
    ["launch", "jobs/smoke.yaml", "--stall", "60", "--slow", "0.5"],
])
def test_a_detached_launch_re_runs_what_it_was_given(argv: list[str]) -> None:
    detached = [argv[0], "--detach", "--runs-dir", "r", "--run-id", "x", *argv[1:]]
    given, again = vars(_parsed(detached)), vars(_parsed(_rerun(detached)))
    left_out = {"detach", "run_id", "runs_dir", "verbs"}  # verbs: the parser itself, not an argument
    assert {k: v for k, v in again.items() if k not in left_out} == {k: v for k, v in given.items() if k not in left_out}
    assert "--detach" not in _rerun(detached)


def test_a_new_launch_flag_is_re_run_without_being_listed_again() -> None:
    """The rerun reads the parser: every option the launch verb defines round-trips."""
    launch = cli.parser()._subparsers._group_actions[0].choices["launch"]
    options = [a for a in launch._actions if a.option_strings and a.dest not in {"help", "detach", "run_id", "runs_dir"}]
    assert {a.dest for a in options} >= {"hosts", "known_hosts", "skip_preflight", "target", "partition"}
    for action in options:
        value = [] if isinstance(action, argparse._StoreTrueAction) else \
            [action.choices[-1] if action.choices else "2" if action.type else "v"]
        rerun = _rerun(["launch", "j.yaml", action.option_strings[0], *value])
        assert len(rerun) == 3 and rerun[1].startswith(action.option_strings[0]), (action.dest, rerun)


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_names_itself_in_its_help(verb: str) -> None:
    result = subprocess.run([sys.executable, "-m", "harness.cli", verb, "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(f"usage: harness {verb}"), result.stderr


@pytest.mark.parametrize("verb", VERBS)
def test_every_argument_of_every_verb_has_help(verb: str) -> None:
    parser = cli.parser()._subparsers._group_actions[0].choices[verb]
    bare = [a.dest for a in parser._actions if not a.help]
    assert bare == [], f"harness {verb}: arguments without help text: {bare}"


def test_a_scripts_arguments_before_the_double_dash_are_refused_with_the_command_that_works(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, fixed in ((["launch", "train.py", "--nnodes", "2", "--steps", "5"],
                         "harness launch --nnodes=2 train.py -- --steps 5"),
                        (["render", "train.py", "--steps", "5", "--", "--lr", "3"],
                         "harness render train.py -- --steps 5 --lr 3")):
        with pytest.raises(SystemExit) as ended:
            cli.main(argv)
        error = capsys.readouterr().err
        assert ended.value.code == 2 and error.startswith(f"usage: harness {argv[0]}"), error
        assert error.endswith(f"unrecognized arguments: --steps 5; the script's own arguments go after `--`: {fixed}\n")
    with pytest.raises(SystemExit):
        cli.main(["launch", "job.yaml", "--steps", "5"])
    assert capsys.readouterr().err.endswith("error: unrecognized arguments: --steps 5\n"), "a spec file has no script args"


def test_a_misspelt_flag_or_verb_is_answered_with_the_nearest_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        cli.main(["launch", "train.py", "--nodes", "2"])
    error = capsys.readouterr().err
    assert ended.value.code == 2 and error.endswith(
        "error: unrecognized arguments: --nodes 2 (--nodes: did you mean --nnodes?); the script's own arguments go "
        "after `--`: harness launch train.py -- --nodes 2\n"), error
    for typed, said in (("lanch", "unknown verb 'lanch' (did you mean 'launch'?); "), ("fly", "unknown verb 'fly'; ")):
        with pytest.raises(SystemExit) as ended:
            cli.main([typed])
        error = capsys.readouterr().err
        assert ended.value.code == 2 and error.endswith(
            f"harness: error: {said}the verbs: render, launch, stop, attach, stacks, status, top, logs, report, preflight, "
            f"hosts, prepare\n"), error


def test_the_top_level_help_names_every_verb_a_user_types() -> None:
    shown = subprocess.run([sys.executable, "-m", "harness.cli", "--help"], capture_output=True, text=True,
                           timeout=60).stdout
    verbs = [verb for verb in cli.parser().get_default("verbs").choices if verb not in cli.INTERNAL_VERBS]
    described = " ".join(shown.split("\n\n")[1].split())
    assert described == f"The `harness` command: {', '.join(verbs)}.", described
