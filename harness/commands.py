"""What each verb of `harness` does with its parsed arguments (cli.py parses and dispatches): build the
target a run needs, with preflight's checks handed to it, and call the renderer, the run controller,
status or preflight."""

from __future__ import annotations

import argparse
import os
import resource
import secrets
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from harness.errors import HarnessError, UsageError
from harness.record.atomic import write_bytes_atomic, write_text_atomic
from harness.record.index import find_run
from harness.record.rundir import check_run_id, new_run_id, run_dir, runs_root
from harness.record.schema import FailureKind, Origin
from harness.spec.from_flags import ScriptFlags, spec_from_flags, spec_yaml, with_spec_file_flags
from harness.spec.job import SLURM_OPTIONS, JobSpec, Slurm, load_job
from harness.spec.secrets import env_apart, secret_values, shown_words
from harness.targets.base import Backend, Scheduler


def backend_for(args: argparse.Namespace) -> Backend:
    """Simulated nodes on this machine without an inventory; SSH hosts with one. Unless
    --skip-preflight, each is handed preflight's fast checks to pass before it starts nodes."""
    check = not args.skip_preflight
    if args.hosts is None:
        from harness.preflight.local import workdir_gate
        from harness.targets.local.backend import LocalBackend

        return LocalBackend(sys.executable, check=workdir_gate(sys.executable))
    from harness.preflight.gates import hosts_gate
    from harness.spec.inventory import load_inventory
    from harness.targets.ssh.backend import SSHBackend, SSHOptions

    inventory = load_inventory(args.hosts)
    options = SSHOptions(known_hosts=args.known_hosts, accept_new_host_keys=args.accept_new_host_keys)
    return SSHBackend(inventory, options, check=hosts_gate(inventory, options) if check else None)


def scheduler_for(mode: str) -> Scheduler:
    """The scheduler a run's mode names (the run record keeps the mode)."""
    if mode != "slurm":
        raise UsageError(f"no scheduler for runs of mode {mode!r}")
    from harness.targets.slurm.scheduler import SbatchScheduler

    return SbatchScheduler()


@dataclass(frozen=True)
class Job:
    """The job a command runs: from a spec file, or built from a script's flags (harness.spec.from_flags)."""

    spec: JobSpec
    text: str  # the spec as its file holds it: kept in the run directory, shipped to pods
    source: str  # where it came from: the file, or the command that made it


def job_of(args: argparse.Namespace) -> Job:
    """A spec file (*.yaml) as it is, but for the flags that win over its keys (--stall, ...); a script or
    -m module with torchrun's flags as the spec they make, also written to --save-job."""
    flags = ScriptFlags(script=None if args.module else args.job, module=args.module, args=args.script_args,
                        name=args.name, min_nnodes=args.nnodes.fewest if args.nnodes else None,
                        nnodes=args.nnodes.nodes if args.nnodes else None, nproc_per_node=args.nproc_per_node,
                        master_port=args.master_port, rdzv=args.rdzv, backend=args.backend,
                        max_restarts=args.max_restarts, env=args.env, stall=args.stall, slow=args.slow,
                        metrics_port=args.metrics_port, metrics_address=args.metrics_address)
    command = shlex.join(shown_words(["harness", *args.rerun]))  # kept and shown: secret-looking --env values masked
    if args.module is None and args.job is not None and args.job.endswith((".yaml", ".yml")):
        refused = flags.given(script_only=True) + (["--save-job"] if args.save_job else [])
        if refused or args.script_args:
            what = refused[0] if refused else f"`-- {shlex.join(args.script_args)}`"
            raise UsageError(f"{what} is for a script launch (harness launch train.py --nnodes 2); {args.job} is a "
                             f"job spec: set its keys there (docs/job-spec.md)")
        spec = with_spec_file_flags(load_job(args.job), flags)  # the file's errors first, located
        text = Path(args.job).read_text()
        if flags.given():  # --stall, ...: the run's spec.yaml says that they won over the file's keys
            text = f"# Launched with: {command} (its flags override this file's keys)\n{text}"
        return Job(spec, text, args.job)
    if args.job is None and args.module is None:
        raise UsageError("expected a job spec (jobs/cifar.yaml), a script (train.py) or -m MODULE")
    if args.job is not None and args.module is not None:
        raise UsageError(f"give a script ({args.job}) or -m {args.module}, not both")
    spec = spec_from_flags(flags)
    if args.save_job is not None:
        _save_job(Path(args.save_job), spec_yaml(flags, command, args.save_job), env_apart(spec.env)[1])
    return Job(spec, spec_yaml(flags, command), command)


