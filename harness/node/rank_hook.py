"""The start-up hook of every rank the node agent supervises: installed as sitecustomize.py in the agent's
private directory, which the node's setup line puts first on PYTHONPATH, so every Python the node starts
runs it, with no change to the user's script.

In a rank (RANK set, the first process of it: DataLoader workers and other children inherit the mark
and do nothing), once the script has initialized its process group, it serves torch's own handlers
(Flight Recorder's `fr_trace_json`, NCCL's `dump_nccl_trace_json`, ...) on a Unix socket in the agent's
directory, `RANK.sock`, from torch's C++ worker server: it answers without the GIL, so a rank stuck in
C code or in a collective is read as well as a running one. Until then it only looks, twice a second,
whether torch.distributed is there and initialized; a script that never uses it costs one sleeping
thread. Any sitecustomize the environment had before is imported after it. A standby's warm worker
(harness.node.standby), a Python started before it was a rank, loads this file once it is one and calls serve().
Standard library only:
torch is only ever taken from sys.modules, never imported here.
"""

import contextlib
import io
import os
import sys
import threading
import time

LOOK_SECONDS = 0.5
PR_SET_PTRACER = 0x59616D61  # prctl: which process (and its descendants) may ptrace this one under Yama
OWNER = "HARNESS_RANK_HOOK_PID"  # the rank process that serves: its children inherit it and stay quiet
_servers: list = []  # the worker server, kept alive for the process's lifetime


def _serve(directory: str, rank: str) -> None:
    while True:
        distributed = sys.modules.get("torch.distributed")
        initialized = getattr(distributed, "is_initialized", None)
        try:
            ready = initialized is not None and initialized()
        except Exception:  # noqa: BLE001 - a half-imported torch: look again later
            ready = False
        if ready:
            break
        time.sleep(LOOK_SECONDS)
    path = os.path.join(directory, f"{rank}.sock")
    try:
        if os.path.exists(path):
            os.unlink(path)
        _servers.append(sys.modules["torch._C._distributed_c10d"]._WorkerServer(path))
    except Exception as exc:  # noqa: BLE001 - an older torch without it: the agent says it cannot read
        try:
            with open(path + ".error", "w", encoding="utf-8") as handle:
                handle.write(f"{type(exc).__name__}: {exc}")
        except OSError:
            pass


def _readable_by_the_agent() -> None:
    """Yama's ptrace_scope 1 (Ubuntu's default, and most containers' hosts) lets a process be read only by its
    ancestors; py-spy, which reads this rank's stacks, is the node agent's child. The agent and its children
    may read this process, then: as the agent's own user, nothing more than that user could do."""
    agent = os.environ.get("HARNESS_AGENT_PID", "")
    if not agent.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PTRACER, int(agent), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl here: the stacks need the rights docs/health.md names


def _whole_lines() -> None:
    """Unbuffered (PYTHONUNBUFFERED, which the plan sets so lines come as they happen), print() writes its text and
    its newline in two writes; torchrun's tee reads a file's line to its end at once, so another stream's line
    (torch's C++ warnings on stderr) can fall between the two and cut the rank's line in half. Line buffered, each
    line is one write, still as it happens (and a progress bar's carriage return flushes as a newline does)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.write_through:  # not one the environment replaced
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(line_buffering=True, write_through=False)


def serve() -> None:
    """In a rank, the worker server once its process group is made (a thread that looks for it until then)."""
    directory, rank = os.environ.get("HARNESS_AGENT_DIR"), os.environ.get("RANK", "")
    if not directory or not rank.isdigit() or os.environ.get(OWNER) not in (None, str(os.getpid())):
        return
    os.environ[OWNER] = str(os.getpid())
    _whole_lines()
    _readable_by_the_agent()
    threading.Thread(target=_serve, args=(directory, rank), name="harness-rank-hook", daemon=True).start()


def _chain() -> None:
    """The sitecustomize this one hides (an environment's own), imported as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


if __name__ == "sitecustomize":  # as Python imports it at start-up; a warm worker calls serve() once it is a rank
    serve()
    _chain()
