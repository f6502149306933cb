"""The `harness` command: render, launch, stop, attach, stacks, status, top, logs, report, preflight, hosts, prepare.

This module parses the command line and dispatches to harness.commands, nothing more.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import sys
from collections.abc import Callable
from typing import NamedTuple, TypeAlias

from harness import __version__, commands
from harness.control.terminal import COLLAPSE_WINDOW
from harness.errors import HarnessError
from harness.node.protocol import COLLAPSE_ABOVE, numbers_of
from harness.spec.job import SLURM_OPTIONS

# What a detached launch leaves out when it re-runs its own arguments (it adds its own run id and runs dir,
# and the job spec it saved already).
_NOT_RERUN = {"detach", "detached_controller", "run_id", "runs_dir", "save_job"}
# How every verb that takes a run names it (record/index.py RunsLookup.find resolves it).
RUN_HELP = "a run id as `harness status` lists it, a unique prefix of one, or `latest` for the newest run"
RUNS_DIR_HELP = ("where run records live (default: $HARNESS_RUNS_DIR, else ./runs); without either, the verbs "
                 "that take a run id also find runs launched from any directory through the index of your runs "
                 "($XDG_STATE_HOME/harness/runs, default ~/.local/state/harness/runs); when given, it is the only "
                 "place they look")


def _seconds(text: str) -> float:
    """A positive, finite number of seconds, or argparse's usage error (exit 2) naming the option."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 86400, got {text}")
    return value


def command_line(verb: argparse.ArgumentParser, args: argparse.Namespace, leave_out: set[str]) -> list[str]:
    """The words that parse back to args under verb's parser (and main's `--`): every argument it
    defines, at its parsed value (options only where they differ from their default), but those named
    in leave_out, then the script's arguments after `--`."""
    options: list[str] = []
    positionals: list[str] = []
    for action in verb._actions:
        value = getattr(args, action.dest, None)
        if action.dest in leave_out or isinstance(action, argparse._HelpAction) or value == action.default:
            continue
        if not action.option_strings:
            positionals.append(str(value))
        elif isinstance(action, argparse._StoreTrueAction):
            options.append(action.option_strings[0])
        elif isinstance(action, argparse._AppendAction):
            options += [f"{action.option_strings[0]}={item}" for item in value or []]
        else:
            options.append(f"{action.option_strings[0]}={value}")
    trailing = getattr(args, "script_args", [])
    # A positional that looks like an option (a job file named -x.yaml) parses only after `--`.
    if any(word.startswith("-") for word in positionals):
        return [*options, "--", *positionals, *trailing]
    return [*options, *positionals, *(["--", *trailing] if trailing else [])]


def _split_script_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv before the first `--`, and the words after it (the script's, or the job first when no job came
    before it: `harness launch -- -odd.yaml`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _job_arguments() -> argparse.ArgumentParser:
    """What launch and render take to know the job: a spec file, or a script (or module) with torchrun's
    flags, from which the same spec is built in memory."""
    job = argparse.ArgumentParser(add_help=False)
    job.add_argument("job", nargs="?", metavar="JOB|SCRIPT",
                     help="a job spec (jobs/cifar.yaml), or a script to run as torchrun would (train.py) with the "
                          "flags below; the script's own arguments go after `--`")
    flags = job.add_argument_group("a script without a job spec (torchrun's flag names; see docs/cli.md)")
    flags.add_argument("-m", "--module", help="run this module as `python -m` instead of a script (e.g. pkg.train)")
    flags.add_argument("--nnodes", type=_nnodes, metavar="N|MIN:N",
                       help="number of nodes (default 1); MIN:N goes on with no fewer than MIN nodes when hosts are "
                            "lost and no spare is left (restarts.min_nnodes)")
    flags.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=_number_or_auto,
                       help="processes per node: a number, or auto (one per GPU; default 1)")
    flags.add_argument("--master-port", "--master_port", dest="master_port", type=_number_or_auto,
                       help="rendezvous port on the master: a number, or auto (default: a free port picked at launch)")
    flags.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv", choices=("static", "c10d"),
                       help="static (default): fixed node ranks; c10d: ranks given at the rendezvous")
    flags.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int,
                       help="whole-job restarts after an infrastructure failure (default 0; restarts.max)")
    flags.add_argument("--backend", choices=("auto", "nccl", "gloo"),
                       help="process-group backend the script is told (HARNESS_BACKEND; default auto)")
    flags.add_argument("--name", help="job name, in run ids (default: from the script, train.py -> train)")
    flags.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                       help="set a variable for every rank (repeatable)")
    flags.add_argument("--save-job", metavar="FILE",
                       help="also write the job spec these flags make to FILE (not overwritten), to launch or "
                            "edit later")
    health = job.add_argument_group("job health (a script or a job spec: these win over its health: keys; see "
                                    "docs/health.md)")
    health.add_argument("--stall", type=_number, metavar="SECONDS",
                        help="seconds a rank may make no progress before the job counts as hung and is stopped with "
                             "every rank's stack, 0 to 86400; 0: off (health.stall, default 300)")
    health.add_argument("--slow", type=_number, metavar="PERCENT",
                        help="name a rank its peers wait for at least this percentage of the time, 0 to 100; 0: off "
                             "(health.slow, default 20)")
    health.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the run's metrics to Prometheus on this port while it runs (health.metrics_port; "
                             "default: off; docs/metrics.md)")
    health.add_argument("--metrics-address", metavar="IP",
                        help="the address the metrics are served on: 0.0.0.0 for every interface "
                             "(health.metrics_address; default: 127.0.0.1, a Kubernetes controller pod's own)")
    return job


