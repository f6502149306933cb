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
  (as far as the recorder's buffer reaches), for slow ranks; the node's ranks' said together, a CollectiveArrivals each
  once every rank of the node has arrived (ArrivalsDigest): one time for the ranks that arrived together, the
  others by rank. At 16,384 ranks the controller took every rank's every arrival (0.2 of its core at 2,048
  nodes); now what it takes grows with the nodes, and a rank that straggles is still named with its own time;
- the last few entries (on a hang): where each rank is, by sequence number and operation.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
from collections.abc import Iterable, Mapping
from typing import Any

from harness.node.protocol import Arrival, CollectiveArrivals

READ_SECONDS = 5.0  # torch answers in milliseconds; a rank whose server cannot must not hold the agent up
RECORDERS = ("/handler/fr_trace_json", "/handler/dump_nccl_trace_json")
KEPT = 8  # entries of each process group kept for a hang's verdict
# A rank is named in its node's CollectiveArrivals when it arrived further than this share of the node's time between
# collectives from the rest: the controller counts the others as arriving at one time, a wait off by at most 1%.
DIGEST_SLACK = 0.01
WAITING_SECONDS = 40.0  # a collective not every rank of the node arrives at (a group of some of them) is let go


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


class ArrivalsDigest:
    """What an agent keeps between samples: the collectives some of its ranks have arrived at and others not yet,
    and when each group's last collective said began (the time between collectives that DIGEST_SLACK is a share of)."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, int], dict[int, int]] = {}  # (group, seq) -> rank -> when (ns)
        self._said: dict[str, tuple[int, int]] = {}  # group -> (seq, first arrival) of the last said

    def add(self, ranks: Iterable[int], arrived: Mapping[int, list[Arrival]], now_ns: int) -> list[CollectiveArrivals]:
        """The collectives that every one of ranks has now arrived at, in the order they began. One left behind by a
        later one of its group that is complete (a rank's arrival the recorder dropped), or waiting longer than
        WAITING_SECONDS, is let go."""
        for rank, items in arrived.items():
            for group, seq, created_ns in items:
                self._waiting.setdefault((group, seq), {})[rank] = created_ns
        everyone = set(ranks)
        complete = sorted(((min(times.values()), key) for key, times in self._waiting.items()
                           if everyone and everyone <= times.keys()))
        said = []
        for first, key in complete:
            times = self._waiting.pop(key)
            said.append(self._collective(key, first, {rank: times[rank] for rank in everyone}))
        behind = now_ns - int(WAITING_SECONDS * 1e9)
        for key, times in list(self._waiting.items()):
            last = self._said.get(key[0])
            if min(times.values()) < behind or (last is not None and key[1] < last[0]):
                del self._waiting[key]
        return said

    def _collective(self, key: tuple[str, int], first: int, times: dict[int, int]) -> CollectiveArrivals:
        group, seq = key
        last = self._said.get(group)
        slack = DIGEST_SLACK * (first - last[1]) / (seq - last[0]) if last is not None and seq > last[0] else 0.0
        if last is None or seq > last[0]:
            self._said[group] = (seq, first)
        at = sorted(times.values())[(len(times) - 1) // 2]
        return CollectiveArrivals(group, seq, at, {rank: ns for rank, ns in times.items() if abs(ns - at) > slack})


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
