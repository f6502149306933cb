"""Plan -> what a human reads (text) or a tool consumes (JSON). Pure; the SSH backend runs shell_command."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence

from harness.plan import NodePlan, Plan


def _shell_word(text: str) -> str:
    """Quote for a POSIX shell, but let a leading `~/` expand the way users expect on the remote."""
    if text.startswith("~/"):
        return "~/" + shlex.quote(text[2:])
    return shlex.quote(text)


def remote_command(argv: Sequence[str], *, env: Mapping[str, str] | None = None, workdir: str | None = None) -> str:
    """One shell line that runs argv in workdir with env, exec'd so the remote pid is argv's own."""
    words = [_shell_word(argv[0])] + [shlex.quote(a) for a in argv[1:]]
    if env:
        words = ["env"] + [shlex.quote(f"{k}={v}") for k, v in env.items()] + words
    line = "exec " + " ".join(words)
    return f"cd -- {_shell_word(workdir)} && {line}" if workdir else line


def shell_command(node: NodePlan) -> str:
    """One POSIX shell line that runs the node exactly as planned; every word is quoted."""
    return remote_command(node.argv, env=node.env, workdir=node.workdir)


def render_text(plan: Plan) -> str:
    lines = [
        f"# job {plan.name}: {plan.nnodes} node(s) x {plan.nproc_per_node} process(es) = world size "
        f"{plan.world_size}; master {plan.master_addr}:{plan.master_port}; run id {plan.run_id}"
    ]
    for node in plan.nodes:
        ranks = f"{node.ranks.start}-{node.ranks.stop - 1}" if node.nproc > 1 else str(node.ranks.start)
        lines += ["", f"# {node.label} on {node.host} ({node.address}): node_rank {node.node_rank}, global ranks {ranks}",
                  shell_command(node)]
        if node.cleanup:
            lines.append(f"# after a forced stop: {shlex.join(node.cleanup)}")
    return "\n".join(lines) + "\n"


def render_json(plan: Plan) -> str:
    return json.dumps(plan.to_json(), indent=2) + "\n"