def write_file(path: Path, text: str, what: str = "", make_folder: bool = False) -> None:
    """A file a verb writes for the user, whole or not at all; what: the flag it came from, for the error."""
    try:
        if make_folder:
            path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    except OSError as exc:
        raise HarnessError(f"{what}cannot write {path}: {exc.strerror}") from None


def _save_job(path: Path, text: str, secret_looking: Iterable[str]) -> None:
    """secret_looking: the --env names whose values the file does not hold (it takes them from secrets:)."""
    if path.exists():
        raise UsageError(f"--save-job {path}: the file exists; remove it or name another (it is never overwritten)")
    write_file(path, text, "--save-job: ")
    exported = " ".join(f"{name}=..." for name in secret_looking)
    print(f"wrote {path}; launch it again with: " + (f"export {exported}; " if exported else "") +
          f"harness launch {path}" + (" (the values of --env names that look secret are not in the file: it takes "
                                      "them from the launching environment, secrets:)" if exported else ""),
          file=sys.stderr)


def render(args: argparse.Namespace) -> int:
    if args.flavor is not None and args.target != "k8s":
        raise UsageError("--flavor is for --target k8s")
    if args.unsupervised and args.target != "k8s":
        raise UsageError("--unsupervised is for --target k8s")
    job = job_of(args)
    spec = job.spec
    if args.target == "k8s":
        _note_secret_env(spec, "harness render: env.{name} looks like a secret, and the manifests hold its value in "
                               "clear: move it to secrets: (docs/security.md)")
    if args.target == "slurm":
        _note_secret_env(spec, "harness render: env.{name} looks like a secret: the batch script holds no value of it "
                               "and takes {name} from the environment sbatch runs in (export it before sbatch), or "
                               "move it to secrets: (docs/security.md)")
    if args.target == "k8s":
        _write_manifests(args, job)
        if args.unsupervised or not spec.k8s.supervised:  # supervised pods go on with fewer as any supervised nodes
            _note_fixed_size(spec, args.target, "render")
        return 0
    if args.out is not None:
        raise UsageError("--out is for --target k8s; redirect stdout to save a torchrun plan or a batch script")
    if args.target == "slurm":
        from harness.targets.slurm.batch import batch_script

        sys.stdout.write(batch_script(spec, job.source, _rendered_by(args, job)))
        _note_fixed_size(spec, args.target, "render")
        return 0
    from harness.plan.render import render_json, render_text

    run_id = check_run_id(args.run_id or spec.name)
    backend = backend_for(args)
    # A local plan names the run directory it logs to: with the run's id, this is that run's plan.txt.
    plan = backend.plan(spec, run_id)
    if spec.master_port == "auto":
        where = "this machine" if args.hosts is None else "the master host"
        print(f"harness render: master_port is auto: port {plan.master_port} is shown; each launch picks a port that "
              f"is free on {where} then (--master-port N fixes one)", file=sys.stderr)
    sys.stdout.write(render_json(plan) if args.format == "json" else render_text(plan))
    return 0


# Who restarts a rendered job, and on what: it never goes on with fewer nodes.
SCHEDULER_RESTARTS = {"slurm": "this script's job Slurm requeues on nnodes nodes it allocates afresh (`harness "
                               "launch --target slurm` goes on with fewer)",
                      "k8s": "unsupervised, Kubernetes (--flavor jobset) recreates all nnodes pods"}