def _examples(verb: str) -> str:
    return (f"examples:\n  harness {verb} jobs/smoke.yaml\n"
            f"  harness {verb} train.py --nnodes 2 --nproc-per-node 4 -- --lr 0.1     (the script's args after --)\n"
            f"  harness {verb} -m pkg.train --nnodes 2 --hosts hosts.yaml --save-job job.yaml")


class NodeCount(NamedTuple):
    """--nnodes N, or torchrun's elastic MIN:N; written back as typed (a re-run parses it again)."""

    fewest: int | None
    nodes: int

    def __str__(self) -> str:
        return f"{self.fewest}:{self.nodes}" if self.fewest is not None else str(self.nodes)


def _nnodes(text: str) -> NodeCount:
    fewest, colon, nodes = text.rpartition(":")
    try:
        return NodeCount(int(fewest) if colon else None, int(nodes))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of nodes, or MIN:N (e.g. 2:4), got {text!r}") from None


def _ranks(text: str) -> frozenset[int]:
    """`3`, `0,2,5` or ranges as the harness writes them, `0-67,72-951`."""
    ranks = numbers_of(text.replace(" ", ""))
    if not ranks:
        raise argparse.ArgumentTypeError(f"expected ranks such as 3, 0,2,5 or 0-7,12, got {text!r}")
    return frozenset(ranks)


def _node(text: str) -> int:
    """A node rank as typed or as the stream names it: 1 or node1."""
    if not re.fullmatch(r"(node)?\d+", text):
        raise argparse.ArgumentTypeError(f"expected a node such as 1 or node1, got {text!r}")
    return int(text.removeprefix("node"))


def _attempt(text: str) -> int | None:
    """None: every attempt."""
    if text == "all":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an attempt number (0 is the first) or all, got {text!r}")
    return int(text)


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"expected a regular expression, got {text!r}: {exc}") from None


