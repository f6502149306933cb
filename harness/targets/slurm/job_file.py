"""job.json in a run's directory: the job as `harness launch --target slurm` hands it to the controller in
the batch step (`harness batch-step RUN_DIR`, started by batch.controller_script): the spec with every
flag applied, and the version of the harness that made it, which the nodes must import too.

It holds no value of an env name that looks secret (spec/secrets.py): each travels as a `secrets:` value from the
environment does, in the job's environment, which sbatch passes on (job_environment); the batch step reads it there
and takes it out of its own environment, which srun would pass on to every step."""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from pathlib import Path

from harness import __version__
from harness.errors import HarnessError
from harness.spec.job import JobSpec
from harness.spec.secrets import env_apart

ENV_VARIABLE = "HARNESS_SLURM_ENV_{name}"  # where the job's environment carries env.NAME's value


def job_json(spec: JobSpec) -> str:
    data = spec.model_dump(mode="json", exclude_unset=True, warnings=False)
    plain, secret_looking = env_apart(spec.env)
    if secret_looking:
        data["env"] = plain
    return json.dumps({"harness": __version__, "spec": data, "env_from_environment": list(secret_looking)},
                      indent=2) + "\n"


def job_environment(spec: JobSpec) -> dict[str, str]:
    """The variables sbatch is to hand the job: the values of the env names that look secret."""
    return {ENV_VARIABLE.format(name=name): value for name, value in env_apart(spec.env)[1].items()}


def read_job(path: Path, environ: MutableMapping[str, str] = os.environ) -> JobSpec:
    """The job, with the values job_environment handed on taken out of environ."""
    job = json.loads(path.read_text())
    if job.get("harness") != __version__:
        raise HarnessError(f"the job was submitted by harness {job.get('harness')}, and {Path(__file__).parents[2]} "
                           f"here is harness {__version__}: install the same harness for the login node and the nodes")
    names = job.get("env_from_environment", [])
    if missing := [name for name in names if ENV_VARIABLE.format(name=name) not in environ]:
        raise HarnessError(f"the job's environment lacks {', '.join(ENV_VARIABLE.format(name=n) for n in missing)}: "
                           f"the values of env names that look secret travel there, not in {path.name}; does the "
                           f"job's slurm.extra (or SBATCH_EXPORT) keep sbatch from passing its environment on?")
    spec = job["spec"]
    spec["env"] = spec.get("env", {}) | {name: environ.pop(ENV_VARIABLE.format(name=name)) for name in names}
    return JobSpec.model_validate(spec)
