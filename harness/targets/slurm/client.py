"""The Slurm client: sbatch, scontrol and scancel, and what their answers mean. Parsing is pure.

The sbatch scheduler (scheduler.py) submits the batch script (batch.py), follows the job's state,
stops and cancels it through this client; the batch step's controller requeues it at the time limit.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.targets.base import CheckFailed

CLIENT_TIMEOUT = 60.0  # slurmctld answers in milliseconds; a minute means it is gone
# Every state a job ends in; COMPLETING (processes still being ended) is not one of them.
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                      "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"})
# Pending reasons that no amount of waiting resolves: the job as asked can never start.
NEVER_STARTS = {
    "PartitionNodeLimit": "it asks for more nodes than the partition allows or has",
    "PartitionTimeLimit": "its time limit is above the partition's",
    "PartitionConfig": "it asks for more than the partition's nodes offer (CPUs, memory or GPUs per node)",
    "BadConstraints": "no node has the features its constraint asks for",
    "InvalidAccount": "the account is not valid",
    "InvalidQOS": "the QOS is not valid",
    "AccountNotAllowed": "the account may not use the partition",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than its QOS allows",
    "QOSMaxWallDurationPerJobLimit": "its time limit is above its QOS's",
    "DependencyNeverSatisfied": "a job it depends on failed",
    "launch_failed_requeued_held": "Slurm could not launch it on its nodes and held it",
}
@dataclass(frozen=True)
class SlurmJob:
    """One job as `scontrol show job` shows it."""

    job_id: int
    state: str  # PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, ...
    reason: str  # why it pends (Resources, Priority, BeginTime, ...); None when nothing holds it
    restarts: int  # requeues so far: the attempt the job is in
    nodelist: str  # compressed (n[1-2]); "(null)" before it has nodes
    exit_code: str  # the batch script's "code:signal"
    excluded: str = "(null)"  # ExcNodeList: the nodes it may not run on, compressed

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def never_starts(self) -> str | None:
        """Why a pending job will never start, or None while it may."""
        return NEVER_STARTS.get(self.reason) if self.state == "PENDING" else None


def parse_job(text: str) -> SlurmJob:
    """`scontrol show job -o ID` (one line of Key=Value words) as a SlurmJob."""
    fields = dict(word.split("=", 1) for word in text.split() if "=" in word)
    try:
        return SlurmJob(job_id=int(fields["JobId"]), state=fields["JobState"], reason=fields.get("Reason", "None"),
                        restarts=int(fields.get("Restarts", "0")), nodelist=fields.get("NodeList", "(null)"),
                        exit_code=fields.get("ExitCode", "0:0"), excluded=fields.get("ExcNodeList", "(null)"))
    except (KeyError, ValueError) as exc:
        raise HarnessError(f"cannot read scontrol's answer ({exc}): {text.strip()[:300]}") from None


@dataclass(frozen=True)
class SlurmClient:
    """Slurm's commands, run with env (the caller's environment: SLURM_CONF, PATH)."""

    env: Mapping[str, str] | None = None

    def _run(self, argv: Sequence[str], stdin: str | None = None, cwd: Path | None = None,
             environment: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """environment: variables added to the command's environment."""
        env = None if self.env is None and not environment else \
            dict(os.environ if self.env is None else self.env) | dict(environment or {})
        try:
            return subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=CLIENT_TIMEOUT,
                                  env=env, cwd=cwd, stdin=None if stdin is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise HarnessError(f"{argv[0]} not found: --target slurm runs where Slurm's commands are (a login "
                               f"node of the cluster)") from None
        except subprocess.TimeoutExpired:
            raise HarnessError(f"{argv[0]} did not answer within {CLIENT_TIMEOUT:g} s: is slurmctld up? "
                               f"(`scontrol ping`)") from None

    @staticmethod
    def _said(result: subprocess.CompletedProcess[str]) -> str:
        lines = [line.removeprefix("sbatch: error: ") for line in (result.stderr + result.stdout).splitlines()]
        return "; ".join(line.strip() for line in lines if line.strip()) or f"exit status {result.returncode}"

    def check(self, script: str) -> None:
        """sbatch --test-only: Slurm says whether this allocation can ever be granted, submitting nothing."""
        result = self._run(["sbatch", "--test-only"], stdin=script)
        if result.returncode != 0:
            raise CheckFailed(f"Slurm refuses the job: {self._said(result)} (checked with `sbatch --test-only`; "
                              f"see nnodes, resources and slurm: in the job, and `sinfo` for what the cluster has)")

    def submit(self, script: Path, cwd: Path | None = None, environment: Mapping[str, str] | None = None) -> int:
        """environment: variables added to the environment sbatch passes on to the job (its default, --export=ALL)."""
        result = self._run(["sbatch", "--parsable", str(script)], cwd=cwd, environment=environment)
        if result.returncode != 0:
            raise HarnessError(f"sbatch {script} failed: {self._said(result)}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> SlurmJob:
        result = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        if result.returncode != 0:
            raise HarnessError(f"scontrol show job {job_id} failed: {self._said(result)}")
        return parse_job(result.stdout)

    def hostnames(self, nodelist: str) -> list[str]:
        result = self._run(["scontrol", "show", "hostnames", nodelist])
        if result.returncode != 0:
            raise HarnessError(f"scontrol show hostnames {nodelist} failed: {self._said(result)}")
        return result.stdout.split()

    def node_addresses(self, names: Sequence[str]) -> dict[str, str]:
        """Each node's NodeAddr: the address Slurm itself reaches it at (often the name itself)."""
        result = self._run(["sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N %o"])
        if result.returncode != 0:
            raise HarnessError(f"sinfo -n {','.join(names)} failed: {self._said(result)}")
        return dict(line.split(None, 1) for line in result.stdout.splitlines() if len(line.split()) == 2)

    def cancel(self, job_id: int) -> None:
        result = self._run(["scancel", str(job_id)])
        if result.returncode != 0:
            raise HarnessError(f"scancel {job_id} failed: {self._said(result)}")

    def signal_batch(self, job_id: int, name: str) -> None:
        """The signal to the job's batch step alone (its script and what it started), not to the other steps."""
        result = self._run(["scancel", "--batch", f"--signal={name}", str(job_id)])
        if result.returncode != 0:
            raise HarnessError(f"scancel --batch --signal={name} {job_id} failed: {self._said(result)}")

    def requeue(self, job_id: int, exclude: Sequence[str] = ()) -> None:
        """The job runs again on a new allocation; without the nodes of exclude (added to its ExcNodeList while
        the requeued job is held, so that it cannot be scheduled before)."""
        if exclude:
            excluded = self.job(job_id).excluded
            exclude = sorted({*exclude, *(self.hostnames(excluded) if excluded != "(null)" else [])})
        steps = [["scontrol", "requeuehold", str(job_id)],
                 ["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(exclude)}"],
                 ["scontrol", "release", str(job_id)]] if exclude else [["scontrol", "requeue", str(job_id)]]
        for argv in steps:
            result = self._run(argv)
            if result.returncode != 0:
                raise HarnessError(f"{' '.join(argv)} failed: {self._said(result)}")
