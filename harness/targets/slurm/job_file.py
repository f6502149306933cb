"""job.json in a run's directory: the job as `harness launch --target slurm` hands it to the controller in
the batch step (`harness batch-step RUN_DIR`, started by batch.controller_script): the spec with every
flag applied, and the version of the harness that made it, which the nodes must import too."""

from __future__ import annotations

import json
from pathlib import Path

from harness import __version__
from harness.errors import HarnessError
from harness.spec.job import JobSpec


def job_json(spec: JobSpec) -> str:
    return json.dumps({"harness": __version__, "spec": spec.model_dump(mode="json", exclude_unset=True,
                                                                       warnings=False)}, indent=2) + "\n"


def read_job(path: Path) -> JobSpec:
    job = json.loads(path.read_text())
    if job.get("harness") != __version__:
        raise HarnessError(f"the job was submitted by harness {job.get('harness')}, and {Path(__file__).parents[2]} "
                           f"here is harness {__version__}: install the same harness for the login node and the nodes")
    return JobSpec.model_validate(job["spec"])
