"""harness: one job spec and a host inventory become a supervised multi-node torchrun job.

From Python (docs/python.md): harness.launch(job_or_script_or_function, ...) -> Run; harness.run(id), harness.runs();
harness.load_job(path) -> Job. Imported on first use, so that `import harness` (and every node-side module) stays
cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.api.handle import RankError, Run, RunFailed, Status, run, runs
    from harness.api.launching import launch
    from harness.errors import HarnessError, SpecError
    from harness.spec.job import JobSpec as Job
    from harness.spec.job import load_job

__version__ = "0.1.0"
__all__ = ["HarnessError", "Job", "RankError", "Run", "RunFailed", "SpecError", "Status", "launch", "load_job", "run",
           "runs"]
_WHERE = {"HarnessError": "harness.errors", "SpecError": "harness.errors", "Job": "harness.spec.job",
          "load_job": "harness.spec.job", "launch": "harness.api.launching"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_WHERE.get(name, "harness.api.handle"))
    return getattr(module, "JobSpec" if name == "Job" else name)
