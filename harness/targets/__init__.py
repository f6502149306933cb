"""Backends: where a planned job runs. One interface (base.py), one node agent (node_agent.py).

- local.py: simulated nodes on this machine;
- ssh.py: one node per inventory host over SSH, optionally inside the job's image (container.py);
- node_agent.py: the program every node runs under, on every backend (stdlib only);
- agent_link.py: the controller's end of the agent's protocol.

Nothing here imports the CLI or the supervisor: the run controller (harness.run.controller) drives a
backend, not the other way round. See docs/architecture.md.
"""

from harness.targets.base import Backend, CheckFailed, NodeProcess, Outcome

__all__ = ["Backend", "CheckFailed", "NodeProcess", "Outcome"]
