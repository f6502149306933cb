"""Plan -> what a human reads (text) or a tool consumes (JSON). Pure; the SSH backend runs shell_command."""

from __future__ import annotations

import json
import shlex

from harness.plan import NodePlan, Plan


def shell_command(node: NodePlan) -> str:
    """One POSIX shell line that runs the node exactly as planned; every word is quoted."""
    env = " ".join(shlex.quote(f"{key}={value}") for key, value in sorted(node.env.items()))
    command = f"exec env {env} {shlex.join(node.argv)}"
    return f"cd {shlex.quote(node.workdir)} && {command}" if node.workdir else command


def render_text(plan: Plan) -> str:
    lines = [
        f"# job {plan.name}: {plan.nnodes} node(s) x {plan.nproc_per_node} process(es) = world size "
        f"{plan.world_size}; master {plan.master_addr}:{plan.master_port}; run id {plan.run_id}"
    ]
    for node in plan.nodes:
        ranks = f"{node.ranks.start}-{node.ranks.stop - 1}" if node.nproc > 1 else str(node.ranks.start)
        lines += ["", f"# {node.label} on {node.host} ({node.address}): node_rank {node.node_rank}, global ranks {ranks}",
                  shell_command(node)]
    return "\n".join(lines) + "\n"


def render_json(plan: Plan) -> str:
    return json.dumps(plan.to_json(), indent=2) + "\n"
