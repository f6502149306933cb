"""Which of a node's rank processes the kernel's OOM killer ended, and the kernel's own words for it.
Standard library only (it is shipped to nodes).

A rank the OOM killer ends dies of SIGKILL, exactly like one a person kills; only the kernel can tell
the two apart. Its log (/dev/kmsg, readable as root or where kernel.dmesg_restrict is 0) names the
pid: `oom-kill:...,task_memcg=...,task=python3,pid=PID,uid=0` and `Out of memory: Killed process PID`
(`Memory cgroup out of memory: ...` when a cgroup's limit was hit). Where the log cannot be read (an
unprivileged user, a container), the memory cgroup's oom_kill counter (cgroup v2 memory.events, v1
memory.oom_control) says that the kernel killed something in the cgroup, though not which process:
compare it with its value at the node's start (oom_counts).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from pathlib import Path

KILLED = re.compile(r"Killed process (\d+) ")
OOM_KILL = re.compile(r"^oom-kill:.*[:,]pid=(\d+)(?:,|$)")
# printk's clock (microseconds since boot) and CLOCK_MONOTONIC drift apart by parts per million over a
# long uptime: records this much older than `since` still count. A pid is not reused that quickly.
CLOCK_SLACK_S = 30.0
KMSG_RECORD_MAX = 16384  # a read of /dev/kmsg returns one record, and fails when the buffer is smaller


def kernel_oom_kills(records: Iterable[str], pids: dict[int, int], since_boot_s: float) -> dict[int, str]:
    """{rank: the kernel's line} from /dev/kmsg records (`PRI,SEQ,MICROSECONDS,FLAGS;MESSAGE`) logged
    since since_boot_s (seconds since boot); `Killed process` is preferred to the `oom-kill:` line."""
    found: dict[int, str] = {}
    for record in records:
        header, _, message = record.partition(";")
        fields = header.split(",")
        if len(fields) < 3 or not fields[2].isdigit() or int(fields[2]) / 1e6 < since_boot_s:
            continue
        message = message.rstrip("\n")
        match = KILLED.search(message) or OOM_KILL.match(message)
        if match is None or int(match.group(1)) not in pids:
            continue
        rank = pids[int(match.group(1))]
        if rank not in found or KILLED.search(message):
            found[rank] = message
    return found


def read_kmsg() -> list[str] | None:
    """Every record the kernel's log still holds, without waiting for more; None where it cannot be read."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    records = []
    try:
        while True:
            try:
                data = os.read(fd, KMSG_RECORD_MAX)
            except BlockingIOError:  # nothing more logged
                break
            except BrokenPipeError:  # records were overwritten while reading: go on with the next one
                continue
            except OSError:
                return None
            if not data:
                break
            records.append(data.decode("utf-8", "replace"))
    finally:
        os.close(fd)
    return records


def _memory_roots() -> tuple[Path | None, Path | None]:
    """Where the cgroup v2 hierarchy and the v1 memory controller are mounted, if they are."""
    v2 = v1 = None
    with open("/proc/self/mounts", encoding="utf-8") as handle:
        for line in handle:
            _, point, kind, options, *_ = line.split()
            if kind == "cgroup2":
                v2 = Path(point)
            elif kind == "cgroup" and "memory" in options.split(","):
                v1 = Path(point)
    return v2, v1


def memory_cgroup(pid: int | str = "self") -> Path | None:
    """The directory of pid's memory cgroup: its v1 memory controller's, else its v2 cgroup's when that
    has the memory controller; None when neither is there (or pid is gone)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        v2, v1 = _memory_roots()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if v1 is not None and "memory" in controllers.split(","):
            return v1 / path.lstrip("/")
        if v2 is not None and controllers == "" and (v2 / path.lstrip("/") / "memory.events").exists():
            return v2 / path.lstrip("/")
    return None


def oom_kill_count(cgroup: Path) -> int | None:
    """How many processes the OOM killer has ended in cgroup (v2 memory.events, v1 memory.oom_control)."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (cgroup / name).read_text(encoding="utf-8")
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def oom_counts(pids: Iterable[int | str] = ("self",)) -> dict[str, int]:
    """{memory cgroup: its oom_kill count now} for each process (by default this one, whose cgroup the
    ranks it starts inherit): taken when a node starts, it is what cgroup_oom_kills compares with."""
    counts = {}
    for pid in pids:
        if (cgroup := memory_cgroup(pid)) is not None and (count := oom_kill_count(cgroup)) is not None:
            counts[str(cgroup)] = count
    return counts


def cgroup_oom_kills(pids: dict[int, int], before: dict[str, int]) -> dict[int, str]:
    """{rank: why} for every rank of pids when a cgroup's oom_kill count grew since `before`. The count
    cannot name the process it ended, so every rank is named: use it for a rank that died of SIGKILL."""
    for cgroup, count in before.items():
        now = oom_kill_count(Path(cgroup))
        if now is not None and now > count:
            line = f"memory cgroup {cgroup}: oom_kill count grew from {count} to {now} (the kernel's log is not " \
                   f"readable here)"
            return {rank: line for rank in pids.values()}
    return {}


def oom_kills(pids: dict[int, int], since: float, before: dict[str, int] | None = None) -> dict[int, str]:
    """{rank: the kernel's line} for the processes of pids ({pid: global rank}) the OOM killer ended
    since the wall-clock time `since`: from the kernel's log where it can be read, else from the
    memory cgroups' counters of `before` (oom_counts at the node's start)."""
    records = read_kmsg()
    if records is None:
        return cgroup_oom_kills(pids, before or {})
    booted = time.time() - time.monotonic()
    return kernel_oom_kills(records, pids, since - booted - CLOCK_SLACK_S)
