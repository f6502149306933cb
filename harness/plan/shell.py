"""POSIX shell lines for a command, its environment and working directory. Pure.

The SSH layer runs these lines on hosts, the node agent runs a node's line, and the renderer shows
them: one quoting rule for all, so what `harness render` prints is exactly what runs.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence

from harness.plan.planner import TORCHRUN_MODULE, NodePlan
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
    return remote_command(with_setup((*node.enter, *node.argv), node.setup), env=node.env, workdir=node.workdir)


# A standby's command: harness.node.standby, which its agent installs in its private directory (docs/recovery.md).
STANDBY_CODE = ("import os,runpy;runpy.run_path(os.path.join(os.environ['HARNESS_AGENT_DIR'],'standby.py'),"
                "run_name='__main__')")


def why_cold(node: NodePlan) -> str:
    """Why the node can have no standby ("": it can): its command is torchrun under the node's Python, not in a
    container, whose engine starts it."""
    if node.cleanup:
        return "it runs in a container, whose engine starts its torchrun"
    if node.argv[1:3] != ("-m", TORCHRUN_MODULE):
        return "its command is not torchrun under the node's Python"
    return ""


def standby_command(node: NodePlan) -> str:
    """The node's line with torchrun waiting for its order (standby_order) instead of running: same
    directory, setup, interpreter and environment, so the imports it does early are the ones it would do."""
    return remote_command(with_setup((*node.enter, node.argv[0], "-c", STANDBY_CODE), node.setup), env=node.env,
                          workdir=node.workdir)


def standby_order(standby: NodePlan, node: NodePlan) -> str:
    """What turns a standby started as `standby` into `node`: torchrun's arguments and the node's environment
    (the standby's keys that node lacks removed). One line of JSON."""
    order = {"args": list(node.argv[3:]), "env": node.env, "unset": sorted(standby.env.keys() - node.env.keys())}
    return json.dumps(order, separators=(",", ":"))
