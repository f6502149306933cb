"""The import rules that keep remote code runnable on hosts without the harness, checked for real.

The node agent, the preflight probes and the wait for the master in Kubernetes pods travel as source
and run with a host's (or an image's) own Python, so they may import only the standard library; here
they run in an interpreter that cannot import `harness` or anything in site-packages (`python -I -S`
from an empty directory), because this test machine's venv has the harness installed and would hide a
stray import. The payload must run under plain torchrun, so it imports nothing of the harness outside
harness.payload.
"""

from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from harness.node import agent as node_agent
from harness.node import allreduce, netcheck, probe, waitport
from harness.plan.planner import NodePlan
from harness.targets.agent_link import agent_argv

REPO = Path(__file__).resolve().parent.parent
SEALED = [sys.executable, "-I", "-S"]  # no PYTHONPATH, no cwd, no site-packages
# Each remote script, and what beyond the standard library it may import: the full probe imports
# torch to measure it, inside a guard that turns a missing or broken torch into a finding.
REMOTE_SCRIPTS = {node_agent: set(), netcheck: set(), probe: {"torch"}, waitport: set()}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative imports are resolved against harness)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the rules here need absolute names"
            found.add(node.module or "")
    return found


def sealed(args: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SEALED, *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)


def test_the_sealed_interpreter_really_cannot_import_the_harness(tmp_path: Path) -> None:
    """The negative control: without it, the runs below would prove nothing."""
    assert subprocess.run([sys.executable, "-c", "import harness"], cwd=tmp_path).returncode == 0
    result = sealed(["-c", "import harness"], tmp_path)
    assert "No module named 'harness'" in result.stderr
    assert "No module named 'yaml'" in sealed(["-c", "import yaml"], tmp_path).stderr


@pytest.mark.parametrize("module", REMOTE_SCRIPTS, ids=lambda m: m.__name__)
def test_remote_scripts_import_only_the_standard_library(module: ModuleType) -> None:
    path = Path(str(module.__file__))
    outside = {name for name in imported_modules(path) if name.split(".")[0] not in sys.stdlib_module_names}
    assert outside == REMOTE_SCRIPTS[module], f"{path.name} imports {sorted(outside)}: hosts may not have them"


def test_allreduce_needs_torch_and_nothing_of_the_harness() -> None:
    modules = imported_modules(Path(allreduce.__file__))
    assert {name.split(".")[0] for name in modules} - set(sys.stdlib_module_names) == {"torch"}


def test_payload_imports_nothing_of_the_harness_outside_itself() -> None:
    payload = REPO / "harness" / "payload"
    for path in sorted(payload.glob("*.py")):
        strays = {m for m in imported_modules(path) if m.split(".")[0] == "harness"
                  and m != "harness.payload" and not m.startswith("harness.payload.")}
        assert strays == set(), f"{path.relative_to(REPO)} imports {sorted(strays)}"


def test_node_agent_runs_sealed(tmp_path: Path) -> None:
    """The agent exactly as backends start it: its output, then the exit marker, then its own exit."""
    node = NodePlan(host="h", address="127.0.0.1", node_rank=0, nproc=1, argv=("sh", "-c", "echo hello; exit 3"),
                    env={"HARNESS_RUN_ID": "sealed-test", "NODE_RANK": "0", "HARNESS_ATTEMPT": "0"})
    argv = agent_argv(sys.executable, node, grace=1, silence=60)
    assert argv[1:3] == ["-I", "-S"]
    # stdin stays open, as the controller's end does: its end of file would mean "controller gone, stop"
    agent = subprocess.Popen(argv, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    assert agent.stdout is not None and agent.stdin is not None
    output = agent.stdout.read()
    assert agent.wait(timeout=60) == 3
    agent.stdin.close()
    assert output == f"hello\n{node_agent.EXIT_MARKER} 3\n"


def test_preflight_probe_runs_sealed(tmp_path: Path) -> None:
    config = {"import_torch": False, "workdir": str(tmp_path), "entrypoint": {"module": "harness.payload.train"},
              "master_address": "127.0.0.1", "data_paths": []}
    result = sealed(["-c", Path(probe.__file__).read_text(), "ANSWER=", json.dumps(config)], tmp_path)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.removeprefix("ANSWER="))
    assert (facts["torch"], facts["harness"], facts["workdir_exists"]) == (probe.MISSING, probe.MISSING, True)


def test_netcheck_runs_sealed(tmp_path: Path) -> None:
    config = {"ports": [0], "lifetime": 30}
    result = sealed(["-c", Path(netcheck.__file__).read_text(), "ANSWER=", "listen", json.dumps(config)], tmp_path,
                    stdin=subprocess.DEVNULL)  # stdin at its end: the listener answers, then stops at once
    assert result.returncode == 0, result.stderr
    ports = json.loads(result.stdout.removeprefix("ANSWER="))["ports"]
    assert len(ports) == 1 and ports[0]["port"] > 0, ports


def test_waitport_runs_sealed(tmp_path: Path) -> None:
    """As Kubernetes workers run it, from the ConfigMap: `python -I /etc/harness/node/waitport.py HOST PORT`."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        up = sealed([str(waitport.__file__), "127.0.0.1", port, "--timeout", "5"], tmp_path)
    assert up.returncode == 0 and "master reachable after" in up.stdout, up.stderr
    down = sealed([str(waitport.__file__), "127.0.0.1", port, "--timeout", "1"], tmp_path)
    assert down.returncode == 1 and f"127.0.0.1:{port} not reachable after 1 s" in down.stderr, down.stderr


def test_backends_do_not_reach_back_into_the_controller_or_the_cli() -> None:
    for path in sorted((REPO / "harness" / "backends").glob("*.py")):
        upward = imported_modules(path) & {"harness.cli", "harness.run.controller", "harness.run.supervisor", "harness.run.status"}
        assert upward == set(), f"{path.relative_to(REPO)} imports {sorted(upward)}"
    result = subprocess.run([sys.executable, "-c", "import harness.targets, sys; print(sorted(m for m in sys.modules "
                             "if m in ('harness.cli', 'harness.run.controller', 'harness.run.supervisor')))"],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout == "[]\n", result.stderr
