"""The Slurm tests' job, tests/scripts/ddp_sum.py on 2 nodes, for both tiers: tests/unit/test_slurm_batch.py
(the script rendered) and tests/integration/test_slurm.py (run on a real cluster, on torch or on the stand-in)."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import REPO, SCRIPT, STANDIN_ENV, free_port

JOB = """
name: sum
nnodes: 2
backend: gloo
master_port: {port}
entrypoint:
  script: {script}
  args: [--tag, "two words", "it's", "$HOME", "${{local_rank}}", "a\\"b"]
env:
{env}
resources: {{cpu: "1", memory: 1536Mi}}
slurm: {{python: {python}, workdir: {workdir}, time: "00:10:00"{extra}}}
"""


def sum_job(write_yaml, extra: str = "", workdir: Path = REPO, tail: str = "", port: int | str | None = None,
            standin: bool = False, **env: str) -> str:
    """port: a free one by default; auto: picked on the master node (the batch script's, or a step's). standin: on
    the stand-in torch (conftest.STANDIN_ENV; the Slurm nodes share this machine's filesystem)."""
    env = (STANDIN_ENV if standin else {}) | env
    lines = "".join(f"  {k}: '{v}'\n" for k, v in env.items()) or "  {}\n"
    text = JOB.format(port=port or free_port(), script=SCRIPT, env=lines.rstrip("\n"), python=sys.executable, workdir=workdir,
                      extra=extra)
    return str(write_yaml(text.replace("env:\n  {}", "env: {}") + tail))
