"""A node's ranks as the kernel sees them: which processes are torchrun's workers, and how much each
has run. Standard library only (shipped to nodes with the agent).

A rank is a process below the agent whose environment carries this run's id and a RANK that its
parent's does not (a DataLoader worker inherits its rank's RANK; torchrun has none). What the
controller judges progress and slowness by (health/judge.py):
- cpu: CPU seconds of the rank and every process below it (its DataLoader workers compute for it);
- busy: seconds its main thread was on a CPU or waiting for one (schedstat): a rank that waits in a
  collective is asleep, so its peers' waiting shows as their lower busy share;
- io: bytes it and its children read and wrote (/proc/PID/io): a rank that mostly sleeps between
  steps still sends its collectives' data (gloo writes to sockets), a rank blocked in one does not;
- state: the main thread's scheduler state (R running, S sleeping, D disk, T stopped, Z zombie).
From them the agent judges each rank's progress (ProgressWatch): how long it has gone without, and how long its
count of completed collectives has stood still, said with every sample (RankSample.idle, .still). The controller
then judges a hang from two numbers a rank, as of the rank's newest sample, and a tick looks only at the ranks
that may be hung (at 16,384 ranks a look at every rank took 11 ms, twice a second). The rule is
node-local, as NVIDIA's ft_launcher's rank monitors are; the threshold (health.stall) stays the controller's.

A rank that a warm worker became (a standby's, harness.node.standby) carries its RANK only in its Python's
os.environ, not in the environment the kernel shows: it announces it in the agent's directory instead
(`rank-PID-TICKS`, its start time in clock ticks, so that a reused pid is never taken for it).

Their Python stacks are read from outside by py-spy: every thread, without the rank's cooperation or a
change to its script, even when it is stopped or stuck in C code; py-spy itself is a binary of the node's
Python environment. It reads the process's memory (process_vm_readv, i.e. ptrace rights over it): root, or
the same user with kernel.yama.ptrace_scope 0 (at 1 only a process's ancestors may, and py-spy is the
ranks' sibling), or CAP_SYS_PTRACE. Preflight checks it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from harness.node.proctable import environ, is_alive, stat_fields
from harness.node.protocol import RankSample

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
IDLE_SHARE = 0.02  # a rank that used less than 2% of one CPU between two samples made no progress


def find_ranks(below: list[int], run_id: str, directory: str | None = None) -> dict[int, int]:
    """{global rank: pid} among the processes below the agent (directory: the agent's, where warm workers
    announce the rank they became)."""
    found = announced(below, directory) if directory else {}
    run = run_id.encode()
    rank_of: dict[int, bytes] = {}
    for pid in below:
        env = environ(pid)
        if env.get(b"HARNESS_RUN_ID") == run and b"RANK" in env:
            rank_of[pid] = env[b"RANK"]
    for pid, rank in rank_of.items():
        fields = stat_fields(pid)
        if fields and rank_of.get(int(fields[1])) != rank and rank.isdigit():
            found[int(rank)] = pid
    return found


ANNOUNCED = re.compile(r"^rank-(\d+)-(\d+)$")  # harness.node.standby.ANNOUNCED: rank-PID-TICKS, holding the rank


def announced(below: list[int], directory: str) -> dict[int, int]:
    """{rank: pid} of the warm workers below the agent that announced the rank they became."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if (match := ANNOUNCED.match(name)) and int(match[1]) in below and is_alive(int(match[1]), int(match[2])):
                with contextlib.suppress(OSError, ValueError), open(os.path.join(directory, name), "rb") as handle:
                    found[int(handle.read())] = int(match[1])
    return found


