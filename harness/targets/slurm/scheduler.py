"""`harness launch --target slurm` outside an allocation: the job submitted with sbatch, Slurm owning
its processes (it outlives this terminal, requeues itself, runs without the harness).

The run controller follows it through this Scheduler: `sbatch --test-only` says before anything is
submitted whether the job can ever start; `scontrol show job` its state (pending with the reason ->
running on which nodes -> requeued -> ended); srun writes every node's output into the run directory
(shared storage, as a Slurm submit directory is) under the run record's names, and its own report
of the tasks that failed into the batch log; a requeue is the next attempt (HARNESS_ATTEMPT =
SLURM_RESTART_COUNT); `scancel` ends it.
"""

from __future__ import annotations

from pathlib import Path

from harness.plan.planner import resolve_nproc
from harness.spec.job import JobSpec
from harness.targets.base import JobStatus, Outcome, Submission
from harness.targets.slurm.batch import batch_log, batch_script
from harness.targets.slurm.client import SlurmClient, task_outcomes

# States in which every task that srun did not report as failed ended well.
_TASKS_REPORTED = ("COMPLETED", "FAILED")


class SbatchScheduler:
    """Slurm as a scheduler-owned target: the batch script of harness.targets.slurm.batch, submitted."""

    name = "slurm"

    def __init__(self, client: SlurmClient | None = None) -> None:
        self.client = client or SlurmClient()
        self._hosts: dict[str, tuple[str, ...]] = {}  # nodelist -> names: asked once per allocation

    def prepare(self, spec: JobSpec, source: str, run_id: str, run_path: Path) -> Submission:
        nproc = resolve_nproc(spec, [spec.resources.gpus] * spec.nnodes, ["each node (resources.gpus)"] * spec.nnodes)
        script = batch_script(spec, source, run_id=run_id, log_dir=run_path.resolve())
        self.client.check(script)
        return Submission(text=script, file_name="job.sbatch", nnodes=spec.nnodes, world_size=spec.nnodes * nproc)

    def submit(self, submission: Submission, path: Path) -> str:
        return str(self.client.submit(path))

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

    def node_outcomes(self, own_lines: list[str], ended: JobStatus | None) -> tuple[dict[int, Outcome], Outcome]:
        """srun reports the tasks that did not succeed, the first failure first; an unreported one
        succeeded, unless Slurm ended the job (or requeued it) around it."""
        state = ended.state if ended is not None else "REQUEUED"
        rest = Outcome(exit_code=0) if state in _TASKS_REPORTED else \
            Outcome(exit_code=None, error=f"ended with the job ({state})")
        return task_outcomes(own_lines), rest

    def cancel(self, job_id: str) -> None:
        self.client.cancel(int(job_id))
