"""The `harness` command: render, launch, stop, stacks, status, preflight, prepare.

This module parses the command line and dispatches to harness.commands, nothing more.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from harness import __version__, commands
from harness.errors import HarnessError
from harness.spec.job import SLURM_OPTIONS

# What a detached launch leaves out when it re-runs its own arguments (it adds its own run id and runs dir).
_NOT_RERUN = {"detach", "run_id", "runs_dir"}


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
    """The words that parse back to args under verb's parser: every argument it defines, at its parsed
    value (options only where they differ from their default), but those named in leave_out."""
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
        else:
            options.append(f"{action.option_strings[0]}={value}")
    # A positional that looks like an option (a job file named -x.yaml) parses only after `--`.
    return [*options, *(["--"] if any(word.startswith("-") for word in positionals) else []), *positionals]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="harness", description=__doc__.split("\n\n")[0])
    top.add_argument("--version", action="version", version=f"harness {__version__}")
    verbs = top.add_subparsers(dest="verb", required=True, metavar="VERB")
    top.set_defaults(verbs=verbs)

    render = verbs.add_parser("render", help="print every node's exact torchrun command without running anything")
    render.add_argument("job", help="job spec, e.g. jobs/cifar.yaml")
    render.add_argument("--hosts", help="host inventory (hosts.yaml); default: simulated nodes on this machine")
    render.add_argument("--format", choices=("text", "json"), default="text")
    render.add_argument("--run-id", help="run id to render with (default: the job name)")
    render.add_argument("--target", choices=("torchrun", "k8s", "slurm"), default="torchrun",
                        help="torchrun: per-node commands (default); k8s: Kubernetes manifests; slurm: an sbatch "
                             "script (save it and run `sbatch FILE`)")
    render.add_argument("--out", help="with --target k8s: write DIR/<job>.yaml instead of printing")
    render.add_argument("--flavor", choices=("core", "jobset"),
                        help="with --target k8s: core (default): Service + Indexed Job, no CRDs; jobset: a JobSet "
                             "that restarts the whole job up to restarts.max times (needs the JobSet controller)")
    render.set_defaults(known_hosts=None, accept_new_host_keys=False, skip_preflight=True)  # nothing connects
    render.set_defaults(func=commands.render)

    runs_dir = argparse.ArgumentParser(add_help=False)
    runs_dir.add_argument("--runs-dir", help="where run records live (default: $HARNESS_RUNS_DIR or ./runs)")

    launch = verbs.add_parser("launch", parents=[runs_dir], help="run the job and supervise every node")
    launch.add_argument("job")
    launch.add_argument("--hosts", help="host inventory; default: nnodes simulated nodes on this machine")
    launch.add_argument("--detach", action="store_true",
                        help="run in the background: the run outlives this terminal; see status/stop")
    launch.add_argument("--run-id", help=argparse.SUPPRESS)
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

    stop = verbs.add_parser("stop", parents=[runs_dir], help="stop a running run (from any terminal)")
    stop.add_argument("run_id")
    stop.add_argument("--timeout", type=_seconds, default=15.0, help="seconds to wait for the run to end")
    stop.set_defaults(func=commands.stop)

    stacks = verbs.add_parser("stacks", parents=[runs_dir],
                              help="every rank's Python stack of a running run, alike ones grouped (the job goes on)")
    stacks.add_argument("run_id")
    stacks.add_argument("--timeout", type=_seconds, default=30.0, help="seconds to wait for the nodes' answer")
    stacks.set_defaults(func=commands.stacks)

    status = verbs.add_parser("status", parents=[runs_dir], help="list runs, or show one run's nodes")
    status.add_argument("run_id", nargs="?")
    status.set_defaults(func=commands.status)
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
    preflight.set_defaults(func=commands.preflight)

    prepare = verbs.add_parser("prepare", add_help=False, help="download and verify CIFAR-10 once, before training "
                               "(harness prepare --data-dir DIR; --help for options)")
    prepare.set_defaults(func=commands.prepare)
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args, passthrough = top.parse_known_args(argv)
    if passthrough and args.verb != "prepare":
        top.error(f"unrecognized arguments: {' '.join(passthrough)}")
    args.passthrough = passthrough
    args.rerun = [args.verb, *command_line(args.verbs.choices[args.verb], args, _NOT_RERUN)]
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(func(args))
    except HarnessError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # while reading a file or connecting: nothing was started yet
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
