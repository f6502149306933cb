"""A standby: a node's torchrun and its workers, started before their attempt needs them -- the first attempt's while
the controller checks the job, a restart's while the attempt before runs -- so that the attempt waits for no import
(docs/recovery.md). The node agent installs this file in its private directory and runs it with the node's Python
(torch, and nothing of the harness):

    python -c "...run_path($HARNESS_AGENT_DIR/standby.py)"       the standby: torch imported once, waiting

The standby imports what torchrun imports (torch, torch.distributed), then forks one warm worker per local rank
(NPROC_PER_NODE): each has those imports done without paying for them again, where by hand torchrun imports torch
and then each worker imports it once more. A restart's standby, which waits while an attempt runs, also imports
what DistributedDataParallel and the optimizers import at their first step (torch._dynamo); the first attempt's,
taken as soon as the job is checked, leaves that to its program, as by hand, which a job that needs none of it (its
workers print, and import no torch) never pays. It then reads its order on stdin (one JSON
line: torchrun's arguments, the node's environment, the keys to drop; end of file: stood down unused) and runs
torchrun's own main with it. torchrun starts its workers as it always does, except that a worker it would start as
`python -u -m MODULE ARGS` or `python -u SCRIPT ARGS` is a warm worker instead, when their environments differ only in
what torch reads late (LATE: the rank, the world, the master, the attempt): the warm worker gets the command, the
environment, the working directory and torchrun's stdout and stderr over its socket, and runs the module or script as
Python's command line would. It is the standby's own child in a session of its own, as torchrun's workers are:
torchrun polls it, waits for it and signals its session as any worker's (WarmWorker). A worker that does not fit
(another interpreter, numactl around it, an environment torch read otherwise) starts as usual.

A warm worker's RANK is in its Python's os.environ, not in the environment the kernel shows for it: it announces
itself in the agent's directory (ANNOUNCED, read by harness.node.ranks) and starts the rank hook there.

Both end as the interpreter would -- an uncaught exception's traceback and exit 1, SystemExit's code, the threads
that are not daemons joined, the exit functions run (atexit, weakref.finalize, multiprocessing's), the standard
streams flushed -- without finalizing the modules: a second of every worker's end where torch is imported, in the
fork more (each freed object is a page copied). What a script's globals alone hold is freed when it returns.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import io
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
from typing import Any

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
TORCHRUN = "torch.distributed.run"
THREADS = "OMP_NUM_THREADS"  # read by OpenMP when torch loads: a new value is applied (torch.set_num_threads)
RESTARTS = "standby-"  # a restart's standby's NODE_RANK (standby-HOST, harness.targets.agent_link.standing_by)
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch's way to ask whether CUDA works without initializing it
POLL_SECONDS = (0.0005, 0.05)  # WarmWorker.wait's first and longest sleep between looks, as subprocess's own


def standby() -> None:
    run, why = _imported()
    warm = WarmWorkers(int(os.environ.get("NPROC_PER_NODE") or 1)) if run is not None else None
    line = sys.stdin.readline()
    if not line:
        os._exit(0)  # stood down unused: its warm workers read the end of their sockets and go too
    order = json.loads(line)
    for key in order["unset"]:
        os.environ.pop(key, None)
    os.environ.update(order["env"])
    _stdin_from_devnull()
    if warm is None:  # the node as it would have started without a standby: torchrun, afresh
        print(f"harness standby: node {os.environ.get('NODE_RANK', '?')} starts cold: {why}", file=sys.stderr,
              flush=True)
        os.execv(sys.executable, [sys.executable, "-m", TORCHRUN, *order["args"]])
    warm.take_over_worker_starts()
    os._exit(as_python_ends(lambda: run.main(order["args"])))


def _imported() -> tuple[Any, str]:
    """(torchrun's module, "") with what every worker imports done once here, for torchrun and all of them; or
    (None, why) where this Python or its torch cannot have warm workers."""
    if not hasattr(socket, "send_fds"):
        return None, f"its Python {sys.version.split()[0]} cannot pass a worker its output (socket.send_fds: 3.9+)"
    checked = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"  # a torch.cuda.is_available() while importing asks the driver without opening it
    try:
        import torch  # what every worker imports, once for all of them
        from torch.distributed import run
    except Exception as exc:  # noqa: BLE001 - whatever this torch lacks, the node starts as usual
        return None, f"its torch has no torchrun to start early ({type(exc).__name__}: {exc})"
    finally:
        if checked is None:
            os.environ.pop(NVML_CHECK)
    if os.environ.get("NODE_RANK", "").startswith(RESTARTS):  # it has the time: what DDP imports at its first step
        with contextlib.suppress(ImportError):  # a torch without it (older, or a stand-in): nothing to import
            import torch._dynamo  # noqa: F401
    if opened := _gpu_driver_opened():  # a fork would share its state, which CUDA forbids: the workers start cold
        return None, f"torch opened the GPU driver ({opened}) while it was imported, which no fork may share"
    gc.freeze()  # what is imported stays out of every collection, in the forks too: none copies its pages for that
    return run, ""


def _gpu_driver_opened() -> str:
    """A GPU device file this process holds open ("": none), as CUDA's initialization leaves it."""
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith(("/dev/nvidia", "/dev/kfd", "/dev/dri")):
                    return target
    return ""


class WarmWorker:
    """A forked warm worker as torchrun's worker handler uses a subprocess.Popen: its pid, poll, wait, signals."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.args: list[str] = []
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else: it has ended, how is not known
                    pid, status = self.pid, 1 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_SECONDS[0]
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, POLL_SECONDS[1])
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmWorkers:
    """The standby's warm workers, each forked with its end of a socket pair, waiting for the worker it is to be."""

    def __init__(self, count: int) -> None:
        self.env = dict(os.environ)  # what they started with: what torch read in them
        self.idle: list[tuple[WarmWorker, socket.socket]] = []
        for _ in range(count):
            self.idle.append(self._fork())

    def _fork(self) -> tuple[WarmWorker, socket.socket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with warnings.catch_warnings():  # Python 3.12's warning of other threads: torch's one native thread is idle
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid:
            theirs.close()
            return WarmWorker(pid), ours
        code = 1
        try:
            for _, sibling in self.idle:
                sibling.close()  # else a sibling never sees the standby's end of its socket close
            ours.close()
            os.setsid()  # a session of its own, as torchrun starts a worker: torchrun signals its group
            _stdin_from_devnull()
            code = warm_worker(theirs)
        finally:
            os._exit(code)

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

        def popen(handler: Any, args: tuple[str, ...], env: dict[str, str]) -> Any:
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

    def take(self, handler: Any, args: tuple[str, ...], env: dict[str, str]) -> WarmWorker | None:
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
            process.args = list(args)
            return process
        return None


def warm_worker(sock: socket.socket) -> int:
    """The worker torchrun asked for, run as `python ARGV` would run it; its exit code (0: stood down unused)."""
    try:
        message, fds, _, _ = socket.recv_fds(sock, ORDER_BYTES, 2)
    except OSError:
        message, fds = b"", []
    sock.close()
    if not message or len(fds) != 2:
        return 0
    order = json.loads(message)
    for fd_in, fd_to in zip(fds, (1, 2)):  # noqa: B905 - strict= is Python 3.10's; the node's may be older
        os.dup2(fd_in, fd_to)
        os.close(fd_in)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    if "numpy.random" in sys.modules:  # a fresh Python seeds it anew; a fork would share the standby's state
        sys.modules["numpy.random"].seed()
    if (threads := os.environ.get(THREADS, "")).isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    announce()
    return as_python_ends(lambda: run_as_python(order["argv"][1:]))


def as_python_ends(main: Any) -> int:
    """main() run to its end, then what the interpreter does at its exit but finalize the modules; the exit code."""
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if code == 1 and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - printed and ended on, as the interpreter would
        exc = exc.with_traceback(_from_the_program(exc.__traceback__))  # what any hook prints: the program's part
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 1
    gc.collect()  # what only the program's own objects held (files not closed) freed, and flushed
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed stream, a reader gone
            stream.flush()
    return code


def _from_the_program(trace: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the program's first frame on, as Python shows a script's: not this file's or runpy's."""
    ours = {os.path.abspath(__file__), runpy.__file__}
    while trace is not None and (trace.tb_frame.f_code.co_filename in ours
                                 or trace.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        trace = trace.tb_next
    return trace


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
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        sys.argv = args
        runpy.run_path(os.path.abspath(args[0]), run_name="__main__")  # __file__ absolute, as Python 3.9's


def _unbuffered(fd: int, like: Any) -> io.TextIOWrapper:
    """A text stream on fd as `python -u` makes it: every write reaches the file at once."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=like.encoding, errors=like.errors,
                            write_through=True)


def _stdin_from_devnull() -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


if __name__ == "__main__":
    standby()