def _note_fixed_size(spec: JobSpec, target: str, verb: str) -> None:
    """restarts.min_nnodes is for the nodes the harness supervises; say so where a scheduler restarts."""
    if spec.fewest_nnodes < spec.nnodes:
        print(f"harness {verb}: restarts.min_nnodes ({spec.fewest_nnodes}) is for nodes the harness supervises "
              f"(simulated, --hosts, Slurm's nodes under `harness launch`, supervised pods); "
              f"{SCHEDULER_RESTARTS[target]}",
              file=sys.stderr)


def _rendered_by(args: argparse.Namespace, job: Job) -> str | None:
    """The command that renders this again, for the header of what render writes, where the spec came from
    flags (a script); None for a spec file, whose header names the file."""
    return None if job.source == args.job else job.source


def _write_manifests(args: argparse.Namespace, job: Job) -> None:
    from harness.targets.k8s.manifests import code_files, manifests_yaml
    from harness.targets.k8s.objects import APPLY, secret_commands

    spec = job.spec
    code = code_files(spec, Path.cwd())
    text = manifests_yaml(spec, job.text, job.source, args.flavor or "core", code=code, command=_rendered_by(args, job),
                          supervised=False if args.unsupervised else None)
    if args.out is None:
        sys.stdout.write(text)
        return
    out = Path(args.out) / f"{spec.name}.yaml"
    if out.parent.exists() and not out.parent.is_dir():
        raise UsageError(f"--out {args.out} is a file; give the directory to write {out.name} into")
    write_file(out, text, make_folder=True)
    # The file, not the folder: another job rendered there is not applied with this one.
    print(f"wrote {out}; apply with: {APPLY} -f {out}")
    for command in secret_commands(spec):
        print(f"the pods need the job's secrets; create them first: {command}")


def _note_secret_env(spec: JobSpec, said: str) -> None:
    """A value that looks like a secret but is written in env: said once per name on the terminal (said, with the
    name as {name}), never its value."""
    for name in env_apart(spec.env)[1]:
        print(said.format(name=name), file=sys.stderr)


def with_slurm_flags(spec: JobSpec, args: argparse.Namespace) -> JobSpec:
    """The spec with `--partition P`-style flags in its slurm: section, validated as the file's values are."""
    given = {key: value for key in SLURM_OPTIONS if (value := getattr(args, key)) is not None}
    if given and args.target != "slurm":
        raise UsageError(f"--{next(iter(given))} is for --target slurm")
    try:
        return spec.model_copy(update={"slurm": Slurm.model_validate(spec.slurm.model_dump() | given)})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise UsageError(f"--{first['loc'][0]}: {first['msg'].removeprefix('Value error, ')}") from None


