"""The stand-in torchrun: `python -m torch.distributed.run FLAGS SCRIPT ARGS` with testbed/standin/shim first on
PYTHONPATH. Like torchrun it starts NPROC_PER_NODE ranks, each running SCRIPT ARGS in a session of its own with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR, ...), prefixes their lines with
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, ends the others when one fails (exit 1), and passes SIGTERM on; unlike it,
each rank is forked from it, not a new Python (see _fork). On node 0 it also serves the ranks' collectives
(Coordinator) where torchrun's agent serves its store."""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import signal
import socket
import string
import sys
import threading
import time
import traceback
from typing import IO

import torch.distributed  # noqa: F401 - imported once here, so that each forked rank has it already

from harness.node.standby import announce, run_as_python

TERM_SECONDS = 5.0  # ranks left to end after SIGTERM before SIGKILL, as torchrun's default
DRAIN_SECONDS = 2.0  # a failed rank's pipes read this long at most for what it said last (a child may hold them)


class Coordinator:
    """Node 0's side of every collective: a rank's `SEQ` line waits until all world_size ranks have sent it,
    then each gets `SEQ` back. A rank that ends without leaving the group (`bye`: its destroy_process_group) breaks
    it, as gloo's peers see a dead rank: every rank's connection is reset then, and any that comes to a collective
    later. A connection that says nothing (a probe of the port, as a pod's wait for its master) is no rank."""

    def __init__(self, port: int, world_size: int) -> None:
        self.world_size = world_size
        self.listener = socket.create_server(("", port), backlog=4096, reuse_port=False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.pending: dict[int, list[socket.socket]] = {}
        self.partial: dict[socket.socket, bytes] = {}
        self.members: set[socket.socket] = set()  # ranks that said hello and have not left
        self.broken = False  # a rank died: the group is gone
        threading.Thread(target=self._serve, name="standin-coordinator", daemon=True).start()

    def _serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.listener:
                    connection, _ = self.listener.accept()
                    self.partial[connection] = b""
                    self.selector.register(connection, selectors.EVENT_READ)
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _read(self, connection: socket.socket) -> None:
        try:
            data = connection.recv(65536)
        except OSError:
            data = b""
        if not data:
            died = connection in self.members
            self._drop(connection)
            if died:
                self.broken = True
                for other in list(self.partial):
                    self._drop(other)
            return
        *lines, self.partial[connection] = (self.partial[connection] + data).split(b"\n")
        for line in lines:
            self._arrive(connection, line)

    def _arrive(self, connection: socket.socket, line: bytes) -> None:
        if line.startswith(b"hello "):
            self.members.add(connection)
            return
        if line == b"bye":
            self.members.discard(connection)
            return
        if self.broken or not line.isdigit():
            self._drop(connection)
            return
        seq = int(line)
        waiting = self.pending.setdefault(seq, [])
        waiting.append(connection)
        if len(waiting) == self.world_size:
            for member in self.pending.pop(seq):
                with contextlib.suppress(OSError):
                    member.sendall(line + b"\n")

    def _drop(self, connection: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(connection)
        self.partial.pop(connection, None)
        self.members.discard(connection)
        for waiting in self.pending.values():
            if connection in waiting:
                waiting.remove(connection)
        self.pending = {seq: waiting for seq, waiting in self.pending.items() if waiting}
        connection.close()


def _flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun (stand-in)", allow_abbrev=False)
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1)
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int)
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1")
    parser.add_argument("--master-port", "--master_port", dest="master_port", type=int, default=29500)
    parser.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="")
    for ignored in ("--rdzv-id", "--rdzv-conf", "--max-restarts", "--tee", "--log-dir", "--redirects"):
        parser.add_argument(ignored)
    parser.add_argument("-m", "--module", dest="module", action="store_true")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    flags = _flags(sys.argv[1:] if argv is None else argv)
    nnodes = int(str(flags.nnodes).split(":")[-1])
    node_rank = flags.node_rank if flags.node_rank is not None else int(os.environ.get("NODE_RANK", "0"))
    addr, port = flags.master_addr, flags.master_port
    if flags.rdzv_endpoint:
        addr, _, endpoint_port = flags.rdzv_endpoint.rpartition(":")
        port = int(endpoint_port)
    world_size = nnodes * flags.nproc
    template = string.Template(os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", ""))
    ranks = []
    for local_rank in range(flags.nproc):
        rank = node_rank * flags.nproc + local_rank
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(flags.nproc), GROUP_RANK=str(node_rank), ROLE_RANK=str(rank),
                   MASTER_ADDR=addr, MASTER_PORT=str(port),
                   TORCHELASTIC_RUN_ID=os.environ.get("HARNESS_RUN_ID", "none"))
        args = [string.Template(a).safe_substitute(local_rank=local_rank) for a in flags.script_args]
        ranks.append(_Rank(rank, local_rank, _fork(env, flags.module, flags.script, args),
                           template.safe_substitute(rank=rank, local_rank=local_rank).encode()))
    if node_rank == 0:  # after the forks: a rank must not inherit a thread
        Coordinator(port, world_size)
    signal.signal(signal.SIGTERM, lambda *_: _end(ranks, 143))
    sys.exit(_supervise(ranks))


