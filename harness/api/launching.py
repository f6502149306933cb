"""`harness.launch`: the launch verb's own core (harness.commands.launch_job) from Python. Its arguments become the
words `harness launch` parses, so that a launch from Python is validated, planned, checked, run and recorded as the
same launch typed in a terminal; a function becomes a job whose ranks call it (harness.api.function)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.api.function import (
    CALL_MODULE,
    keep_for,
    launched_dir,
    pickled_call,
    prune_launched,
    write_call_job,
    write_job,
)
from harness.api.handle import Run, RunFailed
from harness.errors import HarnessError, UsageError
from harness.record.atomic import make_folders
from harness.record.rundir import new_run_id, run_dir, runs_root
from harness.record.schema import RunStatus
from harness.spec.from_flags import ScriptFlags, job_name, spec_data, spec_from_flags
from harness.spec.job import JobSpec, load_job

SPEC_SUFFIXES = (".yaml", ".yml")


def launch(job: str | Path | JobSpec | Callable[..., Any] | None = None, *, args: Sequence[Any] = (),
           kwargs: Mapping[str, Any] | None = None, module: str | None = None, hosts: str | Path | None = None,
           detach: bool = False, nnodes: int | str | None = None, nproc_per_node: int | str | None = None,
           name: str | None = None, env: Mapping[str, str] | None = None, max_restarts: int | None = None,
           backend: str | None = None, master_port: int | str | None = None, rdzv: str | None = None,
           stall: float | None = None, slow: float | None = None, metrics_port: int | None = None,
           metrics_address: str | None = None, runs_dir: str | Path | None = None, collapse: bool = True,
           target: str = "torchrun", known_hosts: str | Path | None = None, accept_new_host_keys: bool = False,
           skip_preflight: bool = False) -> Run:
    """Launch a job as `harness launch` does, and return its Run: job is a spec file (jobs/cifar.yaml), a Job
    (harness.load_job), a script (train.py, with args: its arguments), module= a module (`-m`), or a function, which
    every rank calls as function(*args, **kwargs) (Run.result() gives back what it returned).

    Every other argument is the launch flag of the same name (docs/cli.md). Without detach, the run's stream is
    printed here as it comes and launch returns once the run has ended; it raises RunFailed if the run did not
    succeed (RankError, with the rank's traceback, where a function's rank raised), KeyboardInterrupt once an
    interrupt (Ctrl-C, a notebook's stop button) has stopped it; errors of the spec or the arguments raise
    HarnessError (SpecError: with the file, line and key path) before anything starts. With detach, it returns once
    the run has started, its controller in a process of its own."""
    from harness.commands import job_of, launch_job

    if job is None and module is None:
        raise UsageError("expected a job: a spec file, a Job, a script, module=, or a function")
    if not detach and threading.current_thread() is not threading.main_thread():
        raise UsageError("a launch that waits runs the run's controller in this thread, and only the main thread "
                         "gets the signals that stop it (Ctrl-C, `harness stop`): from another thread, launch with "
                         "detach=True, then run.wait()")
    job_flags = {"nnodes": nnodes, "nproc-per-node": nproc_per_node, "name": name, "max-restarts": max_restarts,
                 "backend": backend, "master-port": master_port, "rdzv-backend": rdzv}
    health_flags = {"stall": stall, "slow": slow, "metrics-port": metrics_port, "metrics-address": metrics_address}
    common = [*_words({"hosts": hosts, "runs-dir": runs_dir, "target": target if target != "torchrun" else None,
                       "known-hosts": known_hosts}),
              *_switches({"detach": detach, "no-collapse": not collapse, "accept-new-host-keys": accept_new_host_keys,
                          "skip-preflight": skip_preflight})]
    prune_launched()
    launched: Path | None  # the folder of a spec made here: the function's, or a Job's built in Python
    run_id: str | None
    function = callable(job) and not isinstance(job, JobSpec)
    if callable(job) and not isinstance(job, JobSpec):
        words, run_id, launched = _function_words(job, args, kwargs or {}, common, module=CALL_MODULE, name=name,
                                                  nnodes=nnodes, nproc_per_node=nproc_per_node, env=env,
                                                  max_restarts=max_restarts, backend=backend, master_port=master_port,
                                                  rdzv=rdzv, stall=stall, slow=slow, metrics_port=metrics_port,
                                                  metrics_address=metrics_address)
    else:
        if kwargs:
            raise UsageError("kwargs= is for a function; a script takes args= (its command line)")
        entry, launched = _entry(job, module)
        given = job_flags if entry is None or not entry.endswith(SPEC_SUFFIXES) else {}
        refused = [flag for flag, value in job_flags.items() if value is not None and not given]
        if refused:
            raise UsageError(f"{refused[0].replace('-', '_')}= is for a script or a function; {entry} is a job spec: "
                             f"set its keys there (docs/job-spec.md)")
        words = ["launch", *_words(given), *_words({"env": env}), *_words(health_flags), *common,
                 *(["-m", module] if module is not None else []), "--",
                 *([entry] if entry is not None else []), *map(str, args)]
        run_id = None
    run: Run | None = None
    try:
        parsed = _parsed(words)
        job_made = job_of(parsed)
        run_id = run_id or new_run_id(job_made.spec.name)
        run = Run(run_dir(runs_root(parsed.runs_dir), run_id), None if runs_dir is None else str(runs_dir))
        if launched is not None:
            keep_for(launched, run_dir(runs_root(parsed.runs_dir), run_id))
        code = launch_job(parsed, job_made, run_id)
    finally:
        started = run is not None and run.path.joinpath("state.json").exists()
        if launched is not None and not (detach and started):  # a detached run's later attempts need it
            shutil.rmtree(launched, ignore_errors=True)
    if not started:
        raise HarnessError(f"the launch failed before its run started (exit status {code}): see the lines above")
    assert run is not None
    if detach:
        return run
    return _ended(run, is_function=function)


def _ended(run: Run, is_function: bool) -> Run:
    status = run.status()
    if status.state is RunStatus.INTERRUPTED:
        raise KeyboardInterrupt(f"run {run.id} was interrupted, and stopped")
    if is_function and status.state is RunStatus.FAILED:
        run.result()  # RankError where a rank raised
    if status.state is not RunStatus.SUCCEEDED:
        raise RunFailed(run, f"run {run.id} {status.state.value}" + (f": {status.error}" if status.error else ""))
    return run


def _function_words(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], common: list[str],
                    **values: Any) -> tuple[list[str], str, Path]:
    """A function launch's words (its spec file's launch), run id and folder (the spec and the call's pieces)."""
    flags = _flags(**values | {"name": values["name"] or job_name(getattr(function, "__name__", "function"))})
    try:  # a bad value named by its keyword, before anything is made
        run_id = new_run_id(spec_from_flags(flags).name)
    except UsageError as exc:
        raise UsageError(re.sub(r"^--([\w-]+)", lambda flag: f"{flag[1].replace('-', '_')}=", str(exc))) from None
    folder = launched_dir() / run_id
    # On Slurm's nodes, the caller's Python (where the nodes share its file system), as simulated nodes run it.
    data = spec_data(flags) | {"slurm": {"python": sys.executable}}
    spec_file = write_call_job(folder, data, pickled_call(function, args, kwargs),
                               f"harness.launch({getattr(function, '__qualname__', 'a function')}, ...)")
    return ["launch", *common, "--", str(spec_file)], run_id, folder


def _entry(job: str | Path | JobSpec | None, module: str | None) -> tuple[str | None, Path | None]:
    """The launch's positional word: a spec file or a script (None with module=); and the folder made for it, for a
    Job that is not its file's as it stands (built or changed in code)."""
    if not isinstance(job, JobSpec):
        return None if job is None else str(job), None
    if module is not None:
        raise UsageError("give a Job or module=, not both")
    if job.source is not None and Path(job.source).is_file() and _unchanged(job, job.source):
        return job.source, None
    folder = launched_dir() / new_run_id(job.name)
    make_folders(folder, 0o700)
    data = job.model_dump(mode="json", exclude_defaults=True)
    return str(write_job(folder, data, "harness.launch(Job) of a job built or changed in Python")), folder


def _unchanged(job: JobSpec, path: str) -> bool:
    try:
        return load_job(path) == job
    except HarnessError:
        return False


def _flags(**values: Any) -> ScriptFlags:
    """A function's job flags as ScriptFlags (what a script's flags make); nnodes may be MIN:N, env a mapping."""
    nnodes = values.pop("nnodes")
    fewest, colon, most = str(nnodes).rpartition(":") if nnodes is not None else ("", "", "")
    env = values.pop("env") or {}
    try:
        return ScriptFlags(nnodes=int(most) if most else None, min_nnodes=int(fewest) if colon else None,
                           env=[f"{key}={value}" for key, value in env.items()], **values)
    except ValueError:
        raise UsageError(f"nnodes: expected a number of nodes, or 'MIN:N' (e.g. '2:4'), got {nnodes!r}") from None


def _words(options: Mapping[str, Any]) -> list[str]:
    """--flag=value for each option given (a mapping's items, as --env does, one word each)."""
    words: list[str] = []
    for flag, value in options.items():
        if isinstance(value, Mapping):
            words += [f"--{flag}={key}={item}" for key, item in value.items()]
        elif value is not None:
            words.append(f"--{flag}={value}")
    return words


def _switches(switches: Mapping[str, bool]) -> list[str]:
    return [f"--{flag}" for flag, on in switches.items() if on]


def _parsed(words: list[str]) -> argparse.Namespace:
    """The launch's words parsed as `harness` parses them; argparse's complaint as a UsageError, not an exit."""
    from harness.cli import parsed, rerun_words

    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            args = parsed(words)
    except SystemExit:
        said = complaint.getvalue().strip().splitlines()
        raise UsageError(said[-1].removeprefix("harness launch: error: ") if said else "bad arguments") from None
    args.rerun = rerun_words(args)
    return args