def _duration(text: str) -> float:
    from harness.view.logs import duration

    try:
        return duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(text: str) -> int | float:
    """An integer as typed (a saved spec writes `stall: 60`, not 60.0), else a float; the spec checks its range."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _number_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or auto, got {text!r}") from None


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="harness", description=__doc__.split("\n\n")[0])
    top.add_argument("--version", action="version", version=f"harness {__version__}")
    verbs = top.add_subparsers(dest="verb", required=True, metavar="VERB")
    top.set_defaults(verbs=verbs)
    job = _job_arguments()
    runs_dir = argparse.ArgumentParser(add_help=False)
    runs_dir.add_argument("--runs-dir", help=RUNS_DIR_HELP)
    _render_verb(verbs, job, runs_dir)
    _launch_verb(verbs, job, runs_dir)
    _stop_verb(verbs, runs_dir)
    _attach_verb(verbs, runs_dir)
    _stacks_verb(verbs, runs_dir)
    _status_verb(verbs, runs_dir)
    _top_verb(verbs, runs_dir)
    _logs_verb(verbs, runs_dir)
    _report_verb(verbs, runs_dir)
    _preflight_verb(verbs)
    _hosts_verb(verbs)
    prepare = verbs.add_parser("prepare", add_help=False, help="download and verify CIFAR-10 once, before training "
                               "(harness prepare --data-dir DIR; --help for options)")
    prepare.set_defaults(func=commands.prepare)
    # Not for users (no help: not listed): what the batch script of `harness launch --target slurm` runs.
    batch_step = verbs.add_parser(INTERNAL_VERBS[0])
    batch_step.add_argument("run_dir", metavar="RUN_DIR")
    batch_step.set_defaults(func=commands.batch_step)
    # Not for users either: what the controller pod of a supervised Kubernetes job runs (k8s/).
    k8s_controller = verbs.add_parser(INTERNAL_VERBS[1])
    k8s_controller.add_argument("job", metavar="JOB")
    k8s_controller.add_argument("--runs-dir")
    k8s_controller.set_defaults(func=commands.k8s_controller)
    return top


Verbs: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"  # where each verb adds its parser


def _render_verb(verbs: Verbs, job: argparse.ArgumentParser, runs_dir: argparse.ArgumentParser) -> None:
    render = verbs.add_parser("render", parents=[job, runs_dir], epilog=_examples("render"),
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              help="print every node's exact torchrun command without running anything")
    render.add_argument("--hosts", help="host inventory (hosts.yaml); default: simulated nodes on this machine")
    render.add_argument("--format", choices=("text", "json"), default="text",
                        help="text: the commands as a shell runs them (default); json: the plan for tools")
    render.add_argument("--run-id", help="run id to render with (default: the job name); a run's plan.txt is what "
                                         "render prints with its run id and master port")
    render.add_argument("--target", choices=("torchrun", "k8s", "slurm"), default="torchrun",
                        help="torchrun: per-node commands (default); k8s: Kubernetes manifests; slurm: an sbatch "
                             "script (save it and run `sbatch FILE`)")
    render.add_argument("--out", help="with --target k8s: write DIR/<job>.yaml instead of printing")
    render.add_argument("--flavor", choices=("core", "jobset"),
                        help="with --target k8s: core (default): Service + Indexed Job, no CRDs; jobset: a JobSet "
                             "that restarts the whole job up to restarts.max times (needs the JobSet controller)")
    render.add_argument("--unsupervised", action="store_true",
                        help="with --target k8s: pods that run torchrun bare, without the harness's controller pod "
                             "(for clusters that cannot run the project's image; see docs/kubernetes.md)")
    render.set_defaults(known_hosts=None, accept_new_host_keys=False, skip_preflight=True)  # nothing connects
    render.set_defaults(func=commands.render)


def _launch_verb(verbs: Verbs, job: argparse.ArgumentParser, runs_dir: argparse.ArgumentParser) -> None:
    launch = verbs.add_parser("launch", parents=[job, runs_dir], epilog=_examples("launch"),
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              help="run the job and supervise every node")
    launch.add_argument("--hosts", help="host inventory; default: nnodes simulated nodes on this machine")
    launch.add_argument("--detach", action="store_true",
                        help="run in the background: the run outlives this terminal; see status/stop")
    launch.add_argument("--run-id", help=argparse.SUPPRESS)
    # Not for users: the controller a detached launch starts (control/detach.py), its --env pairs on its stdin.
    launch.add_argument("--detached-controller", action="store_true", help=argparse.SUPPRESS)
    launch.add_argument("--no-collapse", action="store_true",
                        help=f"show every rank's line on the terminal as it is; without it, a job of more than "
                             f"{COLLAPSE_ABOVE} ranks has identical lines from several ranks within "
                             f"{COLLAPSE_WINDOW:g} s shown as one, `[ranks 0-7]: ...` (`harness logs` gives every "
                             f"rank's line)")
    launch.add_argument("--skip-preflight", action="store_true", help="with --hosts: start without the fast checks")
    launch.add_argument("--known-hosts", help="known_hosts file for host keys (default ~/.ssh/known_hosts)")
    launch.add_argument("--accept-new-host-keys", action="store_true",
                        help="trust and record keys of hosts not yet in known_hosts (never silent otherwise)")
    launch.add_argument("--target", choices=("torchrun", "slurm"), default="torchrun",
                        help="torchrun: simulated nodes, or SSH hosts with --hosts (default); slurm: submit a batch "
                             "job with sbatch and follow it")
    for key in SLURM_OPTIONS:
        launch.add_argument(f"--{key}", help=f"with --target slurm: overrides slurm.{key} of the job")
    launch.set_defaults(func=commands.launch)


def _stop_verb(verbs: Verbs, runs_dir: argparse.ArgumentParser) -> None:
    stop = verbs.add_parser("stop", parents=[runs_dir], help="stop a running run (from any terminal)")
    stop.add_argument("run_id", metavar="RUN_ID", help=f"the run to stop: {RUN_HELP}")
    stop.add_argument("--timeout", type=_seconds, default=15.0, help="seconds to wait for the run to end")
    stop.set_defaults(func=commands.stop)


def _attach_verb(verbs: Verbs, runs_dir: argparse.ArgumentParser) -> None:
    attach = verbs.add_parser("attach", parents=[runs_dir],
                              help="take back a run whose controller is gone while its nodes run on "
                                   "(supervision.grace)",
                              description="A new controller, in this terminal, for a run whose own is gone (killed, "
                                          "its machine or network lost) while its nodes' agents hold them "
                                          "(supervision.grace, 300 s by default; `harness status` says `running, "
                                          "unwatched`): the run goes on as it would have, to its end. Simulated "
                                          "nodes and SSH hosts, from the machine that launched the run (on "
                                          "Kubernetes the Job's next controller pod takes the run back by itself). "
                                          "Example: harness attach latest")
    attach.add_argument("run_id", metavar="RUN_ID", help=f"the run: {RUN_HELP}")
    attach.set_defaults(func=commands.attach)


def _stacks_verb(verbs: Verbs, runs_dir: argparse.ArgumentParser) -> None:
    stacks = verbs.add_parser("stacks", parents=[runs_dir],
                              help="every rank's Python stack of a running run, alike ones grouped (the job goes on)")
    stacks.add_argument("run_id", metavar="RUN_ID", help=f"a running run: {RUN_HELP}")
    stacks.add_argument("--timeout", type=_seconds, default=30.0, help="seconds to wait for the nodes' answer")
    stacks.set_defaults(func=commands.stacks)


def _status_verb(verbs: Verbs, runs_dir: argparse.ArgumentParser) -> None:
    status = verbs.add_parser("status", parents=[runs_dir],
                              help="list runs, or show one run: its nodes, and every rank while it runs")
    status.add_argument("run_id", nargs="?", metavar="RUN_ID",
                        help=f"one run to show node by node: {RUN_HELP} (default: list the runs)")
    status.set_defaults(func=commands.status)


def _hosts_verb(verbs: Verbs) -> None:
    hosts = verbs.add_parser("hosts", help="the hosts kept out of every run after they failed, why and until when",
                             epilog="examples:\n  harness hosts\n  harness hosts --release h2",
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    hosts.add_argument("--release", metavar="HOST",
                       help="bring a host back before its cool-down ends: its inventory name or address, or all")
    hosts.set_defaults(func=commands.hosts)


def _top_verb(verbs: Verbs, runs_dir: argparse.ArgumentParser) -> None:
    top = verbs.add_parser("top", parents=[runs_dir], help="a running run's ranks live: state, CPU, step, last line, "
                           "and its stream below (q quits; the job never waits for it)")
    top.add_argument("run_id", metavar="RUN_ID", help=f"a running run: {RUN_HELP}")
    top.add_argument("--once", action="store_true", help="print one screen and return (as off a terminal)")
    top.set_defaults(func=commands.top)


def _logs_verb(verbs: Verbs, runs_dir: argparse.ArgumentParser) -> None:
    logs = verbs.add_parser("logs", parents=[runs_dir], help="a run's output in time order, as its stream showed it "
                            "(the lines held back from the terminal too), by rank, node or attempt",
                            epilog="examples:\n  harness logs RUN_ID --rank 3 --grep 'loss|Error'\n"
                                   "  harness logs RUN_ID --since 5m --follow",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    logs.add_argument("run_id", metavar="RUN_ID", help=RUN_HELP)
    logs.add_argument("--rank", type=_ranks, metavar="R[,R...]",
                      help="only these global ranks' lines (ranges too: 0-7,12)")
    logs.add_argument("--node", type=_node, metavar="N", help="only node N's lines (its ranks' and torchrun's own; "
                                                             "N or nodeN, as the lines name it)")
    logs.add_argument("--attempt", type=_attempt, default=None, metavar="N|all",
                      help="only attempt N's lines (default: all attempts)")
    logs.add_argument("--grep", type=_regex, metavar="REGEX", help="only lines this regular expression finds")
    logs.add_argument("--since", type=_duration, metavar="DURATION",
                      help="only lines of the last DURATION (90s, 5m, 1h30m, 2d)")
    logs.add_argument("--timestamps", action="store_true", help="each line with the time it arrived (UTC)")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="go on printing lines as they come, until the run ends")
    logs.set_defaults(func=commands.logs)


def _report_verb(verbs: Verbs, runs_dir: argparse.ArgumentParser) -> None:
    report = verbs.add_parser("report", parents=[runs_dir],
                              help="one run as a self-contained HTML page: its attempts, health verdicts and failures "
                                   "on a time axis, every rank's CPU use, waiting and step rate, each node's end")
    report.add_argument("run_id", metavar="RUN_ID", help=f"a running or ended run: {RUN_HELP}")
    report.add_argument("-o", "--output", metavar="FILE",
                        help="where to write the page (default: report.html in the run's directory; - for stdout)")
    report.set_defaults(func=commands.report)


def _preflight_verb(verbs: Verbs) -> None:
    preflight = verbs.add_parser("preflight", help="prove before launch that every host can run the job")
    preflight.add_argument("hosts", nargs="?", help="host inventory, e.g. hosts.yaml (none with --target slurm)")
    preflight.add_argument("--target", choices=("ssh", "slurm"), default="ssh",
                           help="ssh: the inventory's hosts (default); slurm: the nodes of the Slurm allocation this "
                                "runs in (salloc), each check an srun step")
    preflight.add_argument("--job", help="job spec: its port, backend, GPUs and entrypoint are checked too")
    preflight.add_argument("--json", action="store_true", help="the same report as JSON")
    preflight.add_argument("--collective", action="store_true",
                           help="also run a short all_reduce across all hosts with the job's backend")
    preflight.add_argument("--known-hosts", help="known_hosts file for host keys (default ~/.ssh/known_hosts)")
    preflight.add_argument("--accept-new-host-keys", action="store_true",
                           help="trust and record keys of hosts not yet in known_hosts")
    preflight.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per step")
    preflight.add_argument("--runs-dir", help="with --target slurm: the runs directory `harness launch --target slurm` "
                                              "will use (default ./runs); every node must see it")
    preflight.set_defaults(func=commands.preflight)


INTERNAL_VERBS = ("batch-step", "k8s-controller")  # what the harness runs itself: a Slurm batch step, a pod


def _known_verb(top: argparse.ArgumentParser, given: list[str]) -> None:
    """A verb that is not one: the nearest verb named, the user's verbs listed (not the internal ones)."""
    if not given or given[0].startswith("-"):
        return
    verbs = [verb for verb in top.get_default("verbs").choices if verb not in INTERNAL_VERBS]
    if given[0] in verbs or given[0] in INTERNAL_VERBS:
        return
    near = difflib.get_close_matches(given[0], verbs, n=1)
    top.error(f"unknown verb {given[0]!r}" + (f" (did you mean {near[0]!r}?)" if near else "") +
              f"; the verbs: {', '.join(verbs)}")


