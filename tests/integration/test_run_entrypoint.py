"""A launch keeps what ran: runs/<id>/entrypoint.json fingerprints the script as the run began, so an
edit after the run does not change what the record says. On the stand-in torch (testbed/standin): the script uses
none, and the record is the harness's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from conftest import STANDIN_ENV, assert_nothing_left, free_port

SCRIPT = "print('trained', flush=True)\n"


def test_a_launch_records_its_scripts_fingerprint(write_yaml, launch, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(SCRIPT)
    job = write_yaml(f"""
        name: fp
        nnodes: 1
        nproc_per_node: 1
        backend: gloo
        master_port: {free_port()}
        entrypoint: {{script: src/train.py}}
        env: {{PYTHONPATH: '{STANDIN_ENV["PYTHONPATH"]}'}}
    """)
    run = launch(job, cwd=tmp_path)
    assert run.finish() == 0, run.output
    (tmp_path / "src" / "train.py").write_text(SCRIPT + "# edited after the run\n")
    record = json.loads((run.runs_dir / run.run_id / "entrypoint.json").read_text())
    assert record == {
        "script": "src/train.py", "module": None, "seen_from": "launch directory",
        "launch_directory": str(tmp_path), "path": str(tmp_path / "src" / "train.py"), "size": len(SCRIPT),
        "sha256": hashlib.sha256(SCRIPT.encode()).hexdigest(), "problem": None, "nodes": "run this file",
    }
    assert_nothing_left(run.run_id)