def python_children(pid: int, tree: dict[int, list[int]]) -> list[int]:
    """The processes below a rank that run its Python (its DataLoader workers, multiprocessing's
    children), oldest first: a hang in one of them is the rank's. tree: children_of's."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return []
    found, stack = [], list(tree.get(pid, []))
    while stack:
        child = stack.pop()
        try:
            same = os.readlink(f"/proc/{child}/exe") == exe
        except OSError:
            continue
        if same:
            found.append(child)
        stack.extend(tree.get(child, []))
    return sorted(found, key=lambda child: int((stat_fields(child) or [b"0"] * 20)[19]))


def children_of(below: list[int]) -> dict[int, list[int]]:
    """Each process's children among below."""
    tree: dict[int, list[int]] = {}
    for pid in below:
        if fields := stat_fields(pid):
            tree.setdefault(int(fields[1]), []).append(pid)
    return tree


def sample(ranks: dict[int, int], tree: dict[int, list[int]]) -> dict[int, RankSample]:
    """Each rank still there, as the health message carries it. tree: children_of the processes below the agent."""
    found: dict[int, RankSample] = {}
    for rank, pid in ranks.items():
        own = stat_fields(pid)
        if not own:
            continue
        cpu, io, stack = 0, 0, [pid]
        while stack:
            member = stack.pop()
            fields = own if member == pid else stat_fields(member)
            if fields:
                cpu += int(fields[11]) + int(fields[12])
            io += _io_bytes(member)
            stack.extend(tree.get(member, []))
        try:
            with open(f"/proc/{pid}/schedstat", "rb") as handle:
                on_cpu, waiting = (int(v) for v in handle.read().split()[:2])
        except (OSError, ValueError):
            on_cpu = waiting = 0
        found[rank] = RankSample(pid, own[0].decode(), round(cpu / CLOCK_TICKS, 2), round((on_cpu + waiting) / 1e9, 3),
                                 io)
    return found


def progressed(before: RankSample, after: RankSample, seconds: float) -> bool:
    """Whether the rank made progress between two samples `seconds` apart: it used more than IDLE_SHARE of a CPU,
    read or wrote something, or completed a collective (an NCCL rank's complete with no I/O of its process)."""
    return after.cpu - before.cpu > IDLE_SHARE * seconds or after.io != before.io or after.completed > before.completed


class ProgressWatch:
    """The ranks of one node, sample after sample (each rank's samples taken at the node's times)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, RankSample]] = {}  # each rank's newest sample, and when it was taken
        self._moved: dict[int, float] = {}  # when each rank last progressed (its first sample's time: not yet)
        self._counted: dict[int, float] = {}  # the newest sample whose count of completed collectives was not now's

    def judged(self, t: float, samples: Mapping[int, RankSample]) -> dict[int, RankSample]:
        """Each of samples, taken at t, with its rank's idle and still seconds (to the millisecond)."""
        judged = {}
        for rank, sample in samples.items():
            last = self._last.get(rank)
            if last is None:
                self._moved[rank] = t
            else:
                before_t, before = last
                if progressed(before, sample, t - before_t):
                    self._moved[rank] = t
                if before.completed != sample.completed:
                    self._counted[rank] = before_t
            self._last[rank] = (t, sample)
            counted = self._counted.get(rank)
            judged[rank] = sample._replace(idle=round(t - self._moved[rank], 3),
                                           still=-1.0 if counted is None else round(t - counted, 3))
        return judged


def _io_bytes(pid: int) -> int:
    """Bytes pid has read and written through system calls: files, pipes, and gloo's sockets."""
    try:
        with open(f"/proc/{pid}/io", "rb") as handle:
            counters = dict(line.split(b":") for line in handle.read().splitlines())
        return int(counters[b"rchar"]) + int(counters[b"wchar"])
    except (OSError, KeyError, ValueError):
        return 0


def as_seen(pid: int, path: str) -> str:
    """A frame's file relative to the rank's working directory when it is below it (train.py:42)."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return path
    return path[len(cwd) + 1:] if path.startswith(cwd.rstrip("/") + "/") else path


def source_line(pid: int, path: str, line: int) -> str:
    """The text of a frame's line, as the rank sees the file (through its root: a container's own)."""
    try:
        with open(f"/proc/{pid}/root{path}", encoding="utf-8", errors="replace") as handle:
            for number, text in enumerate(handle, 1):
                if number == line:
                    return text.strip()[:160]
    except OSError:
        pass
    return ""


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
