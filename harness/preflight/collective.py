"""`--collective`: a short all_reduce with the job's backend, through torchrun on every host.

The argv and env come from plan_hosts, exactly as a launch would build them, with the entrypoint
swapped for harness.preflight.allreduce; the agents run over the hosts' existing SSH connections.
A hard deadline bounds it; on timeout or on the first failing node every node's process tree is
stopped, so nothing is left running.
"""

from __future__ import annotations

import time
import uuid

from harness.inventory import Inventory
from harness.plan import Plan, plan_hosts
from harness.preflight.remote import MARKER, TORCH_TIMEOUT_FACTOR, answer_in, on_hosts
from harness.preflight.report import Check, Status
from harness.spec import Entrypoint, JobSpec
from harness.render import remote_command
from harness.ssh import Connection, RemoteProcess

MODULE = "harness.preflight.allreduce"
STOP_GRACE = 3.0


def collective_plan(spec: JobSpec | None, inventory: Inventory, master_ip: str, seconds: float) -> Plan:
    """The launch plan of the job (or a 1-process-per-host gloo/nccl default) running the all_reduce."""
    base = spec or JobSpec.model_validate({"name": "preflight", "nnodes": len(inventory.hosts),
                                           "entrypoint": {"module": MODULE}})
    entrypoint = Entrypoint(module=MODULE, args=[f"--marker={MARKER}", f"--timeout={seconds:g}"])
    job = base.model_copy(update={"entrypoint": entrypoint, "max_restarts": 0})
    return plan_hosts(job, inventory, run_id=f"preflight-{uuid.uuid4().hex[:8]}", master_ip=master_ip)


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line]
    return (errors or lines or ["no output"])[-1][:300]


def _stop(process: RemoteProcess) -> None:
    if process.poll() is None:
        process.terminate(STOP_GRACE)
    process.close()


def _run(processes: dict[str, RemoteProcess], deadline: float) -> tuple[dict[str, int], str | None]:
    """Exit statuses of the nodes that ended; stops everyone at the first failure or at the deadline."""
    statuses: dict[str, int] = {}
    while len(statuses) < len(processes) and time.monotonic() < deadline:
        for host, process in processes.items():
            if host not in statuses and (status := process.poll()) is not None:
                statuses[host] = status
        if any(statuses.values()):
            break
        time.sleep(0.1)
    first_failure = next((h for h, s in statuses.items() if s), None)
    return statuses, first_failure


def collective_checks(connections: dict[str, Connection], inventory: Inventory, spec: JobSpec | None,
                      master_ip: str, *, timeout: float) -> list[Check]:
    hard = timeout * TORCH_TIMEOUT_FACTOR
    plan = collective_plan(spec, inventory, master_ip, hard - 5)
    processes: dict[str, RemoteProcess] = {}
    try:
        for node in plan.nodes:
            command = remote_command(node.argv, env=node.env, workdir=node.workdir)
            processes[node.host] = connections[node.host].start(command, timeout=timeout)
            processes[node.host].close_stdin()
        statuses, culprit = _run(processes, time.monotonic() + hard)
        outputs = {host: process.take_output() for host, process in processes.items()}
    finally:
        on_hosts(lambda host: _stop(processes[host]), list(processes))
    master = plan.nodes[0].host
    answer = answer_in(outputs[master][0] + outputs[master][1]) if master in outputs else None
    checks = []
    for node in plan.nodes:
        host = node.host
        stdout, stderr = outputs.get(host, ("", ""))
        if host not in statuses:
            why = (f"stopped after {culprit} failed" if culprit
                   else f"all_reduce did not finish within {hard:g}s; stopped")
            checks.append(Check(host, "collective", Status.SKIP if culprit else Status.FAIL, why,
                                None if culprit else "check the data_plane rows and the job's backend settings",
                                {"output_tail": (stdout + stderr).splitlines()[-5:]}))
        elif statuses[host]:
            checks.append(Check(host, "collective", Status.FAIL,
                                f"node {node.node_rank} exited {statuses[host]}: {_last_error(stderr + stdout)}",
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
