"""A rendezvous that did not complete within timeouts.rendezvous, whatever its kind (torchrun's static rendezvous
waits torch's own 600 s and more; c10d's join timeout starts only once torchrun is up): which nodes never started
their ranks, and where each one's torchrun is, from its stack (harness.node.protocol.LAUNCHER_RANK). A node
whose torchrun waits in the rendezvous is waiting for the others; one stopped, in an import or anywhere else is
the one they wait for: its host is at fault. Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.health.rank_stack import RankStack, short_path, state_words
from harness.plan.planner import Node

RENDEZVOUS = re.compile(r"torch/distributed/elastic/rendezvous/|torch/distributed/elastic/utils/store")
IMPORTING = re.compile(r"<frozen importlib\._bootstrap")
TORCHRUN = re.compile(r"torch\.distributed\.run|torchrun|standby\.py")  # a standby (plan/shell.py) is torchrun


@dataclass(frozen=True)
class RendezvousVerdict:
    """text: what happened, one line; late: the node ranks whose ranks never started; culprits: those of them
    whose torchrun is not waiting in the rendezvous (all of them where every one waits: none can be told apart)."""

    text: str
    late: list[int]
    culprits: list[int]


def rendezvous_verdict(timeout: float, late: list[Node], launchers: dict[int, RankStack], joined: int) -> \
        RendezvousVerdict:
    """late: the nodes whose ranks never started; launchers: where each one's torchrun is, by node rank (a node
    missing there did not answer); joined: how many nodes did start their ranks."""
    waiting = {node.node_rank for node in late if (stack := launchers.get(node.node_rank)) and _in_rendezvous(stack)}
    culprits = [node for node in late if node.node_rank not in waiting] or late
    said = "; ".join(f"{node.label} on {node.host} {launcher_words(launchers.get(node.node_rank))}"
                     for node in culprits)
    others = [node for node in late if node not in culprits]
    text = (f"the rendezvous did not complete within {timeout:g} s (timeouts.rendezvous): {said}"
            + (f"; {', '.join(n.label for n in others)} waiting for it in the rendezvous" if others else "")
            + (f"; {joined} node(s) started their ranks" if joined else ""))
    return RendezvousVerdict(text, sorted(node.node_rank for node in late), sorted(node.node_rank for node in culprits))


def launcher_words(stack: RankStack | None) -> str:
    """`never joined: its torchrun (pid 4711) is stopped (SIGSTOP), in an import at torch/nn/__init__.py:3`."""
    if stack is None:
        return "never joined, and its node agent did not say where its torchrun is"
    command = stack.command or ""
    what = "its torchrun" if TORCHRUN.search(command) else f"its command `{command[:80]}`" if command else \
        "its command"
    return f"never joined: {what} (pid {stack.pid}) is {state_words(stack.state)}, {_where(stack)}"


def _in_rendezvous(stack: RankStack) -> bool:
    return any(RENDEZVOUS.search(frame.file) for frame in stack.main_frames())


def _where(stack: RankStack) -> str:
    """Where a launcher's main thread is: in the rendezvous, in an import (the module being run), or at its
    innermost frame."""
    frames = stack.main_frames()
    if not frames:
        return f"its stack unknown ({stack.error or 'no stack'})"
    if _in_rendezvous(stack):
        frame = next(f for f in frames if RENDEZVOUS.search(f.file))
        return f"waiting in the rendezvous at {short_path(frame.file)}:{frame.line} in {frame.name}"
    if any(IMPORTING.search(frame.file) for frame in frames):  # at the module being imported, the innermost
        ours = [f for f in frames if not IMPORTING.search(f.file)] or frames
        module = next((f for f in ours if f.name == "<module>"), ours[0])
        return f"in an import at {short_path(module.file)}:{module.line}"
    return f"at {short_path(frames[0].file)}:{frames[0].line} in {frames[0].name}"
