"""A standby: the next attempt's torchrun and its workers, started on a host while the attempt before runs, so
that a restart waits for no import (docs/recovery.md). The node agent installs this file in its private
directory and runs it with the node's Python (torch, and nothing of the harness):

    python -c "...run_path($HARNESS_AGENT_DIR/standby.py)"       the standby: torchrun imported, waiting
    python $HARNESS_AGENT_DIR/standby.py --warm-worker FD          a warm worker: torch imported, waiting

The standby starts one warm worker per local rank (NPROC_PER_NODE), then reads its order on stdin (one JSON
line: torchrun's arguments, the node's environment, the keys to drop; end of file: stood down unused) and runs
torchrun's own main with it. torchrun starts its workers as it always does, except that a worker it would start
as `python -u -m MODULE ARGS` or `python -u SCRIPT ARGS` is a warm worker instead, when their environments differ
only in what torch reads late (LATE: the rank, the world, the master, the attempt): the warm worker gets the
command, the environment, the working directory and torchrun's stdout and stderr over its socket, and runs the
module or script as Python's command line would. It is the standby's own child in a session of its own, as
torchrun's workers are: torchrun polls it, waits for it and signals its session as any worker's. A worker that
does not fit (another interpreter, numactl around it, an environment torch read otherwise) starts as usual.

A warm worker's RANK is in its Python's os.environ, not in the environment the kernel shows for it: it announces
itself in the agent's directory (ANNOUNCED, read by harness.node.ranks) and starts the rank hook there.

The standby ends as the interpreter would (main's traceback, exit 1; the exit functions run), without finalizing
torch's modules (0.4 s of every stop).
"""

from __future__ import annotations

import atexit
import importlib.util
import io
import json
import os
import runpy
import socket
import subprocess
import sys
import traceback
import types
from typing import Any

WARM_WORKER = "--warm-worker"
ANNOUNCED = "rank-{pid}-{ticks}"  # a warm worker's RANK, in the agent's directory (harness.node.ranks reads it)
RANK_HOOK = "sitecustomize.py"  # the agent's rank hook, beside this file (harness.node.rank_hook)
ORDER_BYTES = 1 << 20
# What a worker's environment may change from the warm worker's: torchrun's worker variables and the harness's
# per-attempt ones, all read when the process group is made, or later. Any other change (CUDA_VISIBLE_DEVICES,
# PYTHONPATH, a TORCH_* read at import) and the worker starts afresh.
LATE = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NODE_RANK", "NNODES", "HARNESS_ATTEMPT",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
})
TORCHRUN_ARGUMENTS = "PET_"  # torchrun's own arguments given as environment (PET_NNODES): read by torchrun alone
THREADS = "OMP_NUM_THREADS"  # read by OpenMP when torch loads: a new value is applied (torch.set_num_threads)


