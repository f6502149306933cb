"""The payload's processes as the payload tests start them: torchrun or a plain process, each in a
session of its own, its output followed, and every descendant killed by (pid, start time) at the end
(torchrun's workers live in sessions of their own)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from harness.node.proctable import is_alive

from conftest import BY_HAND_TMPDIR, Streamed, free_port

PY = sys.executable
TORCHRUN_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"
)
def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("PET_")}
    return env | {"PYTHONUNBUFFERED": "1", "HARNESS_BACKEND": "gloo", "TMPDIR": BY_HAND_TMPDIR} | extra


def torchrun(nproc: int = 2, nnodes: int = 1, node_rank: int = 0, port: int | None = None) -> list[str]:
    return [
        PY, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port or free_port()}",
        "-m", "harness.payload.train",
    ]


def single() -> list[str]:
    return [PY, "-m", "harness.payload.train"]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start ticks) from /proc, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


class Job(Streamed):
    """One started process (a torchrun agent or a plain run): its output lines and its descendants."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        super().__init__(argv, env=env)
        self.descendants: dict[int, int] = {}

    def track(self) -> dict[int, int]:
        """Record every live descendant (torchrun's workers live in sessions of their own)."""
        seen, frontier = {self.proc.pid}, {self.proc.pid}
        while frontier:
            children = {}
            for entry in os.listdir("/proc"):
                if entry.isdigit() and (stat := _stat(int(entry))) and stat[1] in frontier:
                    children[int(entry)] = stat[2]
            self.descendants |= children
            frontier = set(children) - seen
            seen |= frontier
        return dict(self.descendants)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.track()
            self.kill_group()
        for pid, ticks in self.descendants.items():
            if is_alive(pid, ticks):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@contextmanager
def job(argv: list[str], env: dict[str, str] | None = None) -> Iterator[Job]:
    started = Job(argv, env or clean_env())
    try:
        yield started
    finally:
        started.close()


def run(argv: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> Job:
    with job(argv, env) as started:
        code = started.finish(timeout)
    assert code == 0, f"exit {code}:\n{started.output}"
    return started


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def losses(path: Path) -> dict[int, float]:
    """The payload's --losses file as global step -> loss; a resumed run's lines after the killed run's (the
    newest line wins)."""
    return {r["global_step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
