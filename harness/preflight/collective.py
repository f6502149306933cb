"""`--collective`: a short all_reduce with the job's backend, through torchrun on every host.

It is launched exactly as the job would be: the SSH backend plans it from the job (its entrypoint
swapped for harness.node.allreduce), starts every node under the node agent over preflight's
own connections, and the supervisor stops every node at the first failure or at the deadline, so
nothing is left running.
"""

from __future__ import annotations

import io
import threading
import uuid
from collections.abc import Mapping

from harness.control.supervisor import Supervisor
from harness.control.terminal import Terminal
from harness.plan.planner import Plan, job_hosts
from harness.preflight.remote import MARKER, TORCH_TIMEOUT_FACTOR, answer_in
from harness.preflight.table import Check, Status
from harness.spec.inventory import Inventory
from harness.spec.job import Entrypoint, JobSpec
from harness.targets.ssh.backend import SSHBackend
from harness.targets.ssh.transport import Connection

MODULE = "harness.node.allreduce"


def collective_job(spec: JobSpec | None, inventory: Inventory, seconds: float) -> JobSpec:
    """The job (or a 1-process-per-host default) with the all_reduce as its entrypoint."""
    base = spec or JobSpec.model_validate({"name": "preflight", "nnodes": len(inventory.hosts),
                                           "entrypoint": {"module": MODULE}})
    entrypoint = Entrypoint(module=MODULE, args=[f"--marker={MARKER}", f"--timeout={seconds:g}"])
    return base.model_copy(update={"entrypoint": entrypoint})


def _last_error(lines: list[str]) -> str:
    lines = [line.strip() for line in lines if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:300]


def _supervise(backend: SSHBackend, plan: Plan, job: JobSpec, seconds: float) -> tuple[Supervisor, bool]:
    """Run the plan's nodes to their end, as a launch does; stop them all at the deadline.
    Returns the supervisor (its nodes, the first failure) and whether the deadline was reached."""
    deadline = threading.Event()
    timer = threading.Timer(seconds, deadline.set)
    terminal = Terminal(io.StringIO())  # the checks' report says what matters
    sup = Supervisor(grace=job.timeouts.stop_grace, terminal=terminal)
    timer.start()
    try:
        sup.start(backend.start(plan, job))
        sup.wait(deadline)
    finally:
        timer.cancel()
        sup.finish()
        backend.close()
        terminal.close()
    return sup, deadline.is_set()


def collective_checks(connections: dict[str, Connection], inventory: Inventory, spec: JobSpec | None,
                      *, timeout: float, interfaces: Mapping[str, str]) -> list[Check]:
    """The all_reduce on every host, under the node agent and the supervisor like every launch, on the
    interfaces the launch would pin (interfaces: host name -> interface)."""
    hard = timeout * TORCH_TIMEOUT_FACTOR
    job = collective_job(spec, inventory, hard - 5)
    backend = SSHBackend(inventory, connections=connections)
    plan = backend.pinned_plan(job, f"preflight-{uuid.uuid4().hex[:8]}", job_hosts(job, inventory), 0, interfaces)
    sup, timed_out = _supervise(backend, plan, job, hard)
    culprit = sup.first_failure
    master = next(r for r in sup.nodes if r.node.node_rank == 0)
    answer = next((a for line in master.tail if (a := answer_in(line)) is not None), None)
    checks = []
    for record in sup.nodes:
        host, outcome = record.node.host, record.outcome
        if culprit is not None and record is not culprit and not (outcome and outcome.ok):
            checks.append(Check(host, "collective", Status.SKIP, f"stopped after {culprit.node.host} failed"))
        elif timed_out and culprit is None and not (outcome and outcome.ok):
            checks.append(Check(host, "collective", Status.FAIL, f"all_reduce did not finish within {hard:g}s; stopped",
                                "check the data_plane rows and the job's backend settings",
                                {"output_tail": list(record.tail)[-5:]}))
        elif outcome is None or not outcome.ok:
            what = outcome.describe() if outcome else "no end"
            checks.append(Check(host, "collective", Status.FAIL,
                                f"node {record.node.node_rank} {what}: {_last_error(list(record.tail))}",
                                "fix the error above; NCCL_DEBUG=INFO in the job's env tells more for nccl"))
        elif answer is None or not answer["verified"]:
            checks.append(Check(host, "collective", Status.FAIL,
                                "all_reduce ran but its result was wrong" if answer else "all_reduce gave no result",
                                "check the GPUs and the network cards (a wrong sum means corrupted data)",
                                answer or {}))
        else:
            checks.append(Check(host, "collective", Status.PASS, (
                f"all_reduce of {answer['bytes'] >> 20} MiB over {answer['world']} ranks ({answer['backend']}) "
                f"verified: busbw {answer['busbw_gbps']:.2f} GB/s, algbw {answer['algbw_gbps']:.2f} GB/s, "
                f"{answer['seconds'] * 1000:.1f} ms"), None, answer))
    return checks