def open_files_as_allowed() -> None:
    """The soft limit on open files raised to the hard one, as srun does: a controller holds a few per node (its
    pipes or SSH socket, the node's log and record), and the usual soft limit of 1,024 ends a run of some 300 nodes
    (docs/architecture.md, "Scale")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def launch(args: argparse.Namespace) -> int:
    """args.rerun: these arguments as a command line without --detach, which a detached run re-runs."""
    job = job_of(args)
    return launch_job(args, job, check_run_id(args.run_id) if args.run_id else new_run_id(job.spec.name))


def launch_job(args: argparse.Namespace, job: Job, run_id: str) -> int:
    """`harness launch` of job as run_id, from the terminal or harness.launch: its exit status."""
    from harness.control import controller

    open_files_as_allowed()
    spec = with_slurm_flags(job.spec, args)
    if not args.detached_controller:  # the launch that started this controller said it on its terminal
        where = "this command line (and so your shell's history)" if job.source != args.job else job.source
        _note_secret_env(spec, f"harness: env.{{name}} looks like a secret: the harness shows it as *** and puts it "
                               f"on no command line, but {where} holds it in clear; secrets: takes it from your "
                               f"environment or a file instead (docs/security.md#secrets)")
    root = runs_root(args.runs_dir)
    if args.target == "slurm" and args.hosts:
        raise UsageError("--hosts is for SSH hosts; with --target slurm, Slurm picks the nodes")
    target = _target(args, spec)
    secret_values(spec)  # each is there to read: a missing one fails here, before anything starts
    if args.detach and not isinstance(target, Scheduler):
        from harness.control.detach import controller_argv, start_detached

        run = run_dir(root, run_id)
        return start_detached(controller_argv(args.rerun, root, run.run_id), run, args.env)
    if isinstance(target, Scheduler):  # the controller in the job's batch step serves them
        return controller.launch(target, spec, job.text, job.source, root, run_id, detach=args.detach,
                                 collapse=not args.no_collapse)
    from harness.view.metrics import LOOPBACK, serving_metrics

    with serving_metrics(run_dir(root, run_id), spec.health.metrics_port, spec.health.metrics_address or LOOPBACK) \
            as metrics:
        return controller.launch(target, spec, job.text, job.source, root, run_id, collapse=not args.no_collapse,
                                 metrics=metrics, origin=_origin(args, job))


def _origin(args: argparse.Namespace, job: Job) -> Origin:
    """Where a run is launched from, for `harness attach` to build its target again from any terminal."""
    spec_file = str(Path(job.source).resolve()) if job.source.endswith((".yaml", ".yml")) else None
    return Origin(cwd=os.getcwd(), spec_file=spec_file,
                  hosts=str(Path(args.hosts).resolve()) if args.hosts else None,
                  known_hosts=str(Path(args.known_hosts).expanduser().resolve()) if args.known_hosts else None,
                  accept_new_host_keys=args.accept_new_host_keys)


def attach(args: argparse.Namespace) -> int:
    """A controller for a run whose own is gone while its nodes' agents hold them (supervision.grace)."""
    from harness.control import controller
    from harness.record.liveness import live_status
    from harness.record.schema import RunStatus
    from harness.view.metrics import LOOPBACK, serving_metrics

    open_files_as_allowed()
    run = find_run(args.runs_dir, args.run_id)
    state = run.read_state()
    status = live_status(state, run)
    if status is RunStatus.RUNNING:
        raise UsageError(f"run {run.run_id} has its controller (pid {state.controller.pid} on "
                         f"{state.controller.host}): nothing to take back (`harness status {run.run_id}`)")
    if status is not RunStatus.UNWATCHED:
        why = f"no node of it is held any more (supervision.grace: {state.grace:g} s)" \
            if status is RunStatus.LOST and state.grace > 0 else f"it has ended ({status.value})"
        raise UsageError(f"run {run.run_id} cannot be taken back: {why}")
    if state.origin is None:
        raise UsageError(f"run {run.run_id} ({state.mode}) was not launched from a terminal of this machine: only "
                         f"runs of `harness launch` (simulated nodes, --hosts) are taken back")
    origin = state.origin
    os.chdir(origin.cwd)  # the job's relative paths are the launch's
    spec = _attached_spec(run.spec_copy, origin.spec_file)
    secret_values(spec)  # a later attempt reads them here: a missing one fails now, before anything is taken
    backend = backend_for(argparse.Namespace(hosts=origin.hosts, known_hosts=origin.known_hosts,
                                             accept_new_host_keys=origin.accept_new_host_keys,
                                             skip_preflight=False))
    with serving_metrics(run, spec.health.metrics_port, spec.health.metrics_address or LOOPBACK) as metrics:
        return controller.attach_run(backend, spec, run, metrics=metrics)


def _attached_spec(copy: Path, spec_file: str | None) -> JobSpec:
    """The run's spec: its file where it still says what the run's copy says (the copy has secret-looking values
    masked), else the copy, whose masked values a later attempt would get (said)."""
    from harness.spec.secrets import MASK, masked_spec_text

    kept = copy.read_text()
    if spec_file is not None and Path(spec_file).is_file():
        text = Path(spec_file).read_text()
        if masked_spec_text(text) == kept:
            return load_job(spec_file)
    if MASK in kept:
        print(f"harness: the job's spec file is gone or changed since the launch: a later attempt runs with the "
              f"run's copy ({copy}), whose secret-looking env values are ***", file=sys.stderr)
    return load_job(str(copy))


