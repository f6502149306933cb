"""POSIX shell lines for a command, its environment and working directory. Pure.

The SSH layer runs these lines on hosts, the node agent runs a node's line, and the renderer shows
them: one quoting rule for all, so what `harness render` prints is exactly what runs.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from harness.plan.planner import NodePlan
from harness.plan.setup_script import with_setup


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
    """One POSIX shell line that runs the node exactly as planned (its setup first); every word is quoted."""
    return remote_command(with_setup(node.argv, node.setup), env=node.env, workdir=node.workdir)