def _meant_flag(verb: argparse.ArgumentParser, passthrough: list[str]) -> str:
    """` (did you mean --nnodes?)` for a misspelt flag of the verb's."""
    flags = [flag for flag in verb._option_string_actions if flag.startswith("--")]
    meant = [(word, near[0]) for word in passthrough if word.startswith("--")
             if (near := difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.8))]
    return "".join(f" ({word.split('=')[0]}: did you mean {flag}?)" for word, flag in meant)


def parsed(given: list[str]) -> argparse.Namespace:
    """The command line's words as the verb's arguments; argparse's usage error (exit 2) for what does not parse."""
    top = parser()
    script_args: list[str] = []
    if given[:1] in (["launch"], ["render"]):
        given, script_args = _split_script_args(given)
    _known_verb(top, given)
    args, passthrough = top.parse_known_args(given)
    if passthrough and args.verb != "prepare":
        verb = args.verbs.choices[args.verb]
        unknown = f"unrecognized arguments: {' '.join(passthrough)}{_meant_flag(verb, passthrough)}"
        if args.verb in ("launch", "render") and (args.module or not str(args.job).endswith((".yaml", ".yml"))):
            from harness.spec.secrets import shown_words

            fixed = ["harness", args.verb, *command_line(verb, args, _NOT_RERUN), "--", *passthrough, *script_args]
            verb.error(f"{unknown}; the script's own arguments go after `--`: {shlex.join(shown_words(fixed))}")
        verb.error(unknown)
    if args.verb in ("launch", "render"):
        if args.job is None and args.module is None and script_args:
            args.job = script_args.pop(0)
        args.script_args = script_args
    args.passthrough = passthrough
    return args


def rerun_words(args: argparse.Namespace) -> list[str]:
    """args as a command line without --detach, which a detached run re-runs."""
    return [args.verb, *command_line(args.verbs.choices[args.verb], args, _NOT_RERUN)]


def main(argv: list[str] | None = None) -> int:
    args = parsed(sys.argv[1:] if argv is None else argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if getattr(args, "detached_controller", False):
            from harness.control.detach import env_pairs_from

            args.env = [*args.env, *env_pairs_from(sys.stdin)]
        args.rerun = rerun_words(args)
        return int(func(args))
    except HarnessError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # while reading a file or connecting: nothing was started yet
        print("harness: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader had enough (`harness logs RUN | head`): a normal end
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush into the pipe
        return 0


if __name__ == "__main__":
    sys.exit(main())
