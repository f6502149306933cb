"""The import rules that keep node code runnable on hosts without the harness, and the layout's
direction of dependencies, checked for real.

Node code (harness.node) travels to hosts on a Python's stdin (harness.targets.boot) and runs with the
host's (or an image's) own Python, so it may import only the standard library and its siblings; here
it runs in an interpreter that cannot import `harness` or anything in site-packages (`python -I -S`
from an empty directory), because this test machine's venv has the harness installed and would hide a
stray import. The payload must run under plain torchrun, so it imports nothing of the harness outside
harness.payload. Every import statement counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from harness.node import allreduce, netcheck, pod, probe
from harness.node.protocol import Kind, message_line
from harness.plan.planner import NodePlan
from harness.targets.agent_link import agent_argv, agent_program
from harness.targets.boot import BOOT, shipped, siblings

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "harness"
SEALED = [sys.executable, "-I", "-S"]  # no PYTHONPATH, no cwd, no site-packages
# What beyond the standard library and harness.node each node module may import: the full probe
# imports torch to measure it (inside a guard that turns a missing torch into a finding); the
# collective's all_reduce runs under torchrun on hosts that have torch; the rank hook imports the
# environment's own sitecustomize, where there is one, after itself.
BEYOND_STDLIB = {"probe": {"torch"}, "allreduce": {"torch", "torch.distributed"}, "rank_hook": {"sitecustomize"},
                 "standby": {"torch", "torch._dynamo", "torch.distributed",
                             "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"}}
# Which packages each package of the harness may import (its own modules always): data flows one way. The
# run record is below everything that runs or shows a run; the judges of health are pure (they read no record
# and run nothing); the live run and the verbs that take a run id are siblings: neither imports the other.
ALLOWED = {
    "harness.spec": {"harness.errors"},
    "harness.plan": {"harness.errors", "harness.spec"},
    "harness.node": set(),
    "harness.record": {"harness.errors", "harness.spec", "harness.node"},
    "harness.health": {"harness.plan", "harness.node"},
    "harness.targets": {"harness", "harness.errors", "harness.spec", "harness.plan", "harness.node"},
    "harness.control": {"harness.errors", "harness.spec", "harness.plan", "harness.node", "harness.targets",
                        "harness.record", "harness.health"},
    "harness.view": {"harness.errors", "harness.spec", "harness.plan", "harness.node", "harness.targets",
                     "harness.record", "harness.health"},
    "harness.preflight": {"harness", "harness.errors", "harness.spec", "harness.plan", "harness.node",
                          "harness.targets", "harness.record", "harness.control"},
    # Python's way in: the verbs' own core (harness.commands), and the record and views they read.
    "harness.api": {"harness.cli", "harness.commands", "harness.errors", "harness.spec", "harness.node",
                    "harness.record", "harness.view"},
}


def modules() -> dict[str, Path]:
    """Every module of the harness by its dotted name."""
    found = {}
    for path in HARNESS.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, wherever the statement stands (`from a import b` counts a.b where
    that is a module of the harness)."""
    known = modules()
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    # Imports for the type checker alone (`if TYPE_CHECKING:`) never run: harness/__init__.py names the API's types so.
    typing_only = {id(inner) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for inner in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the rules here need absolute names"
            found.add(node.module or "")
            found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known}
    return found


def harness_imports() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for m in imported_modules(path) if m in known and m != name} for name, path in known.items()}


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_anywhere_in_the_harness() -> None:
    graph = harness_imports()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module):], module]
            pytest.fail(f"import cycle: {' -> '.join(cycle)}")
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    # Imports inside functions are in the graph too (commands imports its targets only when a verb runs).
    assert "harness.preflight.gates" in graph["harness.commands"]


def test_packages_import_only_what_comes_before_them() -> None:
    for module, imported in sorted(harness_imports().items()):
        if package(module) not in ALLOWED:
            continue
        outside = {m for m in imported if package(m) != package(module) and package(m) not in ALLOWED[package(module)]}
        assert outside == set(), f"{module} imports {sorted(outside)}"


