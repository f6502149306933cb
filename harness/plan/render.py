"""Plan -> what a human reads (text) or a tool consumes (JSON). Pure. Neither holds a secret: values of env names
that look like one are masked, and a secret's value is no part of a plan (spec/secrets.py)."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from typing import cast

from harness.plan.planner import NodePlan, Plan
from harness.plan.shell import shell_command
from harness.spec.secrets import shown_env


def _interface(plan: Plan, node: NodePlan) -> str:
    if node.interface is not None:
        return f"; gloo and NCCL on {node.interface}"
    if node.ssh is not None and plan.nnodes > 1:
        return "; gloo and NCCL on the interface that routes to the peers (found by preflight at launch)"
    return ""


def render_text(plan: Plan) -> str:
    lines = [
        f"# job {plan.name}: {plan.nnodes} node(s) x {plan.nproc_per_node} process(es) = world size "
        f"{plan.world_size}; master {plan.master_addr}:{plan.master_port}; run id {plan.run_id}"
    ]
    for node in plan.nodes:
        ranks = f"{node.ranks.start}-{node.ranks.stop - 1}" if node.nproc > 1 else str(node.ranks.start)
        where = f"{node.host} ({node.address})"
        heading = f"# {node.label} on {where}: node_rank {node.node_rank}, global ranks {ranks}"
        lines += ["", heading + _interface(plan, node)]
        if node.secrets:
            lines.append(f"# secrets, their values from the launch and never written: {', '.join(node.secrets)}")
        lines.append(shell_command(replace(node, env=shown_env(node.env))))
        if node.cleanup:
            lines.append(f"# after a forced stop: {shlex.join(node.cleanup)}")
    return "\n".join(lines) + "\n"


def render_json(plan: Plan) -> str:
    shown = plan.to_json()
    for node, planned in zip(cast(list[dict[str, object]], shown["nodes"]), plan.nodes, strict=True):
        node["env"] = shown_env(planned.env)
    return json.dumps(shown, indent=2) + "\n"
