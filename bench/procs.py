"""Processes the benchmarks start: timestamped output lines, and a tag that finds every descendant.

Every process gets BENCH_TAG=<unique> in its environment; torchrun agents and workers inherit it,
so `tagged()` finds all of them (also workers in sessions of their own) and `Proc.kill()` ends
exactly what this benchmark started, never anything found by name.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.node.proctable import stat_fields

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NODE_RANK", "NNODES", "NPROC_PER_NODE")


_scratch: Path | None = None


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A TMPDIR for every process started meanwhile (plain torchrun leaves /tmp/torchelastic_* behind),
    removed at the end."""
    global _scratch  # noqa: PLW0603 - every Proc started meanwhile reads it
    path = _scratch = Path(tempfile.mkdtemp(prefix="bench-tmp-"))
    try:
        yield path
    finally:
        _scratch = None
        shutil.rmtree(path, ignore_errors=True)


def harness_at(commit: str, into: Path) -> Path:
    """The harness package of commit, unpacked from git into `into` (the working tree stays as it is): run with
    `into` as the working directory, `python -m harness.cli` (and a job's `-m harness.payload...`) is that
    commit's."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "harness"], capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has used (user and system, all its threads)."""
    fields = stat_fields(pid)
    if fields is None:
        raise RuntimeError(f"pid {pid} is gone")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any torchrun/harness variables a caller may have, plus extra."""
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARS and not k.startswith(("PET_", "HARNESS_", "BENCH_TAG"))}
    return env | {"PYTHONUNBUFFERED": "1"} | ({"TMPDIR": str(_scratch)} if _scratch else {}) | extra


def tagged(tag: str) -> list[int]:
    """PIDs of live processes with BENCH_TAG=tag in their environment."""
    return with_env(f"BENCH_TAG={tag}")


def with_env(*entries: str) -> list[int]:
    """PIDs of live processes whose environment has every one of entries (`NAME=value`)."""
    wanted = {entry.encode() for entry in entries}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted <= set(f.read().split(b"\0")):
                    state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def torchrun(*, nnodes: int = 1, node_rank: int = 0, nproc: int = 1, port: int) -> list[str]:
    return [PY, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0"]


class Proc:
    """A process in a session of its own whose output lines are kept with their arrival time."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None, tag: str | None = None,
                 cwd: Path = REPO) -> None:
        self.tag = tag or uuid.uuid4().hex
        self.argv = list(argv)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, cwd=cwd, env=(env if env is not None else clean_env()) | {"BENCH_TAG": self.tag},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self.ended: float | None = None  # time.monotonic() when the process exited
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._reap, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _reap(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> tuple[float, re.Match[str]]:
        """(arrival time, match) of the first line matching pattern that arrived after `after`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for when, line in self.lines[seen:]:
                if when > after and (match := regex.search(line)):
                    return when, match
            seen = len(self.lines)
            if time.monotonic() > deadline or (self.proc.poll() is not None and not self._reader.is_alive()):
                tail = "\n".join(line for _, line in self.lines[-15:])
                raise RuntimeError(f"{pattern!r} not seen from {self.argv[:4]}...; last lines:\n{tail}")
            time.sleep(0.01)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        while self.ended is None:
            time.sleep(0.001)
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """SIGKILL the session and every process carrying this tag; reap."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        for _ in range(3):
            pids = tagged(self.tag)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        self.proc.wait()
        self._reader.join(timeout=5)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def run_lines(argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 300) -> list[str]:
    """Run to completion and return the output lines; a failure raises with the tail of the output."""
    with Proc(argv, env) as p:
        code = p.wait(timeout)
        if code != 0:
            tail = "\n".join(line for _, line in p.lines[-15:])
            raise RuntimeError(f"{' '.join(argv[:6])}... exited {code}:\n{tail}")
        return [line for _, line in p.lines]


IMG_S = re.compile(r"step (\d+)/\d+ .*img/s (\d+)")


def steady_images_per_second(lines: Sequence[str]) -> float:
    """The payload's progress lines (`... step S/N ... img/s R`, rank 0), first interval dropped as
    warm-up; equal-sized intervals, so the overall rate is the harmonic mean."""
    rates = [float(m.group(2)) for line in lines if (m := IMG_S.search(line))]
    steady = rates[1:] or rates
    if not steady:
        raise RuntimeError("no progress lines with img/s in the payload's output:\n" + "\n".join(lines[-15:]))
    return len(steady) / sum(1 / r for r in steady)
