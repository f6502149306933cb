"""`harness launch --target slurm` outside an allocation: the job submitted with sbatch, its batch step
running the harness's controller in the allocation (`harness batch-step`, on the srun target), Slurm owning its
processes (it outlives this terminal and requeues itself).

The user's controller follows it through this Scheduler: `sbatch --test-only` says before anything is
submitted whether the job can ever start; `scontrol show job` its state (pending with the reason ->
running on which nodes -> requeued -> ended); the batch step's own output goes to the run directory
(shared storage, as a Slurm submit directory is), beside the record that its controller writes;
`scancel` ends the job, and `scancel --batch --signal=TERM` asks its controller to stop.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from harness.plan.planner import resolve_nproc
from harness.spec.job import JobSpec
from harness.targets.base import JobStatus, Submission
from harness.targets.slurm.batch import batch_log, controller_script
from harness.targets.slurm.client import SlurmClient
from harness.targets.slurm.job_file import job_environment, job_json


class SbatchScheduler:
    """Slurm as a scheduler-owned target: the batch script of batch.controller_script, submitted."""

    name = "slurm"

    def __init__(self, client: SlurmClient | None = None, kept_out: Mapping[str, str] | None = None) -> None:
        """kept_out: the nodes that failed and are kept out (node -> what to say of it), which the job excludes."""
        self.client = client or SlurmClient()
        self.kept_out = dict(kept_out or {})
        self._hosts: dict[str, tuple[str, ...]] = {}  # nodelist -> names: asked once per allocation

    def prepare(self, spec: JobSpec, source: str, run_id: str, run_path: Path) -> Submission:
        nproc = resolve_nproc(spec, [spec.resources.gpus] * spec.nnodes, ["each node (resources.gpus)"] * spec.nnodes)
        script = controller_script(spec, source, run_path.resolve(), sys.executable, exclude=list(self.kept_out))
        self.client.check(script)
        return Submission(text=script, file_name="job.sbatch", nnodes=spec.nnodes, world_size=spec.nnodes * nproc,
                          others={"job.json": job_json(spec)}, environment=job_environment(spec),
                          notes=tuple(f"{said} (sbatch --exclude)" for said in self.kept_out.values()))

    def submit(self, submission: Submission, path: Path) -> str:
        return str(self.client.submit(path, environment=submission.environment))

    def describe(self, job_id: str) -> JobStatus:
        job = self.client.job(int(job_id))
        hosts: tuple[str, ...] = ()
        # A short job may start and end between two looks: its nodes are still on record.
        if (job.state == "RUNNING" or job.finished) and job.nodelist not in ("", "(null)"):
            if job.nodelist not in self._hosts:
                self._hosts[job.nodelist] = tuple(self.client.hostnames(job.nodelist))
            hosts = self._hosts[job.nodelist]
        return JobStatus(state=job.state, reason=None if job.reason == "None" else job.reason, attempt=job.restarts,
                         hosts=hosts, where=job.nodelist if hosts else "", finished=job.finished,
                         succeeded=job.state == "COMPLETED", never_starts=job.never_starts, exit_code=job.exit_code)

    def own_log(self, run_path: Path, job_id: str) -> Path:
        return batch_log(run_path, int(job_id))

    def cancel(self, job_id: str) -> None:
        self.client.cancel(int(job_id))

    def stop(self, job_id: str) -> None:
        self.client.signal_batch(int(job_id), "TERM")
