"""How node code reaches a node: on the standard input of the Python that runs it, not on its
command line, so that `ps` on a node shows a short line naming what runs.

    python [-I -S] -c "$BOOT" LABEL...      stdin: one line (`shipped`), then the program's own input

BOOT reads that one line (byte by byte, so nothing after it is consumed), which holds a module of
harness.node and the sibling modules it imports, and runs the module as __main__ with the
arguments the line carries; LABEL is for `ps` only (e.g. the run id and node rank). The rest of
stdin is the program's: the node agent's protocol, a network check's "stop" at end of file.
Nothing is written to the node's disk, and the node needs nothing but Python's standard library.
"""

from __future__ import annotations

import ast
import functools
import threading
from collections.abc import Sequence
from pathlib import Path

BOOT = "import sys;exec(sys.stdin.buffer.raw.readline())"
PACKAGE = "harness.node"
_HERE = Path(__file__).parent.parent / "node"  # the code that is shipped
# Preflight ships a script to every host from a thread each. CPython 3.11 keeps ast.parse's recursion
# depth per interpreter, not per thread: two parses at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (python/cpython#106905), so one parse at a time.
_PARSING = threading.Lock()


def _tree(module: str) -> ast.Module:
    with _PARSING:
        return ast.parse((_HERE / f"{module}.py").read_text(encoding="utf-8"))

# Runs on the node, from the shipped line: each sibling becomes the module harness.node.NAME (and no
# harness package is made up: a probe must still find the node's real one), then the program runs as
# __main__. Node code therefore imports its siblings as `from harness.node.NAME import ...`.
_LOADER = """
import sys, types
def load(name, source, as_name):
    module = types.ModuleType(as_name)
    module.__file__ = "<shipped harness.node." + name + ">"
    sys.modules[as_name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
for name, source in SIBLINGS:
    load(name, source, "harness.node." + name)
sys.argv = ARGV
load(MAIN[0], MAIN[1], "__main__")
"""


@functools.cache
def siblings(name: str) -> tuple[str, ...]:
    """The modules of harness.node that `name` imports, and theirs, dependencies first (found once per
    process: every node and every preflight host ships the same)."""
    order: list[str] = []

    def visit(module: str) -> None:
        for node in ast.walk(_tree(module)):
            imported = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in imported:
                if name == PACKAGE or (name.startswith(f"{PACKAGE}.") and not isinstance(node, ast.ImportFrom)):
                    raise ValueError(f"harness/node/{module}.py: import a sibling as `from {PACKAGE}.NAME import "
                                     f"...`, which works where it is shipped")
                sibling = name.removeprefix(f"{PACKAGE}.")
                if sibling != name and sibling not in order:
                    visit(sibling)
                    order.append(sibling)

    visit(name)
    return tuple(order)


def source(module: str) -> str:
    """The text of harness/node/<module>.py, as it is shipped (or installed on a node: the rank hook)."""
    return (_HERE / f"{module}.py").read_text(encoding="utf-8")


def shipped(name: str, args: Sequence[str]) -> bytes:
    """The stdin line that runs harness.node.<name> with args under BOOT: one line, since every
    newline in the sources is escaped by repr."""
    program = (f"SIBLINGS = {[(s, source(s)) for s in siblings(name)]!r}\n"
               f"ARGV = {[name, *args]!r}\nMAIN = {(name, source(name))!r}\n{_LOADER}")
    return f"exec({program!r})\n".encode()
