"""The `stacks` preflight row: py-spy where the node agent looks for it, and able to read a Python process.

Every verdict here comes from the real probe (harness.node.probe, shipped and run by a Python on this
machine, as preflight runs it on a host); where a case cannot be made real on this machine (py-spy
refused by ptrace rules), py-spy's own refusal is played by a stand-in beside the probe's Python, or the
real facts are varied only in the field that decides the fix.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from harness.node import probe
from harness.preflight.checks import PY_SPY, stacks_check
from harness.preflight.local import probe_host, run_preflight_local
from harness.preflight.remote import run_script
from harness.preflight.subprocess_link import CommandLink
from harness.preflight.table import Report, Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# py-spy's own words when ptrace is refused (py-spy 0.4.3, as an unprivileged user on a yama host)
REFUSED = "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'"


def _host(python: str) -> Host:
    return Host(name="localhost", address="127.0.0.1", python=python, workdir=str(REPO))


def _stacks_facts(python: str) -> dict[str, Any]:
    """The probe's stack facts, from the probe as preflight ships it to a host and runs it with python."""
    facts = probe_host(CommandLink(_host(python)), _host(python), None, True, 30, {})
    return facts["stacks"]


def _no_py_spy_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.access(os.path.join(d, "py-spy"), os.X_OK)]
    monkeypatch.setenv("PATH", os.pathsep.join(dirs or ["/usr/bin", "/bin"]))


def _bare_python(tmp_path: Path) -> Path:
    """This machine's Python in a folder of its own: nothing beside it, so no py-spy there."""
    bare = tmp_path / "bare" / "python3"
    bare.parent.mkdir()
    bare.symlink_to(os.path.realpath(sys.executable))
    return bare


def test_the_pin_in_the_fix_is_the_projects_own():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert PY_SPY in dependencies
    assert PY_SPY in (REPO / "requirements.lock").read_text().splitlines()
    assert (VENV_BIN / "py-spy").exists(), "py-spy comes with the project's dependencies (make setup)"


def test_py_spy_of_the_venv_reads_a_process_and_the_local_report_passes(tmp_path: Path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = JobSpec.model_validate({"name": "j", "nnodes": 1, "backend": "gloo", "entrypoint": {"script": "train.py"}})
    report = run_preflight_local(spec, sys.executable, tmp_path, timeout=30)
    stacks = report.facts["localhost"]["stacks"]
    assert stacks["py_spy"] == str(VENV_BIN / "py-spy") and stacks["python"] == sys.executable
    assert stacks["version"] == PY_SPY.split("==")[1]
    row = next(c for c in report.checks if c.name == "stacks")
    if not stacks["readable"] and stacks["ptrace_scope"] not in (None, 0) and not stacks["cap_sys_ptrace"]:
        pytest.skip(f"this machine refuses ptrace (kernel.yama.ptrace_scope={stacks['ptrace_scope']}): {row.fix}")
    assert stacks["readable"] and stacks["error"] is None, stacks
    assert (row.status, row.reason, row.fix) == (
        Status.PASS, f"py-spy {stacks['version']} ({VENV_BIN / 'py-spy'}) read the stack of a test process", None)
    assert [c.name for c in report.checks] == ["fingerprint", "stacks"]
    assert re.search(rf"\nlocalhost +stacks +PASS +py-spy {re.escape(stacks['version'])} ", report.render_table())
    assert report.render_table().endswith("PASSED: 2 checks, 0 warnings")


def test_without_py_spy_the_row_warns_with_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _no_py_spy_on_path(monkeypatch)
    bare = _bare_python(tmp_path)
    stacks = _stacks_facts(str(bare))
    assert (stacks["python"], stacks["py_spy"], stacks["readable"]) == (str(bare), None, False)
    row = stacks_check("localhost", {"stacks": stacks})
    assert row.status is Status.WARN
    assert row.reason == (f"py-spy is neither beside {bare} nor on PATH: hang verdicts and `harness stacks` will have "
                          f"no Python stacks from this host (the job itself runs)")
    assert row.fix == (f"`{bare} -m pip install py-spy==0.4.3` on localhost (the node agent looks for py-spy beside "
                       f"that Python, then on PATH)")
    report = Report(hosts=[{"name": "localhost", "address": "127.0.0.1", "master": True}], checks=[row])
    table = report.render_table()
    assert re.search(rf"\nlocalhost +stacks +WARN +py-spy is neither beside {re.escape(str(bare))} nor on PATH", table)
    assert table.endswith("PASSED: 1 checks, 1 warnings")  # a warning: the job still runs without stacks
    assert report.ok and json.loads(json.dumps(report.to_json()))["checks"][0]["fix"] == row.fix


def test_py_spy_on_path_is_found_when_none_is_beside_the_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _no_py_spy_on_path(monkeypatch)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "py-spy").symlink_to(VENV_BIN / "py-spy")
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    stacks = _stacks_facts(str(_bare_python(tmp_path)))
    assert stacks["py_spy"] == str(tools / "py-spy") and stacks["version"] == "0.4.3"


