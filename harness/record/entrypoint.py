"""runs/<run-id>/entrypoint.json: which file the run's entrypoint was when the run began (its path,
size and sha256), so that a result can be traced to the code that made it after the script has
changed.

The file is read where the harness runs, from the launch directory, and the record says so: simulated
nodes run that very file; SSH hosts and Slurm nodes run their own copy in their workdir, which
preflight's fingerprint row compares across the hosts (no extra round trip is made for this record).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

from harness.record.rundir import RunDir
from harness.record.schema import record_text
from harness.spec.job import Entrypoint, JobSpec

ENTRYPOINT_FILE = "entrypoint.json"
SCRIPT_SEEN_FROM = "launch directory"
MODULE_SEEN_FROM = "launch directory, then the harness's own Python path"


@dataclass(frozen=True)
class EntrypointRecord:
    """script or module: as the spec writes it. path: the absolute path of the file read (None when
    no file was found); size in bytes and sha256 of it; problem: why there is no fingerprint.
    nodes: whether the nodes run this very file or a copy of their own."""

    script: str | None
    module: str | None
    seen_from: str
    launch_directory: str
    path: str | None
    size: int | None
    sha256: str | None
    problem: str | None
    nodes: str


def write_entrypoint_record(run: RunDir, spec: JobSpec, mode: str) -> None:
    """Write the record of spec's entrypoint into the run directory, atomically. mode: the run's mode
    (`local`: simulated nodes on this machine, which run the launch directory's file)."""
    run.write_text(run.path / ENTRYPOINT_FILE, record_text(entrypoint_record(spec.entrypoint, os.getcwd(), mode)),
                   ENTRYPOINT_FILE)


def entrypoint_record(entry: Entrypoint, cwd: str, mode: str) -> EntrypointRecord:
    """The record as seen from cwd; a missing or unreadable file is the record's problem, never the run's."""
    if entry.script is not None:
        path: str | None = os.path.abspath(Path(cwd, os.path.expanduser(entry.script)))  # absolute stays as it is
        seen_from, missing = SCRIPT_SEEN_FROM, f"no file {path} on this machine (launch directory {cwd})"
        nodes = ("run this file" if mode == "local" else
                 "run their own copy in their workdir (preflight's fingerprint row compares the hosts' copies)")
    else:
        assert entry.module is not None  # Entrypoint holds exactly one of the two
        path = module_file(entry.module, cwd)
        seen_from = MODULE_SEEN_FROM
        missing = f"module {entry.module} has no source file on the launch directory's or the harness's Python path"
        nodes = "import the module with their own Python from their workdir"
    size, digest, problem = (None, None, missing) if path is None or not os.path.lexists(path) else _fingerprint(path)
    return EntrypointRecord(script=entry.script, module=entry.module, seen_from=seen_from, launch_directory=cwd,
                            path=path, size=size, sha256=digest, problem=problem, nodes=nodes)


def module_file(name: str, cwd: str) -> str | None:
    """The file `python -m name` runs when started in cwd, found as the import system finds it (cwd
    first, then this Python's finders, editable installs included) but without importing anything:
    a package's __init__ may be slow or have effects, and the controller must not run user code."""
    parts = name.split(".")
    spec = PathFinder.find_spec(parts[0], [cwd]) or _find(parts[0], None)
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = _find(".".join(parts[:depth]), list(spec.submodule_search_locations))
    if spec is not None and spec.submodule_search_locations is not None:  # a package runs as its __main__
        spec = _find(f"{name}.__main__", list(spec.submodule_search_locations))
    return spec.origin if spec is not None and spec.origin and os.path.isfile(spec.origin) else None


def _find(fullname: str, path: list[str] | None) -> ModuleSpec | None:
    """What sys.meta_path's finders say, in order, as importing would ask them (parents not imported)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, path)
        except (ImportError, ValueError, OSError):  # a finder that cannot answer for this name
            continue
        if spec is not None:
            return spec
    return None


def _fingerprint(path: str) -> tuple[int | None, str | None, str | None]:
    """(size, sha256, None) of a regular file, or (None, None, why not): a FIFO or a device would block
    or never end, so only a regular file is read."""
    try:
        if not os.path.isfile(path):
            return None, None, f"{path} is not a regular file"
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            return size, hashlib.file_digest(handle, "sha256").hexdigest(), None
    except OSError as exc:
        return None, None, f"cannot read {path}: {exc.strerror or exc}"
