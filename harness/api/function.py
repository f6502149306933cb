"""A function launch as a job spec: `harness.launch(fn, args=...)` runs `python -m harness.api.rank` on every rank,
with the function and its arguments pickled (cloudpickle) into the job's secrets, so that they reach the ranks as
every secret does (on the agents' standard input, into the ranks' environment: no command line, no file of the run).

Why cloudpickle rather than the cell's source: a notebook's function uses what the notebook defined before it (other
functions, classes, constants); cloudpickle takes those along by value, and imported modules by name (each node must
have them, as it has torch). The source alone would need every cell it depends on run again on every rank.

The spec and the secrets' files live in the launching user's state folder (launched/RUN_ID, 0700; each file 0600)
while the run may need them (a restart, `harness attach`), and are removed once it has ended."""

from __future__ import annotations

import base64
import linecache
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from harness.api.rank import CALL_VARIABLE, python_tag
from harness.errors import UsageError
from harness.record.atomic import make_folders, write_text_atomic
from harness.record.index import index_dir
from harness.record.liveness import has_ended
from harness.record.rundir import RunDir

CALL_MODULE = "harness.api.rank"
# What a call may pickle to: it travels in every rank's environment, whose whole is bounded (ARG_MAX: 2 MiB where the
# stack limit is 8 MiB); data belongs in files the ranks read.
MAX_CALL_BYTES = 512 << 10
MAX_SOURCES_BYTES = 128 << 10  # of cell_sources
PIECE = 96 << 10  # base64 characters per variable: within Linux's 128 KiB for one (MAX_ARG_STRLEN)
ORPHAN_SECONDS = 3600.0  # a folder of a launch that never made its run is removed after this long


def launched_dir() -> Path:
    """Where the specs of launches made in Python live while their runs need them: beside the user's index of runs."""
    return index_dir().parent / "launched"


def pickled_call(function: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """The call as harness.api.rank reads it: the caller's Python first, then the pickle."""
    import cloudpickle

    try:
        pickled = python_tag() + cloudpickle.dumps((function, tuple(args), dict(kwargs), cell_sources(function)))
    except Exception as exc:  # noqa: BLE001 - whatever cannot be pickled: a lock, a socket, an open file
        raise UsageError(f"the function {getattr(function, '__qualname__', function)!r} or its arguments cannot be "
                         f"sent to the ranks: {type(exc).__name__}: {exc}") from None
    if len(pickled) > MAX_CALL_BYTES:
        raise UsageError(f"the function and its arguments pickle to {len(pickled) >> 10} KiB, more than the "
                         f"{MAX_CALL_BYTES >> 10} KiB that travel to the ranks (in their environment): pass large data "
                         f"as a path the ranks read, or load it inside the function")
    return pickled


def cell_sources(function: Callable[..., Any]) -> dict[str, tuple[Any, ...]]:
    """The source of the code the call runs that lives in no file (a notebook's cells, as IPython keeps them in
    linecache), for the ranks' tracebacks to show its lines as the notebook's own would: only the cells that defined
    the function and what it uses of the notebook's (its functions, classes), never the others, which may hold
    anything the user typed; none where it would weigh on the call."""
    files = {name for name in _code_files(function) if name in linecache.cache and not os.path.exists(name)}
    sources = {name: entry for name in files if len(entry := linecache.cache[name]) == 4}
    size = sum(len(str(entry)) for entry in sources.values())
    return sources if size <= MAX_SOURCES_BYTES else {}


def _code_files(function: Callable[..., Any]) -> set[str]:
    """The files of the function's code, and of the code it names in its module's globals, defined there too."""
    files: set[str] = set()
    seen: set[int] = set()
    todo: list[Any] = [function]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        item = getattr(item, "__func__", item)  # a staticmethod's, a classmethod's, a bound method's
        if isinstance(item, type) and item.__module__ == getattr(function, "__module__", None):
            todo += vars(item).values()
        elif (code := getattr(item, "__code__", None)) is not None:
            names: set[str] = set()
            codes = [code]
            while codes:
                current = codes.pop()
                files.add(current.co_filename)
                names.update(current.co_names)
                codes += [const for const in current.co_consts if hasattr(const, "co_filename")]
            space = getattr(item, "__globals__", {})
            todo += [space[name] for name in names if name in space]
    return files


def write_call_job(folder: Path, data: dict[str, Any], pickled: bytes, said: str) -> Path:
    """The job spec of a function launch in folder (made here, 0700), its secrets' files beside it; the spec's path.
    data: the spec as from_flags.spec_data makes it; said: how it was launched, for the spec's header."""
    text = base64.b64encode(pickled).decode("ascii")
    make_folders(folder.parent, 0o700)
    folder.mkdir(mode=0o700)
    secrets: dict[str, dict[str, str]] = {}
    for number, start in enumerate(range(0, len(text), PIECE)):
        piece = folder / f"call.{number}"
        write_text_atomic(piece, text[start:start + PIECE], 0o600)
        secrets[f"{CALL_VARIABLE}{number}"] = {"file": str(piece)}
    return write_job(folder, data | {"secrets": secrets}, said)


def write_job(folder: Path, data: dict[str, Any], said: str) -> Path:
    """A spec the API made (a function launch's, a Job built in code), as a file in folder, which exists."""
    spec = folder / "job.yaml"
    write_text_atomic(spec, f"# Made by: {said}\n" + yaml.safe_dump(data, sort_keys=False, allow_unicode=True), 0o600)
    return spec


def keep_for(folder: Path, run: RunDir) -> None:
    """folder's run: once it has ended, the folder goes (prune_launched)."""
    write_text_atomic(folder / "run", str(run.path), 0o600)


def prune_launched() -> None:
    """The folders of launches whose runs have ended, or that never made a run, removed."""
    root = launched_dir()
    if not root.is_dir():
        return
    for folder in root.iterdir():
        try:
            old = time.time() - folder.stat().st_mtime > ORPHAN_SECONDS
            run = RunDir(Path((folder / "run").read_text())) if (folder / "run").exists() else None
            done = old if run is None or not run.state_file.exists() else has_ended(run)
        except Exception:  # noqa: BLE001 - a record that cannot be read: the run is not ours to judge
            done = False
        if done:
            shutil.rmtree(folder, ignore_errors=True)
