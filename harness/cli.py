"""The `harness` command: render, launch, stop, status, preflight, prepare."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from harness import __version__
from harness.errors import HarnessError, UsageError
from harness.run.records import check_run_id, find_run, new_run_id, run_dir, runs_root, write_text_atomic
from harness.spec.job import JobSpec, Slurm, load_job
from harness.targets.base import Backend


def backend_for(args: argparse.Namespace) -> Backend:
    """Simulated nodes on this machine without an inventory; SSH hosts with one."""
    if args.hosts is None:
        from harness.targets.local.backend import LocalBackend

        return LocalBackend()
    from harness.spec.inventory import load_inventory
    from harness.targets.ssh.backend import SSHBackend, SSHOptions

    options = SSHOptions(known_hosts=args.known_hosts, accept_new_host_keys=args.accept_new_host_keys,
                         preflight=not args.skip_preflight)
    return SSHBackend(load_inventory(args.hosts), options)


def cmd_render(args: argparse.Namespace) -> int:
    if args.flavor is not None and args.target != "k8s":
        raise UsageError("--flavor is for --target k8s")
    spec = load_job(args.job)
    if args.target == "k8s":
        from harness.targets.k8s.manifests import code_files, manifests_yaml

        code = code_files(spec, Path.cwd())
        text = manifests_yaml(spec, Path(args.job).read_text(), args.job, args.flavor or "core", code=code)
        if args.out is None:
            sys.stdout.write(text)
            return 0
        out = Path(args.out) / f"{spec.name}.yaml"
        if out.parent.exists() and not out.parent.is_dir():
            raise UsageError(f"--out {args.out} is a file; give the directory to write {out.name} into")
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out, text)
        except OSError as exc:
            raise HarnessError(f"cannot write {out}: {exc.strerror}") from None
        # Client-side apply copies each object into an annotation, which may hold 256 KiB: too little for code.
        apply = "kubectl apply --server-side" if code else "kubectl apply"
        print(f"wrote {out}; apply with: {apply} -f {os.path.join(args.out, '')}")
        return 0
    if args.out is not None:
        raise UsageError("--out is for --target k8s; redirect stdout to save a torchrun plan or a batch script")
    if args.target == "slurm":
        from harness.targets.slurm.batch import batch_script

        sys.stdout.write(batch_script(spec, args.job))
        return 0
    from harness.plan.render import render_json, render_text

    plan = backend_for(args).plan(spec, check_run_id(args.run_id or spec.name))
    sys.stdout.write(render_json(plan) if args.format == "json" else render_text(plan))
    return 0


SLURM_FLAGS = ("partition", "account", "qos", "time", "constraint")  # launch flags that override slurm:


def with_slurm_flags(spec: JobSpec, args: argparse.Namespace) -> JobSpec:
    """The spec with `--partition P`-style flags in its slurm: section, validated as the file's values are."""
    given = {key: value for key in SLURM_FLAGS if (value := getattr(args, key)) is not None}
    if given and args.target != "slurm":
        raise UsageError(f"--{next(iter(given))} is for --target slurm")
    try:
        return spec.model_copy(update={"slurm": Slurm.model_validate(spec.slurm.model_dump() | given)})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UsageError(f"--{first['loc'][0]}: {first['msg'].removeprefix('Value error, ')}") from None


def cmd_launch(args: argparse.Namespace) -> int:
    from harness.run import controller

    spec = with_slurm_flags(load_job(args.job), args)
    root = runs_root(args.runs_dir)
    if args.target == "slurm" and args.hosts:
        raise UsageError("--hosts is for SSH hosts; with --target slurm, Slurm picks the nodes")
    if args.detach:
        run = run_dir(root, new_run_id(spec.name))
        argv = [sys.executable, "-m", "harness.cli", "launch", args.job, "--runs-dir", str(root), "--run-id",
                run.run_id, "--target", args.target]
        argv += ["--hosts", args.hosts] if args.hosts else []
        argv += ["--known-hosts", args.known_hosts] if args.known_hosts else []
        argv += [flag for flag, on in (("--skip-preflight", args.skip_preflight),
                                       ("--accept-new-host-keys", args.accept_new_host_keys)) if on]
        argv += [f"--{key}={getattr(args, key)}" for key in SLURM_FLAGS if getattr(args, key) is not None]
        return controller.start_detached(argv, run)
    run_id = check_run_id(args.run_id) if args.run_id else new_run_id(spec.name)
    if args.target == "slurm":
        from harness.targets.slurm.srun import Allocation, SrunBackend, in_allocation

        if in_allocation(os.environ):  # salloc, or a batch script: the nodes are ours, as srun steps
            return controller.launch(SrunBackend(Allocation.from_env(os.environ)), spec, Path(args.job), root, run_id)
        from harness.targets.slurm import scheduler as slurm_run
        from harness.targets.slurm.client import SlurmClient

        return slurm_run.launch(SlurmClient(), spec, Path(args.job), root, run_id)
    return controller.launch(backend_for(args), spec, Path(args.job), root, run_id)


def cmd_stop(args: argparse.Namespace) -> int:
    from harness.run.controller import stop_run

    return stop_run(find_run(runs_root(args.runs_dir), args.run_id), timeout=args.timeout)


def cmd_status(args: argparse.Namespace) -> int:
    from harness.run.status import status_text

    sys.stdout.write(status_text(runs_root(args.runs_dir), args.run_id))
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from harness.preflight import preflight_command

    return preflight_command(args.hosts, args.job, json_out=args.json, collective=args.collective,
                             accept_new_host_keys=args.accept_new_host_keys, known_hosts=args.known_hosts,
                             timeout=args.timeout, slurm=args.target == "slurm")


def cmd_prepare(args: argparse.Namespace) -> int:
    from harness.payload import prepare

    return prepare.main(args.passthrough)


def _seconds(text: str) -> float:
    """A positive, finite number of seconds, or argparse's usage error (exit 2) naming the option."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"expected seconds between 0 and 86400, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="harness", description=__doc__)
    top.add_argument("--version", action="version", version=f"harness {__version__}")
    verbs = top.add_subparsers(dest="verb", required=True, metavar="VERB")

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
    render.set_defaults(func=cmd_render)

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
    for key in SLURM_FLAGS:
        launch.add_argument(f"--{key}", help=f"with --target slurm: overrides slurm.{key} of the job")
    launch.set_defaults(func=cmd_launch)

    stop = verbs.add_parser("stop", parents=[runs_dir], help="stop a running run (from any terminal)")
    stop.add_argument("run_id")
    stop.add_argument("--timeout", type=_seconds, default=15.0, help="seconds to wait for the run to end")
    stop.set_defaults(func=cmd_stop)

    status = verbs.add_parser("status", parents=[runs_dir], help="list runs, or show one run's nodes")
    status.add_argument("run_id", nargs="?")
    status.set_defaults(func=cmd_status)
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
    preflight.set_defaults(func=cmd_preflight)

    prepare = verbs.add_parser("prepare", add_help=False, help="download and verify CIFAR-10 once, before training "
                               "(harness prepare --data-dir DIR; --help for options)")
    prepare.set_defaults(func=cmd_prepare)
    return top


def main(argv: list[str] | None = None) -> int:
    top = parser()
    args, passthrough = top.parse_known_args(argv)
    if passthrough and args.verb != "prepare":
        top.error(f"unrecognized arguments: {' '.join(passthrough)}")
    args.passthrough = passthrough
    try:
        return int(args.func(args))
    except HarnessError as exc:
        print(f"harness: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # while reading a file or connecting: nothing was started yet
        print("harness: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
