"""Python stacks of a node's ranks, read from outside the process by py-spy: every thread, without the
rank's cooperation or a change to its script, even when it is stopped or stuck in C code. Standard
library only (it is shipped to nodes); py-spy itself is a binary of the node's Python environment.

py-spy reads the process's memory (process_vm_readv, i.e. ptrace rights over it): root, or the
same user with kernel.yama.ptrace_scope 0 (at 1 only a process's ancestors may, and py-spy is the
ranks' sibling), or CAP_SYS_PTRACE. Preflight checks it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

DUMP_SECONDS = 10.0  # a dump takes tens of milliseconds; a process py-spy cannot read must not hold us up


def py_spy_path(python: str = sys.executable) -> str | None:
    """py-spy beside the node's Python (its virtual environment's bin/), else on PATH."""
    beside = os.path.join(os.path.dirname(python), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def dump(pid: int, py_spy: str, stopped: bool = False) -> list[dict[str, Any]] | str:
    """Every thread of pid with its frames, innermost first (py-spy's JSON), or why it could not be read.
    py-spy pauses the process for the few milliseconds the read takes, so the stack is consistent; a
    stopped process (SIGSTOP) cannot move, and py-spy cannot pause it again: it is read as it is."""
    argv = [py_spy, "dump", "--pid", str(pid), "--json", *(["--nonblocking"] if stopped else [])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=DUMP_SECONDS, check=False,
                              stdin=subprocess.DEVNULL, env={**os.environ, "RUST_BACKTRACE": "0"})
    except subprocess.TimeoutExpired:
        return f"py-spy did not answer within {DUMP_SECONDS:g} s"
    except OSError as exc:
        return f"py-spy could not run: {exc.strerror or exc}"
    if done.returncode != 0:
        said = [line.strip() for line in done.stderr.splitlines()  # not a backtrace's indented frames
                if line.strip() and not line.startswith((" ", "\t", "stack backtrace"))]
        return " ".join(said) or f"py-spy exited with {done.returncode}"
    try:
        threads = json.loads(done.stdout)
    except ValueError:
        return "py-spy's output was not JSON"
    return [{"name": t.get("thread_name") or str(t.get("os_thread_id")), "tid": t.get("os_thread_id"),
             "active": t.get("active"), "gil": t.get("owns_gil"),
             "frames": [{"name": f["name"], "file": f["filename"], "line": f["line"]} for f in t.get("frames", [])]}
            for t in threads]
