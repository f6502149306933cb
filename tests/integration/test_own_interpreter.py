"""Simulated nodes with the user's own interpreter (`simulated: {python: ...}`), for real: a second virtual
environment whose Python has a package the harness's own lacks (and still torch), a 2-node gloo job that
imports it, `harness stacks` and a hang verdict read from ranks of that interpreter (the node agents and
py-spy stay the harness's), and preflight refusing a missing interpreter, one without torch, and a missing
script or module with fixes that name this machine's directories."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from conftest import assert_nothing_left, free_port, harness, leftover

pytestmark = pytest.mark.xdist_group("test_own_interpreter")  # one worker builds the environments (module fixture)

# The ranks' script: prints its interpreter and the package only the own environment has, then steps (each step
# an all_reduce in userpkg, so its frames are on the stack) until every rank has seen `stop`; rank 1 sticks in
# userpkg's sleep once `hang` appears.
SCRIPT = """
import sys
import torch.distributed as dist
import userpkg

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} runs {sys.executable} with {userpkg.NAME}", flush=True)
number = 0
while not userpkg.step(rank):
    number += 1
    print(f"step {number}", flush=True)
dist.destroy_process_group()
"""
USERPKG = '''
import os
import time

import torch
import torch.distributed as dist

NAME = "userpkg 1.0"


def step(rank):
    """One step; whether every rank is to stop (a rank's view of `stop`, agreed on by the all_reduce)."""
    if rank == 1 and os.path.exists("hang"):
        time.sleep(3600)
    stop = torch.tensor([float(os.path.exists("stop"))])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    time.sleep(0.05)
    return bool(stop.item())
'''


def _venv(path: Path, *pth_lines: str) -> Path:
    """A virtual environment of the harness's base interpreter, without pip; pth_lines: directories its
    site-packages adds to sys.path (the harness's own site-packages for torch, the user's package)."""
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    if pth_lines:
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        Path(site, "own.pth").write_text("".join(f"{line}\n" for line in pth_lines))
    return python


@pytest.fixture(scope="module")
def envs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`own`: a venv with torch (the harness's site-packages) and userpkg; `bare`: a venv with neither."""
    root = tmp_path_factory.mktemp("envs")
    (root / "lib" / "userpkg").mkdir(parents=True)
    (root / "lib" / "userpkg" / "__init__.py").write_text(textwrap.dedent(USERPKG))
    own = _venv(root / "own", sysconfig.get_path("purelib"), str(root / "lib"))
    found = subprocess.run([str(own), "-c", "import torch, userpkg; print(userpkg.NAME)"], capture_output=True,
                           text=True, timeout=120)
    assert found.stdout == "userpkg 1.0\n", found.stderr
    return {"own": own, "bare": _venv(root / "bare")}


def test_the_harness_own_interpreter_lacks_the_package(envs):
    mine = subprocess.run([sys.executable, "-c", "import userpkg"], capture_output=True, text=True, timeout=60)
    assert mine.returncode == 1 and "No module named 'userpkg'" in mine.stderr


def _job(workdir: Path, python: str, *, more: str = "") -> Path:
    (workdir / "train.py").write_text(SCRIPT)
    job = workdir / "job.yaml"
    job.write_text(f"name: own\nnnodes: 2\nbackend: gloo\nmaster_port: {free_port()}\n"
                   f"entrypoint: {{script: train.py}}\nsimulated: {{python: '{python}'}}\n{more}")
    return job


def _argv(pid: int) -> list[str]:
    """A process's command line; empty for one that has ended since it was listed."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def test_the_ranks_run_the_named_interpreter_and_their_stacks_are_read(envs, tmp_path, launch):
    """A relative python: is the launch directory's; the plan records it; py-spy beside the harness's Python
    reads ranks of another interpreter."""
    own = str(envs["own"])
    run = launch(_job(tmp_path, os.path.relpath(own, tmp_path)), cwd=tmp_path)
    for rank in (0, 1):
        run.wait_for(rf"\[rank{rank}\]: rank {rank} runs {re.escape(own)} with userpkg 1\.0$")
    run.wait_for(r"\[rank1\]: step 5$")
    commands = [_argv(pid) for pid in leftover(run.run_id)]
    agents = [argv[0] for argv in commands if "harness-agent" in argv]
    assert agents == [sys.executable] * 2, commands  # the node agents: the harness's own Python, py-spy beside it
    shown = harness("stacks", run.run_id, "--runs-dir", str(run.runs_dir), timeout=90)
    assert shown.returncode == 0, shown.stderr
    assert set(map(int, re.findall(r"\b(\d+) \(node\d on sim\d, pid \d+", shown.stdout))) == {0, 1}, shown.stdout
    assert "userpkg/__init__.py" in shown.stdout and "train.py" in shown.stdout, shown.stdout
    (tmp_path / "stop").touch()
    assert run.finish(timeout=120) == 0, run.output
    plan = json.loads((run.runs_dir / run.run_id / "plan.json").read_text())
    assert [node["argv"][:3] for node in plan["nodes"]] == [[own, "-m", "torch.distributed.run"]] * 2
    assert_nothing_left(run.run_id)


def test_a_rank_stuck_in_the_own_environments_code_is_found_hung(envs, tmp_path, launch):
    run = launch(_job(tmp_path, str(envs["own"]), more="health: {stall: 8}\n"), cwd=tmp_path)
    run.wait_for(r"\[rank1\]: step 5$")
    (tmp_path / "hang").touch()
    verdict = run.wait_for(r"harness: hang: (.*)", timeout=120).group(1)
    assert re.match(r"no progress for 8 s: rank 0 waits in all_reduce #(\d+) at .*userpkg/__init__.py:\d+ in step; "
                    r"rank 1 \(node1 on sim1\) has not reached #\1, at .*userpkg/__init__.py:\d+ in step: "
                    r"time.sleep\(3600\) \(stacks in ", verdict), verdict
    assert run.finish(timeout=90) == 1, run.output
    assert run.summary()["first_failure"]["kind"] == "hang"
    assert "time.sleep(3600)" in (run.runs_dir / run.run_id / "stacks" / "attempt-0" / "rank1.txt").read_text()
    assert_nothing_left(run.run_id)


def _refused(job: Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    """A launch that preflight stops: exit 1, nothing started, no run directory; its stderr."""
    result = harness("launch", str(job), "--runs-dir", str(cwd / "runs"), cwd=cwd, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.startswith("harness: error: preflight failed, nothing was started:"), result.stderr
    assert not (cwd / "runs").exists()
    return result.stderr


def test_a_missing_interpreter_fails_at_preflight_with_one_row(tmp_path):
    """`~` is the user's home, as a shell would have it."""
    home = tmp_path / "home"
    home.mkdir()
    said = _refused(_job(tmp_path, "~/envs/train/bin/python"), tmp_path, env={**os.environ, "HOME": str(home)})
    missing = home / "envs" / "train" / "bin" / "python"
    assert re.search(rf"\nlocalhost +fingerprint +FAIL +simulated.python ~/envs/train/bin/python: "
                     rf"{re.escape(str(missing))} does not exist\n", said), said
    assert "FAILED: 1 of 1 checks" in said
    assert ("-> fix: point simulated.python at the python of an environment that has torch and the job's packages "
            "(e.g. ~/envs/train/bin/python), or create that environment") in said


def test_an_interpreter_without_torch_fails_at_preflight(envs, tmp_path):
    bare = envs["bare"]
    said = _refused(_job(tmp_path, str(bare)), tmp_path)
    assert re.search(rf"\nlocalhost +fingerprint +FAIL +torch is not installed for {re.escape(str(bare))}\n", said)
    assert (f"-> fix: install it there (`{bare} -m pip install torch`), or set simulated.python to the interpreter "
            f"of an environment that has torch") in said
    assert "FAILED: 1 of 2 checks" in said, said  # the stacks row, the harness's own py-spy, is not the problem


@pytest.mark.parametrize("entrypoint, fix", [
    ("script: nope.py", "create nope.py in {cwd}, or fix entrypoint.script"),
    ("module: no_such_trainer", "make no_such_trainer importable from {cwd} (put it there, or install its package "
                                "for {python}), or fix entrypoint.module"),
])
def test_a_missing_entrypoint_or_data_on_simulated_nodes_names_this_machines_directory(tmp_path, entrypoint, fix):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: x\nnnodes: 2\nbackend: gloo\nmaster_port: {free_port()}\nentrypoint: {{{entrypoint}}}\n"
                   f"data_paths: [data/cifar10]\n")
    said = _refused(job, tmp_path)
    assert "-> fix: " + fix.format(cwd=tmp_path, python=sys.executable) in said, said
    assert (f"localhost data: data/cifar10 is missing in {tmp_path} -> fix: create it there, e.g. `harness prepare "
            f"--data-dir data/cifar10` for CIFAR-10, or fix data_paths") in said, said
    assert "every host" not in said and "inventory" not in said, said


def test_a_venv_whose_base_interpreter_is_gone_is_named_so(tmp_path):
    python = tmp_path / "old" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(tmp_path / "removed" / "python3.10")
    said = _refused(_job(tmp_path, "old/bin/python"), tmp_path)
    assert (f"simulated.python old/bin/python: {python} is a link to {tmp_path}/removed/python3.10, which does not "
            f"exist (was the environment's base Python removed?)") in said, said
