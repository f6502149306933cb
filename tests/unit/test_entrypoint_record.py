"""runs/<id>/entrypoint.json: the entrypoint's file as the launch directory holds it, on real files."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from harness.record.entrypoint import (
    MODULE_SEEN_FROM,
    SCRIPT_SEEN_FROM,
    EntrypointRecord,
    entrypoint_record,
    module_file,
    write_entrypoint_record,
)
from harness.record.rundir import RunDir
from harness.record.schema import read_record
from harness.spec.job import Entrypoint, JobSpec

BODY = b"print('train')\n"


def test_a_relative_script_is_read_from_the_launch_directory(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_bytes(BODY)
    record = entrypoint_record(Entrypoint(script="src/../src/train.py"), str(tmp_path), "local")
    assert record == EntrypointRecord(
        script="src/../src/train.py", module=None, seen_from=SCRIPT_SEEN_FROM, launch_directory=str(tmp_path),
        path=str(tmp_path / "src" / "train.py"), size=len(BODY), sha256=hashlib.sha256(BODY).hexdigest(),
        problem=None, nodes="run this file")


def test_an_absolute_script_stays_where_it_is_and_ssh_nodes_run_their_own_copy(tmp_path: Path) -> None:
    script = tmp_path / "elsewhere.py"
    script.write_bytes(BODY)
    record = entrypoint_record(Entrypoint(script=str(script)), "/", "ssh")
    assert (record.path, record.size, record.seen_from) == (str(script), len(BODY), "launch directory")
    assert record.nodes.startswith("run their own copy in their workdir")


def test_a_script_missing_here_is_recorded_as_such_not_raised(tmp_path: Path) -> None:
    record = entrypoint_record(Entrypoint(script="train.py"), str(tmp_path), "ssh")
    assert (record.path, record.size, record.sha256) == (str(tmp_path / "train.py"), None, None)
    assert record.problem == f"no file {tmp_path / 'train.py'} on this machine (launch directory {tmp_path})"


def test_only_a_regular_file_is_read(tmp_path: Path) -> None:
    """A FIFO would block the launch forever; a directory cannot be hashed."""
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "dir.py").mkdir()
    for name in ("pipe.py", "dir.py"):
        record = entrypoint_record(Entrypoint(script=name), str(tmp_path), "local")
        assert (record.sha256, record.problem) == (None, f"{tmp_path / name} is not a regular file")


def test_a_module_is_found_from_the_launch_directory_without_importing_its_packages(tmp_path: Path) -> None:
    """The package's __init__ would exit the test run if it were imported."""
    package = tmp_path / "mypkg_not_imported"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")
    (package / "sub" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (package / "sub" / "train.py").write_bytes(BODY)
    (package / "__main__.py").write_text("print('main')\n")
    assert module_file("mypkg_not_imported.sub.train", str(tmp_path)) == str(package / "sub" / "train.py")
    assert module_file("mypkg_not_imported", str(tmp_path)) == str(package / "__main__.py")  # `python -m pkg`
    assert module_file("mypkg_not_imported.sub", str(tmp_path)) is None  # no __main__: python -m would fail too
    assert module_file("mypkg_not_imported.nothing", str(tmp_path)) is None
    assert "mypkg_not_imported" not in sys.modules
    record = entrypoint_record(Entrypoint(module="mypkg_not_imported.sub.train"), str(tmp_path), "local")
    assert (record.module, record.script, record.seen_from) == ("mypkg_not_imported.sub.train", None, MODULE_SEEN_FROM)
    assert (record.size, record.sha256) == (len(BODY), hashlib.sha256(BODY).hexdigest())


def test_a_module_of_an_installed_package_is_found_on_the_harness_python_path(tmp_path: Path) -> None:
    """harness itself is an editable install: found through sys.meta_path, not a sys.path entry."""
    assert module_file("harness.payload.train", str(tmp_path)) == str(
        Path(__file__).resolve().parents[2] / "harness" / "payload" / "train.py")


def test_an_unknown_module_is_recorded_with_the_reason(tmp_path: Path) -> None:
    record = entrypoint_record(Entrypoint(module="no_such_module_here.train"), str(tmp_path), "local")
    assert (record.path, record.sha256) == (None, None)
    assert record.problem == ("module no_such_module_here.train has no source file on the launch directory's or "
                              "the harness's Python path")


def test_the_record_is_written_as_json_that_reads_back(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "train.py").write_bytes(BODY)
    monkeypatch.chdir(tmp_path)
    spec = JobSpec.model_validate({"name": "a", "nnodes": 1, "entrypoint": {"script": "train.py"}})
    write_entrypoint_record(RunDir(tmp_path), spec, "local")
    written = json.loads((tmp_path / "entrypoint.json").read_text())
    assert written["script"] == "train.py" and written["sha256"] == hashlib.sha256(BODY).hexdigest()
    assert read_record(tmp_path / "entrypoint.json", EntrypointRecord).path == str(tmp_path / "train.py")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