class _Rank:
    """A rank this launcher forked: its pid, and the read ends of its stdout and stderr."""

    def __init__(self, rank: int, local_rank: int, started: tuple[int, int, int], prefix: bytes) -> None:
        self.rank, self.local_rank = rank, local_rank
        self.pid, self.stdout, self.stderr = started
        self.prefix = prefix
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.code = os.waitstatus_to_exitcode(status)
        return self.code


def _fork(env: dict[str, str], module: bool, script: str, args: list[str]) -> tuple[int, int, int]:
    """A rank forked from this launcher, its imports done (torchrun execs a fresh Python: at hundreds of ranks on a
    few cores that start-up is most of the machine's work, not the harness's). Its environment holds its RANK only
    in Python's os.environ, so it announces the rank in the agent's directory and starts the rank hook, as the
    harness's warm workers do: with harness.node.standby's own announce and run_as_python."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(out_write)
        os.close(err_write)
        return pid, out_read, err_read
    code = 1
    try:
        os.setsid()
        os.dup2(out_write, 1)
        os.dup2(err_write, 2)
        for fd in (out_read, out_write, err_read, err_write):
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        announce()
        run_as_python(["-u", *(["-m", script] if module else [script]), *args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - as Python's own: the traceback, exit 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0, 0, 0


def _supervise(ranks: list[_Rank]) -> int:
    """Every rank's lines, prefixed, to this process's stdout and stderr until all have ended; 1 at the first
    failure (the others ended), else 0."""
    selector = selectors.DefaultSelector()
    for rank in ranks:
        for fd, out in ((rank.stdout, sys.stdout.buffer), (rank.stderr, sys.stderr.buffer)):
            selector.register(fd, selectors.EVENT_READ, (rank.prefix, out, bytearray()))
    while selector.get_map() or any(rank.poll() is None for rank in ranks):
        _pass_on(selector, 1.0)
        if not selector.get_map():
            time.sleep(0.1)
        for rank in ranks:
            if rank.poll() not in (None, 0):
                # What it said last, before its end is reported (torchrun's report follows the worker's lines): its
                # pipes read to their end, which the select above may have come just before.
                deadline = time.monotonic() + DRAIN_SECONDS
                while {rank.stdout, rank.stderr} & set(selector.get_map()) and time.monotonic() < deadline:
                    _pass_on(selector, 0.1)
                _report(rank)
                _end(ranks, 1)
    return 0


def _pass_on(selector: selectors.BaseSelector, timeout: float) -> None:
    """The ranks' lines that are ready within timeout, prefixed, on; a pipe that ended unregistered and closed."""
    for key, _ in selector.select(timeout=timeout) if selector.get_map() else []:
        prefix, out, partial = key.data
        data = os.read(key.fd, 65536)
        if not data:
            selector.unregister(key.fileobj)
            os.close(key.fd)
            if partial:
                _write(out, prefix, [bytes(partial)])
            continue
        *lines, rest = (bytes(partial) + data).split(b"\n")
        partial[:] = rest
        _write(out, prefix, lines)


def _report(rank: _Rank) -> None:
    """torchrun's own report of its first failed worker (its elastic agent's error line, then ChildFailedError's
    root cause), in the words the harness reads it by."""
    now = time.time()
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    print(f"E{stamp} {os.getpid()} torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: "
          f"{rank.code}) local_rank: {rank.local_rank} (pid: {rank.pid}) of binary: {sys.executable}\n"
          f"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n{'=' * 60}\n"
          f"Root Cause (first observed failure):\n[0]:\n  rank      : {rank.rank} (local_rank: {rank.local_rank})\n"
          f"  exitcode  : {rank.code} (pid: {rank.pid})\n{'=' * 60}", file=sys.stderr, flush=True)


def _write(out: IO[bytes], prefix: bytes, lines: list[bytes]) -> None:
    if lines:
        out.write(b"".join(prefix + line + b"\n" for line in lines))
        out.flush()


def _end(ranks: list[_Rank], code: int) -> None:
    """Every rank still running asked to end (SIGTERM to its session), killed after TERM_SECONDS; then exit."""
    for rank in ranks:
        if rank.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_SECONDS
    while any(rank.poll() is None for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rank in ranks:
        if rank.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rank.pid, signal.SIGKILL)
    os._exit(code)