def test_py_spy_refused_by_ptrace_warns_with_the_rights_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _no_py_spy_on_path(monkeypatch)
    bare = _bare_python(tmp_path)
    stand_in = bare.parent / "py-spy"
    stand_in.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo 'py-spy 0.4.3'; exit 0; }}\n"
                        f"cat >&2 <<'EOF'\n{REFUSED}\nEOF\nexit 1\n")
    stand_in.chmod(0o755)
    stacks = _stacks_facts(str(bare))
    # the error is py-spy's refusal as harness.node.ranks.dump reads it (the agent's own words for it)
    assert (stacks["py_spy"], stacks["readable"]) == (str(stand_in), False) and stacks["error"], stacks
    row = stacks_check("h1", {"stacks": stacks})
    assert row.status is Status.WARN
    assert row.reason == (f"py-spy 0.4.3 ({stand_in}) cannot read a Python process: {stacks['error']}; hang verdicts "
                          f"and `harness stacks` will have no Python stacks from this host (the job itself runs)")
    # The fix follows what the probe saw of the host's ptrace rules; only that field varies here.
    plain = stacks | {"container": False, "cap_sys_ptrace": False}
    # The safe way is named first: scope 1 and the ranks naming their agent; wider rights on a host of one's own.
    alone = (f"on a host that is yours alone, `sysctl kernel.yama.ptrace_scope=0` or the agent as root (never "
             f"`setcap cap_sys_ptrace+ep` on a shared host: every user who runs {stand_in} could read every process)")
    assert stacks_check("h1", {"stacks": plain | {"ptrace_scope": 2}}).fix == (
        f"`sysctl kernel.yama.ptrace_scope=1` on h1 (it is 2: only CAP_SYS_PTRACE may read another process; at 1, "
        f"Ubuntu's default, each rank names the node agent its ptracer, and py-spy reads the ranks and nobody else's "
        f"processes); {alone}")
    assert stacks_check("h1", {"stacks": plain | {"ptrace_scope": 3}}).fix.startswith(
        "kernel.yama.ptrace_scope is 3 on h1 (no process may read another until reboot): set it to 1")
    assert stacks_check("h1", {"stacks": plain | {"ptrace_scope": 1, "container": True}}).fix == (
        "h1 is a container without CAP_SYS_PTRACE: start it with `--cap-add SYS_PTRACE` (the harness's own "
        "Kubernetes pods need none: their agent is their ranks' ptracer)")
    for scope in (0, 1):
        assert stacks_check("h1", {"stacks": plain | {"ptrace_scope": scope}}).fix == (
            f"`{stand_in} dump --pid PID` on h1 says why py-spy is refused (the same user at ptrace_scope 0 or 1 is "
            f"all it needs: each rank names the node agent its ptracer); {alone}")


def test_a_container_jobs_stack_check_runs_with_the_hosts_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The node agent, and so py-spy, runs on the host, not in the image: host_link answers for stacks."""
    _no_py_spy_on_path(monkeypatch)
    bare = str(_bare_python(tmp_path))
    facts = probe_host(CommandLink(_host(sys.executable)), _host(sys.executable), None, True, 30, {},
                       host_link=CommandLink(_host(bare)))
    assert facts["python_executable"] == sys.executable and facts["stacks"]["python"] == bare
    assert stacks_check("h1", facts).status is Status.WARN
    crashing = tmp_path / "crashing" / "python3"  # a host Python that dies before answering
    crashing.parent.mkdir()
    crashing.write_text("#!/bin/sh\ncat >/dev/null\necho 'Segmentation fault' >&2\nexit 139\n")
    crashing.chmod(0o755)
    broken = probe_host(CommandLink(_host(sys.executable)), _host(sys.executable), None, True, 30, {},
                        host_link=CommandLink(_host(str(crashing))))
    row = stacks_check("h1", broken)
    assert row.status is Status.WARN
    assert row.reason == (f"the probe on the host failed: {crashing} on localhost exited 139: Segmentation fault; "
                          f"hang verdicts and `harness stacks` will have no Python stacks from this host (the job "
                          f"itself runs)")
    assert row.fix == ("set `python:` in the inventory to a Python of h1 itself (the node agent runs there, outside "
                       "the container)")


def _test_processes() -> list[int]:
    """This process's children that are the probe's test process, or zombies (a child killed but not reaped has
    no command line left). Only this process's: another test worker may be probing at the same time."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            state, ppid = stat[stat.rindex(b")") + 2:].split()[:2]
            if int(ppid) == os.getpid() and (state == b"Z" or
                                             probe.STACKS_CHILD.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()):
                found.append(int(pid))
        except OSError:
            pass  # gone since the listing
    return found


def test_the_probe_kills_and_reaps_its_test_process_and_can_skip_the_check():
    facts = probe.probe({"stacks_only": True})  # in this process: a zombie child would stay listed
    assert set(facts) == {"python_executable", "stacks"}
    assert _test_processes() == []
    config = {"master_address": "127.0.0.1", "workdir": str(REPO), "stacks": False}
    assert run_script(CommandLink(_host(sys.executable)), probe, [json.dumps(config)], timeout=30)["stacks"] is None
    assert stacks_check("h1", {"stacks": None}).status is Status.SKIP