def test_every_folder_of_the_harness_has_its_rule_and_a_size_a_reader_can_take_in() -> None:
    """A new folder gets a line in ALLOWED (the payload has its own rule below); a folder of more than 16 modules
    holds more than one idea and is split."""
    folders = {path.parent for path in HARNESS.rglob("*.py") if path.parent != HARNESS}
    packages = {".".join(folder.relative_to(REPO).parts[:2]) for folder in folders}
    assert packages - set(ALLOWED) == {"harness.payload"}, sorted(packages - set(ALLOWED))
    for folder in folders:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        assert count <= 16, f"{folder.relative_to(REPO)} holds {count} modules"


def test_targets_reach_neither_preflight_nor_run_control() -> None:
    """The check a target runs before it starts is handed to it; the controller drives targets."""
    for module, imported in harness_imports().items():
        if package(module) == "harness.targets":
            assert not {package(m) for m in imported} & {"harness.preflight", "harness.control", "harness.cli",
                                                          "harness.commands"}, module


def test_a_local_launch_loads_neither_paramiko_nor_the_ssh_target(tmp_path: Path) -> None:
    code = ("import argparse, sys\nfrom harness import commands\n"
            "commands.backend_for(argparse.Namespace(hosts=None, skip_preflight=False))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'paramiko' or m.startswith('harness.targets.ssh')"
            " or m.startswith('harness.preflight.runner')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.stdout == "[]\n", result.stderr


def sealed(args: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SEALED, *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)


def sealed_boot(name: str, args: list[str], cwd: Path, rest: str = "") -> subprocess.CompletedProcess[str]:
    """harness.node.<name> as hosts get it: BOOT on the command line, the program on stdin."""
    return sealed(["-c", BOOT, f"harness-{name}"], cwd, input=shipped(name, args).decode() + rest)


def test_the_sealed_interpreter_really_cannot_import_the_harness(tmp_path: Path) -> None:
    """The negative control: without it, the runs below would prove nothing."""
    assert subprocess.run([sys.executable, "-c", "import harness"], cwd=tmp_path).returncode == 0
    result = sealed(["-c", "import harness"], tmp_path)
    assert "No module named 'harness'" in result.stderr
    assert "No module named 'yaml'" in sealed(["-c", "import yaml"], tmp_path).stderr


@pytest.mark.parametrize("path", sorted((HARNESS / "node").glob("*.py")), ids=lambda p: p.stem)
def test_node_code_imports_only_the_standard_library_and_itself(path: Path) -> None:
    outside = {name for name in imported_modules(path) if name.split(".")[0] not in sys.stdlib_module_names
               and name != "harness.node" and not name.startswith("harness.node.")}
    assert outside == BEYOND_STDLIB.get(path.stem, set()), f"{path.name} imports {sorted(outside)}: hosts may not have them"


def test_payload_imports_nothing_of_the_harness_outside_itself() -> None:
    payload = HARNESS / "payload"
    for path in sorted(payload.glob("*.py")):
        strays = {m for m in imported_modules(path) if m.split(".")[0] == "harness"
                  and m != "harness.payload" and not m.startswith("harness.payload.")}
        assert strays == set(), f"{path.relative_to(REPO)} imports {sorted(strays)}"


def test_shipped_code_takes_its_siblings_along() -> None:
    assert siblings("agent") == ("protocol", "link", "collectives", "gpu", "proctable", "ranks", "observer", "oom",
                                 "store_port")
    assert siblings("link") == ("protocol",)
    assert siblings("proctable") == ()
    assert siblings("probe") == ("gpu", "proctable", "protocol", "ranks")
    assert siblings("netcheck") == ("store_port",)
    assert shipped("agent", ["x"]).count(b"\n") == 1, "the program must be one line: BOOT reads one"


def test_node_agent_runs_sealed_with_a_short_command_line(tmp_path: Path) -> None:
    """The agent exactly as targets start it: its output, then the exit marker, then its own exit."""
    node = NodePlan(host="h", address="127.0.0.1", node_rank=0, nproc=1, argv=("sh", "-c", "echo hello; exit 3"),
                    env={"HARNESS_RUN_ID": "sealed-test", "NODE_RANK": "0", "HARNESS_ATTEMPT": "0"})
    argv = agent_argv(sys.executable, node)
    assert argv[1:3] == ["-I", "-S"]
    assert len(" ".join(argv[1:])) <= 100 and argv[-5:] == ["sealed-test", "node", "0", "attempt", "0"]
    # stdin stays open, as the controller's end does: its end of file would mean "controller gone, stop"
    process = subprocess.Popen(argv, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    assert process.stdout is not None and process.stdin is not None
    process.stdin.write(agent_program(node, grace=1, silence=60, watch=0))
    process.stdin.flush()
    output = process.stdout.read().decode()
    assert process.wait(timeout=60) == 3
    process.stdin.close()
    assert output == "hello\n" + message_line(Kind.NODE_EXIT, "3").decode()


def test_preflight_probe_runs_sealed(tmp_path: Path) -> None:
    config = {"import_torch": False, "workdir": str(tmp_path), "entrypoint": {"module": "harness.payload.train"},
              "master_address": "127.0.0.1", "data_paths": []}
    result = sealed_boot("probe", ["ANSWER=", json.dumps(config)], tmp_path)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout.removeprefix("ANSWER="))
    assert (facts["torch"], facts["harness"], facts["workdir_exists"]) == (probe.MISSING, probe.MISSING, True)


def test_shipped_code_leaves_the_nodes_own_harness_visible() -> None:
    """The probe, shipped, still finds the harness of its workdir (no made-up `harness` package hides it)."""
    config = {"import_torch": False, "workdir": str(REPO), "entrypoint": {"module": "harness.node.allreduce"},
              "master_address": "127.0.0.1", "data_paths": []}
    result = subprocess.run([sys.executable, "-c", BOOT, "harness-probe"], cwd=REPO, capture_output=True, text=True,
                            timeout=60, input=shipped("probe", ["ANSWER=", json.dumps(config)]).decode())
    facts = json.loads(result.stdout.removeprefix("ANSWER="))
    assert facts["harness"] == harness.__version__, result.stderr
    assert facts["payload"]["path"] == str(HARNESS / "node" / "allreduce.py"), facts["payload"]


def test_netcheck_runs_sealed(tmp_path: Path) -> None:
    # stdin at its end after the program: the listener answers, then stops at once
    result = sealed_boot("netcheck", ["ANSWER=", "listen", json.dumps({"ports": [0], "lifetime": 30})], tmp_path)
    assert result.returncode == 0, result.stderr
    ports = json.loads(result.stdout.removeprefix("ANSWER="))["ports"]
    assert len(ports) == 1 and ports[0]["port"] > 0, ports
    assert netcheck.__name__ == "harness.node.netcheck"


def test_the_tree_kill_runs_sealed(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sh", "-c", "sleep 300 & wait"])
    try:
        result = sealed_boot("proctable", [str(sleeper.pid), "5"], tmp_path)
        assert result.returncode == 0, result.stderr
        assert sleeper.wait(timeout=30) != 0
    finally:
        sleeper.kill()


def test_the_pods_program_runs_sealed(tmp_path: Path) -> None:
    """As Kubernetes workers run it, from the ConfigMap: `python -I /etc/harness/pod.py wait|serve HOST PORT`."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = str(server.getsockname()[1])
        up = sealed([str(pod.__file__), "wait", "127.0.0.1", port, "--timeout", "5"], tmp_path)
    assert up.returncode == 0 and "master reachable after" in up.stdout, up.stderr
    down = sealed([str(pod.__file__), "wait", "127.0.0.1", port, "--timeout", "1"], tmp_path)
    assert down.returncode == pod.CONTROLLER_LOST and f"127.0.0.1:{port} not reachable after 1 s" in down.stderr, \
        down.stderr
    (tmp_path / "key").write_text("k")
    alone = sealed([str(pod.__file__), "serve", "127.0.0.1", port, "--timeout", "1", "--key", str(tmp_path / "key")],
                   tmp_path)
    assert alone.returncode == pod.CONTROLLER_LOST and f"no controller at 127.0.0.1:{port} for 1 s" in alone.stdout
    keyless = sealed([str(pod.__file__), "serve", "127.0.0.1", port], tmp_path)
    assert keyless.returncode == 2 and "serve needs --key" in keyless.stderr, keyless.stderr


def test_allreduce_is_a_torchrun_module_of_the_harness() -> None:
    assert allreduce.__name__ == "harness.node.allreduce"
