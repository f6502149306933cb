"""The job's `setup:` commands as one POSIX shell script that runs on every node before torchrun. Pure.

Every backend runs a node as `/bin/sh -c SCRIPT harness-setup ARGV...` (see with_setup): the script
runs the commands in the node's working directory with the node's env, then execs ARGV, so torchrun
stays the process the backend signals. The commands run once per working directory, not once per
node: under an flock on `.harness/setup.lock`, the first node does the work and records a marker
named by the commands' hash; nodes that share the directory (simulated nodes, shared storage) wait
on the lock and find the marker. A failure leaves no marker, so the next launch tries again.

A node the agent supervises also gets RANK_HOOK_LINE first: the agent's private directory (its rank
hook, harness.node.rank_hook) goes first on PYTHONPATH, after the node's env is set, so a PYTHONPATH of
the job's or of the host's is kept behind it.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Sequence

SETUP_DIR = ".harness"
FAILED = "harness setup failed:"  # how the script's failures begin (recovery.py reads it in a node's tail)
ARGV0 = "harness-setup"  # $0 of the script: what ps and the shell's own error messages show
RANK_HOOK_LINE = ('case "${HARNESS_AGENT_DIR:-}" in ?*) PYTHONPATH="$HARNESS_AGENT_DIR${PYTHONPATH:+:$PYTHONPATH}"; '
                  'export PYTHONPATH ;; esac')


def setup_id(commands: Sequence[str]) -> str:
    """Changing the commands changes the marker, so edited setup runs again."""
    return hashlib.sha256("\n".join(commands).encode()).hexdigest()[:12]


def setup_script(commands: Sequence[str], data_paths: Sequence[str] = (), *, rank_hook: bool = False) -> str | None:
    """None without commands (or the rank hook). The job's Python (the exec'd argv[0], "$1") comes first on
    PATH, so a command's `python` or `harness` is the one torchrun runs with; data_paths must exist afterwards."""
    hook = [RANK_HOOK_LINE] if rank_hook else []
    if not commands:
        return "\n".join([*hook, 'exec "$@"']) if hook else None
    marker = f"{SETUP_DIR}/setup-{setup_id(commands)}"
    run = " && ".join(f"/bin/sh -c {shlex.quote(command)}" for command in commands)
    paths = " ".join(shlex.quote(path) for path in data_paths)
    lines = [
        *hook,
        f"mkdir -p {SETUP_DIR} && (",
        "  flock 9 || exit",
        f'  if [ -e {marker}.done ]; then echo "harness setup: done before in $PWD ({marker}.done)"; exit 0; fi',
        '  case "$1" in */*) PATH="${1%/*}:$PATH"; export PATH ;; esac',
        f'  echo "harness setup: running {len(commands)} command(s) in $PWD, log {marker}.log"',
        f"  {{ {run}; echo $? >{marker}.rc; }} 2>&1 | tee {marker}.log",
        f"  rc=1; read -r rc 2>/dev/null <{marker}.rc",
        '  if [ "$rc" != 0 ]; then',
        f'    echo "{FAILED} exit $rc; torchrun was not started here. Its log: $PWD/{marker}.log" >&2',
        '    exit "$rc"',
        "  fi",
    ]
    if data_paths:
        lines += [
            f"  for path in {paths}; do",
            f'    [ -e "$path" ] || {{ echo "{FAILED} the commands succeeded but data path $path is still '
            'missing in $PWD" >&2; exit 1; }',
            "  done",
        ]
    lines += [f"  touch {marker}.done", f") 9>>{SETUP_DIR}/setup.lock || exit", 'exec "$@"']
    return "\n".join(lines)


def with_setup(argv: Sequence[str], script: str | None) -> list[str]:
    """argv itself, or argv exec'd by the setup script once the setup is done."""
    return list(argv) if script is None else ["/bin/sh", "-c", script, ARGV0, *argv]