def standby() -> None:
    warm = WarmWorkers(int(os.environ.get("NPROC_PER_NODE") or 1))  # first: their imports and ours side by side
    from torch.distributed import run  # torchrun's imports: what a restart would otherwise wait for

    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    order = json.loads(line)
    for key in order["unset"]:
        os.environ.pop(key, None)
    os.environ.update(order["env"])
    _stdin_from_devnull()
    warm.take_over_worker_starts()
    try:
        run.main(order["args"])
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if code == 1 and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed and ended on, as the interpreter would
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class WarmWorkers:
    """The standby's warm workers, each a process of its own with its end of a socket pair."""

    def __init__(self, count: int) -> None:
        self.env = dict(os.environ)  # what they started with: what torch read in them
        self.idle = [self._start() for _ in range(count)]

    @staticmethod
    def _start() -> tuple[subprocess.Popen[bytes], socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        process = subprocess.Popen([sys.executable, os.path.abspath(__file__), WARM_WORKER, str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        return process, ours

    def take_over_worker_starts(self) -> None:
        """torchrun's workers start through here: a warm one where it fits (torch of another version, without
        this hook: every worker as usual)."""
        try:
            from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
                SubprocessHandler,
            )
            cold = SubprocessHandler._popen
        except (ImportError, AttributeError):
            return
        warm = self

        def popen(handler: Any, args: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes]:
            return warm.take(handler, args, env) or cold(handler, args, env)

        SubprocessHandler._popen = popen  # type: ignore[method-assign,assignment]  # torch's one way to start them

    def unfit(self, args: tuple[str, ...], env: dict[str, str]) -> str:
        """Why a warm worker cannot be this worker ("": it can): not `python -u ...` with this Python, or an
        environment that changes more than what torch reads late."""
        if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
            return f"its command is not `{sys.executable} -u ...`"
        late = LATE | ({THREADS} if env.get(THREADS, "").isdigit() else set())
        changed = {key for key in env.keys() | self.env.keys() if env.get(key) != self.env.get(key)}
        early = sorted(key for key in changed - late if not key.startswith(TORCHRUN_ARGUMENTS))
        return f"its environment changed {', '.join(early)}, which torch may have read already" if early else ""

    def take(self, handler: Any, args: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """A warm worker given the worker torchrun asks for (None: it starts as usual, and says why)."""
        if self.idle and (why := self.unfit(args, env)):
            print(f"harness standby: a worker starts afresh, not warm: {why}", file=sys.stderr, flush=True)
            return None
        while self.idle:
            process, sock = self.idle.pop(0)
            out = handler._stdout.fileno() if handler._stdout else 1
            err = handler._stderr.fileno() if handler._stderr else 2
            order = {"argv": list(args), "env": env, "cwd": os.getcwd()}
            try:
                socket.send_fds(sock, [json.dumps(order).encode()], [out, err])
            except OSError:  # it died waiting: the next one
                continue
            finally:
                sock.close()
            return process
        return None


def warm_worker(fd: int) -> None:
    """Torch imported, then the worker torchrun asked for, run as `python ARGV` would run it."""
    sock = socket.socket(fileno=fd)
    import torch
    import torch._dynamo
    import torch.distributed

    try:
        message, fds, _, _ = socket.recv_fds(sock, ORDER_BYTES, 2)
    except OSError:
        message, fds = b"", []
    if not message or len(fds) != 2:
        os._exit(0)  # stood down unused
    sock.close()
    order = json.loads(message)
    for fd_in, fd_to in zip(fds, (1, 2), strict=True):
        os.dup2(fd_in, fd_to)
        os.close(fd_in)
    _stdin_from_devnull()
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    if (threads := os.environ.get(THREADS, "")).isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    announce()
    run_as_python(order["argv"][1:])


def announce() -> None:
    """The rank this process now is, where the agent finds its ranks; and the rank hook started in it."""
    directory, rank = os.environ.get("HARNESS_AGENT_DIR"), os.environ.get("RANK", "")
    if not directory or not rank.isdigit():
        return
    with open(f"/proc/{os.getpid()}/stat", "rb") as handle:
        ticks = handle.read().rsplit(b")", 1)[1].split()[19].decode()
    with open(os.path.join(directory, ANNOUNCED.format(pid=os.getpid(), ticks=ticks)), "w", encoding="utf-8") as f:
        f.write(rank)
    spec = importlib.util.spec_from_file_location("harness_rank_hook", os.path.join(directory, RANK_HOOK))
    if spec is not None and spec.loader is not None and os.path.exists(os.path.join(directory, RANK_HOOK)):
        hook = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hook)
        hook.serve()


def run_as_python(args: list[str]) -> None:
    """args after the interpreter, as torchrun writes them: -u, then `-m MODULE` or SCRIPT, then the arguments."""
    if args[:1] == ["-u"]:
        args = args[1:]
        sys.stdout = sys.__stdout__ = _unbuffered(1, sys.stdout)  # type: ignore[misc]  # as -u makes both
        sys.stderr = sys.__stderr__ = _unbuffered(2, sys.stderr)  # type: ignore[misc]
    sys.modules["__main__"] = types.ModuleType("__main__")  # not this file's: the program's own, empty
    if args[0] == "-m":
        sys.argv = args[1:]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(args[1], alter_argv=True)  # type: ignore[attr-defined]  # what `python -m` runs
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def _unbuffered(fd: int, like: Any) -> io.TextIOWrapper:
    """A text stream on fd as `python -u` makes it: every write reaches the file at once."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=like.encoding, errors=like.errors,
                            write_through=True)


def _stdin_from_devnull() -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


if __name__ == "__main__":
    if sys.argv[1:2] == [WARM_WORKER]:
        warm_worker(int(sys.argv[2]))
    else:
        standby()
