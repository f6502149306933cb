"""The payload's training loop run in this process, watched: its host syncs and torch.compile's work.

In-process (one process, no torchrun env), so that the profiler and dynamo's counters see it all.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections import Counter
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from harness.payload import train

# What makes the host wait for the device: a tensor read into Python (.item(), bool(), float()) on
# any device, and on CUDA the runtime calls that block.
SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def train_here(argv: list[str]) -> str:
    """Run train.main(argv) here; its printed lines, after checking it succeeded."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = train.main(argv)
    assert code == 0, f"exit {code}:\n{out.getvalue()[-3000:]}"
    return out.getvalue()


def host_syncs(argv: list[str], cuda: bool = False) -> Counter[str]:
    """How often the whole run made the host wait for the device, by what made it wait."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        train_here(argv)
    return Counter(event.name for event in prof.events() if event.name in SYNC_EVENTS)


def check_steps_make_no_host_sync(argv: list[str], cuda: bool = False) -> None:
    """12 steps wait for the device no more often than 4 do; each of 3 progress lines reads the loss once.

    argv: a run of at least 12 steps in its first epoch.
    """
    quiet = [*argv, "--epochs", "1", "--log-every", "1000"]
    host_syncs([*quiet, "--max-steps", "4"], cuda)  # what a process does once: cuDNN's autotuning, allocations
    few = host_syncs([*quiet, "--max-steps", "4"], cuda)
    many = host_syncs([*quiet, "--max-steps", "12"], cuda)
    logged = host_syncs([*quiet, "--max-steps", "12", "--log-every", "4"], cuda)
    assert few, "the end of the run reads its loss and accuracy: the count must see that"
    assert many == few, f"8 more steps waited for the device: {many - few}"
    reads = logged["aten::_local_scalar_dense"] - few["aten::_local_scalar_dense"]
    assert reads == 3, f"3 progress lines read the loss {reads} times"


def compile_counts(argv: list[str], backend: str = "inductor") -> dict[str, Any]:
    """dynamo's counters over one run: frames compiled, graphs, graph breaks (with their reasons). backend: the
    one torch.compile hands the graphs to; frames, graphs, breaks and recompiles are dynamo's whichever it is, so
    on a CPU `aot_eager` proves them (and autograd's tracing) without inductor's C++ builds, which take minutes
    on a busy 2-core machine (tests/gpu compiles with inductor)."""
    torch._dynamo.reset()
    counters.clear()
    compile_as_asked = torch.compile
    torch.compile = functools.partial(compile_as_asked, backend=backend)  # type: ignore[assignment]
    try:
        output = train_here(argv)
    finally:
        torch.compile = compile_as_asked
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": dict(counters["graph_break"]), "output": output}