def _target(args: argparse.Namespace, spec: JobSpec) -> Backend | Scheduler:
    if args.target != "slurm":
        return backend_for(args)
    from harness.targets.slurm.srun import Allocation, SrunBackend, in_allocation

    if in_allocation(os.environ):  # salloc, or a batch script: the nodes are ours, as srun steps
        return SrunBackend(Allocation.from_env(os.environ))
    from harness.targets.slurm.scheduler import SbatchScheduler

    return SbatchScheduler(kept_out=slurm_nodes_out())


def slurm_nodes_out() -> dict[str, str]:
    """The Slurm nodes kept out after they failed (record/hosts_out.py), which a submission and a requeue exclude:
    node -> what a run says of it."""
    from harness.record.hosts_out import hosts_file, hosts_out
    from harness.targets.slurm.srun import slurm_machine

    return {entry.name: entry.said() for entry in hosts_out(hosts_file()) if entry.machine == slurm_machine(entry.name)}


def batch_step(args: argparse.Namespace) -> int:
    """The controller in a Slurm batch job's batch step (targets/slurm/batch.controller_script): it
    continues the run that `harness launch --target slurm` made, on the allocation's nodes as srun steps;
    after a requeue, the job's next run continues the same run."""
    from harness.control import controller
    from harness.control.continued import Continued, earlier_attempts
    from harness.record.rundir import RunDir
    from harness.targets.slurm.client import SlurmClient
    from harness.targets.slurm.job_file import read_job
    from harness.targets.slurm.srun import Allocation, SrunBackend

    run = RunDir(Path(args.run_dir).resolve())
    spec = read_job(run.job_file)
    run.time_limit_marker.unlink(missing_ok=True)  # an earlier allocation's
    client, job_id = SlurmClient(), int(os.environ["SLURM_JOB_ID"])
    before = earlier_attempts(run, requeued=int(os.environ.get("SLURM_RESTART_COUNT") or 0))
    continued = Continued(run, before, lambda: TIME_LIMIT if run.time_limit_marker.exists() else None,
                          lambda: client.requeue(job_id, exclude=list(slurm_nodes_out())))
    from harness.view.metrics import LOOPBACK, serving_metrics

    with serving_metrics(run, spec.health.metrics_port, spec.health.metrics_address or LOOPBACK) as metrics:
        return controller.continue_run(SrunBackend(Allocation.from_env(os.environ, client)), spec, continued,
                                       metrics=metrics)


TIME_LIMIT = "Slurm's time-limit warning"


def k8s_controller(args: argparse.Namespace) -> int:
    """The controller pod of a supervised Kubernetes job (targets/k8s/manifests.py): the run on the job's worker
    pods, which dial in (targets/k8s/pods.py); its exit code is what the Job's podFailurePolicy reads. The Job runs
    one controller pod at a time: a new one (its predecessor evicted, its node lost) takes back the run it left on
    the volume while that run's agents hold its nodes (supervision.grace), else starts a run."""
    from harness.control import controller
    from harness.record.liveness import left_by_a_lost_controller
    from harness.targets.k8s.pods import PodLink, PodsBackend, WorkerPods
    from harness.targets.k8s.supervised import INFRA_EXIT
    from harness.view.metrics import EVERY_INTERFACE, serving_metrics

    open_files_as_allowed()
    spec = load_job(args.job)
    root = runs_root(args.runs_dir)
    left = left_by_a_lost_controller(root, spec.name, "k8s", spec.supervision.grace,
                                     lambda line: print(f"harness: {line}", file=sys.stderr, flush=True))
    run = left or run_dir(root, new_run_id(spec.name))
    if tools := os.environ.get("HARNESS_K8S_TOOLS"):
        share_tools(Path(tools))
    link = PodLink(spec.k8s.port, _new_link_key(Path(os.environ["HARNESS_K8S_LINK_KEY"])), run.run_id,
                   WorkerPods.of(spec))
    backend = PodsBackend(link,
                          os.environ.get("HARNESS_K8S_CODE") or None, spec.k8s.rejoin,
                          stopped=run.stop_marker.exists,  # the pod's preStop hook: `harness stop`
                          held=run.read_state().hosts if left else ())
    try:
        with serving_metrics(run, spec.health.metrics_port, spec.health.metrics_address or EVERY_INTERFACE) as metrics:
            code = controller.attach_run(backend, spec, run, metrics=metrics) if left else \
                controller.launch(backend, spec, Path(args.job).read_text(), args.job, root, run.run_id,
                                  metrics=metrics, taken_back_by="the Job's next controller pod")
    finally:
        backend.link.dismiss(0)  # the worker pods did their part; the controller's Job says how the run ended
    summary = run.read_summary()
    failed_by = summary.attempts[-1].kind if summary is not None and summary.attempts else None
    return INFRA_EXIT if code == 1 and failed_by in (FailureKind.INFRA, FailureKind.HANG) else code


