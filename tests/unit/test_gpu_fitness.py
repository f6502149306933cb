"""Whether a GPU host is fit for an attempt, from the driver's own answers (NVML: its recovery action, row
remapping, uncorrectable ECC errors) as the probe reports them: decided here on recorded answers; read for real
on a GPU machine by tests/gpu/test_gpu_fitness.py."""

from __future__ import annotations

from typing import Any

import pytest

from harness.node.gpu import GpuHealth, device_health
from harness.preflight.checks import resource_checks
from harness.preflight.table import Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec

HOST = Host(name="gpu-01", address="10.0.0.1")
JOB = JobSpec.model_validate({"name": "train", "nnodes": 2, "nproc_per_node": 2, "backend": "nccl",
                              "entrypoint": {"script": "train.py"}})
FIT = GpuHealth(index=0, recovery=None, ecc_uncorrected=0, rows_pending=False, rows_failed=False)


def _facts(health: list[GpuHealth] | str | None) -> dict[str, Any]:
    facts: dict[str, Any] = {"gpus": 2, "driver": "580.95", "gpu_names": ["NVIDIA H200"] * 2, "gpu_processes": [],
                             "shm_bytes": 1 << 34, "workdir": "/w", "workdir_exists": True, "disk_free_bytes": 1 << 40}
    if health is not None:
        facts["gpu_health"] = health
    return facts


def _verdict(health: list[GpuHealth] | str | None, spec: JobSpec | None = JOB, backend: str = "nccl") -> Any:
    return next((c for c in resource_checks(HOST, _facts(health), spec, backend) if c.name == "gpu_health"), None)


@pytest.mark.parametrize(("second", "status", "reason"), [
    (FIT | {"index": 1}, Status.PASS, "2 GPU(s) fit: no recovery action, no row remapping pending or failed, "
                                      "no uncorrectable ECC error"),
    (FIT | {"index": 1, "recovery": "a GPU reset"}, Status.FAIL, "GPU 1 needs a GPU reset (the driver's recovery "
                                                                 "action)"),
    (FIT | {"index": 1, "recovery": "a node reboot", "rows_pending": True}, Status.FAIL,
     "GPU 1 needs a node reboot (the driver's recovery action); GPU 1 has memory rows waiting to be remapped (a GPU "
     "reset applies them)"),
    (FIT | {"index": 1, "rows_failed": True}, Status.FAIL, "GPU 1 failed to remap a memory row"),
    (FIT | {"index": 1, "ecc_uncorrected": 3}, Status.WARN, "uncorrectable ECC errors since the driver loaded "
                                                            "(GPU 1: 3), no recovery asked for"),
    (FIT | {"index": 1, "recovery": None, "ecc_uncorrected": None, "rows_pending": None, "rows_failed": None},
     Status.PASS, "2 GPU(s) fit: no recovery action, no row remapping pending or failed, no uncorrectable ECC error"),
])
def test_a_gpu_the_driver_calls_unfit_fails_its_host(second: GpuHealth, status: Status, reason: str) -> None:
    """A failing host is down for the attempt (controller._ready_plan): a spare takes its place."""
    check = _verdict([FIT, second])
    assert (check.status, check.reason) == (status, reason)
    assert (check.fix is not None) == (status is Status.FAIL)


def test_a_cpu_job_is_not_judged_a_host_without_gpus_has_no_row_and_an_unanswering_driver_warns() -> None:
    cpu = JobSpec.model_validate({"name": "train", "nnodes": 1, "backend": "gloo", "entrypoint": {"script": "t.py"}})
    assert _verdict([FIT | {"recovery": "a GPU reset"}], cpu, "gloo").status is Status.SKIP
    assert _verdict(None) is None, "a host without GPUs has no gpu_health row"
    unanswered = _verdict("the NVIDIA driver did not start NVML (error 9)")
    assert unanswered.status is Status.WARN and unanswered.reason.endswith("(error 9)")


def test_this_machine_without_a_driver_says_so_and_reads_nothing() -> None:
    assert device_health() == "no NVIDIA driver here (libnvidia-ml.so.1 not found)"
