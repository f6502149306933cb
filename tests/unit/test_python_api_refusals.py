"""The Python API's refusals, before anything starts, and the pieces of a function launch that need no launch: the
call's way to a rank and a result's way back (real launches: tests/integration/test_python_api.py)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import harness
from harness.api.function import MAX_CALL_BYTES, PIECE, launched_dir, pickled_call, write_call_job
from harness.api.rank import CALL_VARIABLE, take_call
from harness.errors import SpecError, UsageError
from harness.node.protocol import CHUNK, ResultChunks, result_bodies
from harness.spec.job import load_job

from conftest import REPO


def test_import_harness_costs_nothing_until_a_name_is_used():
    """`import harness` (which every rank of a function launch and every node-side module pays) loads none of the
    API's dependencies; harness.launch and friends load on first use."""
    code = ("import sys, harness; print(sorted(m for m in ('pydantic', 'yaml', 'harness.api.launching') "
            "if m in sys.modules)); print(harness.launch.__module__, harness.Job.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert done.stdout.split("\n")[:2] == ["[]", "harness.api.launching JobSpec"]
    with pytest.raises(AttributeError, match="no attribute 'lanch'"):
        harness.lanch  # noqa: B018 - the attribute is the test


def test_a_call_too_big_or_that_cannot_be_pickled_is_refused_before_anything_is_made(tmp_path):
    before = set(launched_dir().iterdir()) if launched_dir().is_dir() else set()
    with pytest.raises(UsageError, match=r"pickle to \d+ KiB, more than the 512 KiB that travel to the ranks"):
        harness.launch(len, args=(b"x" * MAX_CALL_BYTES,), nnodes=2, runs_dir=tmp_path)
    with pytest.raises(UsageError, match=r"cannot be sent to the ranks: TypeError: cannot pickle '_thread.lock'"):
        harness.launch(len, args=(threading.Lock(),), runs_dir=tmp_path)
    assert (set(launched_dir().iterdir()) if launched_dir().is_dir() else set()) == before
    assert not (tmp_path / "runs").exists()


def test_the_api_raises_what_the_verb_would_say(tmp_path):
    """A spec's error with its file, line and key path; a script's flag given for a spec file; no job at all."""
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nnnodes: 2\nentrypoint:\n  script: train.py\nhealth:\n  stall: soon\n")
    with pytest.raises(SpecError, match=rf"{spec}:6:\d+: health\.stall: "):
        harness.launch(spec)
    with pytest.raises(SpecError, match=rf"{spec}:6:\d+: health\.stall: "):
        harness.load_job(str(spec))
    with pytest.raises(UsageError, match=r"nnodes= is for a script or a function; .*bad\.yaml is a job spec"):
        harness.launch(str(spec), nnodes=4)
    with pytest.raises(UsageError, match="expected a job"):
        harness.launch()
    with pytest.raises(UsageError, match="nnodes: expected a number of nodes"):
        harness.launch(len, nnodes="two")
    with pytest.raises(UsageError, match="backend=: Input should be 'auto', 'nccl' or 'gloo'"):
        harness.launch(len, backend="mpi")
    refused: list[BaseException] = []
    thread = threading.Thread(target=lambda: _raised(refused, lambda: harness.launch(len, runs_dir=tmp_path)))
    thread.start()
    thread.join()
    assert "from another thread, launch with detach=True, then run.wait()" in str(refused[0])
    assert not (tmp_path / "runs").exists()


def test_a_function_launch_is_a_spec_whose_secrets_carry_the_call(tmp_path):
    """The spec validates as any spec (HARNESS_CALL_N: the one HARNESS_ name a spec may hold), its secrets' files
    reassemble to the call, the folder and files are the user's alone."""
    pickled = pickled_call(divmod, (7, 2), {})
    folder = tmp_path / "launched" / "call-1"
    data = {"name": "divmod", "nnodes": 1, "entrypoint": {"module": "harness.api.rank"}}
    spec = load_job(str(write_call_job(folder, data, pickled + b"\0" * (2 * PIECE), "test")))
    assert sorted(spec.secrets) == [f"{CALL_VARIABLE}{n}" for n in range(len(spec.secrets))] and len(spec.secrets) > 2
    environ = {name: Path(str(secret.file)).read_text() for name, secret in spec.secrets.items()}
    assert take_call(environ) == pickled + b"\0" * (2 * PIECE) and environ == {}
    assert {oct(path.stat().st_mode & 0o777) for path in folder.iterdir()} == {"0o600"}
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    bad = tmp_path / "own.yaml"
    bad.write_text("name: own\nentrypoint:\n  script: x.py\nsecrets:\n  HARNESS_OTHER:\n")
    with pytest.raises(SpecError, match="HARNESS_OTHER is set by the harness"):
        load_job(str(bad))


def test_a_rank_of_another_python_says_so_and_fails():
    """Pickled code is tied to the Python that made it: a rank of another major.minor refuses, in words."""
    call = base64.b64encode(b"2.7\n" + pickled_call(divmod, (7, 2), {}).partition(b"\n")[2]).decode()
    done = subprocess.run([sys.executable, "-m", "harness.api.rank"], capture_output=True, text=True, cwd=REPO,
                          env=os.environ | {f"{CALL_VARIABLE}0": call, "RANK": "3"})
    assert done.returncode == 1
    assert f"rank 3 runs Python {sys.version_info[0]}.{sys.version_info[1]}, the caller 2.7" in done.stderr


def test_results_travel_in_chunks_each_within_a_message():
    """A result of any size (binary) comes back whole, cut into messages of CHUNK characters at most."""
    result = bytes(range(256)) * 40
    bodies = result_bodies(5, result)
    assert len(bodies) > 3 and all(len(body.split(" ", 3)[3]) <= CHUNK for body in bodies)
    chunks = ResultChunks()
    assert [chunks.take(body) for body in bodies[:-1]] == [None] * (len(bodies) - 1)
    assert chunks.take(bodies[-1]) == (5, result)


def _raised(into: list[BaseException], call: Callable[[], object]) -> None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - kept for the test to look at
        into.append(exc)