def share_tools(directory: Path) -> None:
    """py-spy (a static binary: it runs in any image), from the controller's image onto the job's volume, where
    every worker pod finds it on its PATH (node/pod.py --tools): the ranks' stacks without it in the job's image.
    Every pod of the job can write there: the copy follows no link planted in its way (write_bytes_atomic)."""
    from harness.node.ranks import py_spy_path

    found = py_spy_path()
    if found is None:
        return
    directory.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(directory / "py-spy", Path(found).read_bytes(), 0o755)


def _new_link_key(path: Path) -> bytes:
    """A key of this run's own for the pod link, written where the worker pods read it: the job's volume, which only
    the job's pods mount and which already holds what they run (docs/architecture.md says why there), readable by
    the pods' user alone."""
    key = secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, key, 0o600)
    return key.encode()


def stop(args: argparse.Namespace) -> int:
    from harness.view.stop import stop_run

    return stop_run(find_run(args.runs_dir, args.run_id), args.timeout, scheduler_for)


def stacks(args: argparse.Namespace) -> int:
    from harness.view.stacks import run_stacks

    sys.stdout.write(run_stacks(find_run(args.runs_dir, args.run_id), args.timeout))
    return 0


def status(args: argparse.Namespace) -> int:
    from harness.view.status import status_text

    sys.stdout.write(status_text(args.runs_dir, args.run_id))
    return 0


def hosts(args: argparse.Namespace) -> int:
    from harness.view.hosts import hosts_text, release

    sys.stdout.write(hosts_text() if args.release is None else release(args.release))
    return 0


def top(args: argparse.Namespace) -> int:
    from harness.view.top import top as show

    return show(find_run(args.runs_dir, args.run_id), once=args.once)


def logs(args: argparse.Namespace) -> int:
    from harness.view.logs import Selection, print_logs, since_stamp

    selection = Selection(args.rank, args.node, args.attempt, args.grep,
                          None if args.since is None else since_stamp(args.since), args.timestamps)
    return print_logs(find_run(args.runs_dir, args.run_id), selection, sys.stdout, follow=args.follow)


def report(args: argparse.Namespace) -> int:
    """The run's HTML page, written whole (atomically) to report.html in its directory or -o FILE, or to
    stdout with -o -; prints the path written."""
    from harness.view.report import html_report

    run = find_run(args.runs_dir, args.run_id)
    page = html_report(run)
    if args.output == "-":
        sys.stdout.write(page)
        return 0
    out = run.html_report if args.output is None else Path(args.output)
    if out.is_dir():
        raise UsageError(f"-o {out} is a directory; name the file to write (e.g. {out / 'report.html'})")
    write_file(out, page)
    print(out)
    return 0


def preflight(args: argparse.Namespace) -> int:
    from harness.preflight.verb import preflight_command

    open_files_as_allowed()
    return preflight_command(args.hosts, args.job, json_out=args.json, collective=args.collective,
                             accept_new_host_keys=args.accept_new_host_keys, known_hosts=args.known_hosts,
                             timeout=args.timeout, slurm=args.target == "slurm", runs_dir=args.runs_dir)


def prepare(args: argparse.Namespace) -> int:
    from harness.payload import prepare

    return prepare.main(args.passthrough, prog="harness prepare")
