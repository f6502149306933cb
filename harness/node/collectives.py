"""A rank's last collectives, read from torch's Flight Recorder through the rank's own worker server
(harness.node.rank_hook serves it on RANK.sock in the agent's directory). Standard library only (shipped
to nodes with the agent).

Flight Recorder (TORCH_FR_BUFFER_SIZE for gloo, TORCH_NCCL_TRACE_BUFFER_SIZE for NCCL, set by the plan)
keeps each rank's recent collectives: per process group a sequence number, the operation, sizes, when it
was enqueued, and whether it completed. Two recorders: the CPU one (gloo, `fr_trace_json`) and NCCL's
(`dump_nccl_trace_json`, empty in builds without CUDA); both are asked and their entries taken together.
What the agent makes of them:
- progress (every health sample): how many collectives the rank has completed, and for how long its
  oldest unfinished one has been waiting; a rank whose CPU spins in a CUDA synchronization still
  completes nothing;
- arrivals (every health sample): when it enqueued each collective it enqueued since the last sample
  (as far as the recorder's buffer reaches), for slow ranks;
- the last few entries (on a hang): where each rank is, by sequence number and operation.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from typing import Any

from harness.node.protocol import Arrival

READ_SECONDS = 5.0  # torch answers in milliseconds; a rank whose server cannot must not hold the agent up
RECORDERS = ("/handler/fr_trace_json", "/handler/dump_nccl_trace_json")
KEPT = 8  # entries of each process group kept for a hang's verdict


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=READ_SECONDS)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(READ_SECONDS)
        sock.connect(self.path)
        self.sock = sock


def socket_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"{rank}.sock")


def read_trace(directory: str, rank: int) -> list[dict[str, Any]] | str:
    """Every entry both recorders hold for rank, oldest first, or why none could be read."""
    path = socket_path(directory, rank)
    if not os.path.exists(path):
        try:
            with open(path + ".error", encoding="utf-8") as handle:
                return f"torch's worker server did not start: {handle.read().strip()}"
        except OSError:
            return "the rank has not initialized its process group (or its Python did not run the harness's hook)"
    entries: list[dict[str, Any]] = []
    answered = 0
    for handler in RECORDERS:
        connection = _UnixConnection(path)
        try:
            connection.request("POST", handler)
            response = connection.getresponse()
            body = response.read()
        except OSError as exc:
            return f"its worker server did not answer: {exc.strerror or exc}"
        finally:
            connection.close()
        if response.status != 200:
            continue  # NCCL's handler in a build without CUDA
        try:
            entries += json.loads(body).get("entries", [])
        except ValueError:
            continue
        answered += 1
    if not answered:
        return "its worker server has no Flight Recorder handler"
    unique = {(group_of(e), e.get("is_p2p"), e.get("collective_seq_id"), e.get("p2p_seq_id"), e.get("profiling_name"),
               e.get("time_created_ns")): e for e in entries}  # a torch whose two handlers share one recorder
    return sorted(unique.values(), key=lambda e: e.get("time_created_ns", 0))


def done(entry: dict[str, Any]) -> bool:
    return bool(entry.get("retired")) or entry.get("state") == "completed"


def group_of(entry: dict[str, Any]) -> str:
    """The process group's name, the same on every rank (its pg_id is local)."""
    group = entry.get("process_group") or [str(entry.get("pg_id", ""))]
    return str(group[0])


def progress(entries: list[dict[str, Any]], now_ns: int) -> tuple[int, float]:
    """(collectives completed, as the recorder still shows them: the highest sequence number completed in
    each group, summed; seconds the oldest unfinished one has waited, -1 for none)."""
    highest: dict[str, int] = {}
    waiting = [e["time_created_ns"] for e in entries if not done(e)]
    for entry in entries:
        if done(entry):
            key = group_of(entry) + ("/p2p" if entry.get("is_p2p") else "")
            highest[key] = max(highest.get(key, 0), _seq(entry))
    return sum(highest.values()), (now_ns - min(waiting)) / 1e9 if waiting else -1.0


def arrivals(entries: list[dict[str, Any]], after_ns: int) -> list[Arrival]:
    """Each collective enqueued after after_ns."""
    return [Arrival(group_of(e), _seq(e), e["time_created_ns"]) for e in entries
            if e.get("time_created_ns", 0) > after_ns and not e.get("is_p2p")]


def last_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's last KEPT collectives, as a hang's verdict reads them."""
    by_group: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        if not entry.get("is_p2p"):
            by_group.setdefault(group_of(entry), []).append(entry)
    return [{"group": group, "seq": _seq(e), "op": str(e.get("profiling_name", "")), "done": done(e),
             "sizes": e.get("input_sizes"), "created_ns": e.get("time_created_ns", 0)}
            for group, members in by_group.items() for e in members[-KEPT:]]


def _seq(entry: dict[str, Any]) -> int:
    return int(entry.get("collective_seq_id") or 0)
