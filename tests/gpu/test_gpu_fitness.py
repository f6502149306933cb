"""The driver's own word on whether each GPU is fit for an attempt (harness.node.gpu.device_health, through NVML
and ctypes), read on a real GPU machine, as the probe reports it and as the per-attempt check judges it. The
decisions on unfit answers are tests/unit/test_gpu_fitness.py's, on recorded answers."""

from __future__ import annotations

import json

import pytest

from harness.node.gpu import device_health, driver_gpu_count
from harness.node.probe import _gpus
from harness.preflight.checks import resource_checks
from harness.preflight.table import Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec

pytestmark = pytest.mark.usefixtures("cuda")


def test_every_gpu_is_read_and_a_healthy_machine_passes_the_check() -> None:
    health = device_health()
    print("NVML's answers:", json.dumps(health))  # kept in the device run's output: the note records them
    assert isinstance(health, list), health
    assert [gpu["index"] for gpu in health] == list(range(driver_gpu_count())) and health
    for gpu in health:
        assert gpu["recovery"] is None, gpu  # a machine lent for tests needs no reset
        assert gpu["rows_failed"] in (False, None) and gpu["rows_pending"] in (False, None), gpu
        assert gpu["ecc_uncorrected"] is None or gpu["ecc_uncorrected"] >= 0, gpu
    facts = _gpus()
    assert facts["gpu_health"] == health
    spec = JobSpec.model_validate({"name": "train", "nnodes": 1, "nproc_per_node": 1, "backend": "nccl",
                                   "entrypoint": {"script": "train.py"}})
    facts_all = {**facts, "shm_bytes": 1 << 34, "workdir": "/w", "workdir_exists": True, "disk_free_bytes": 1 << 40}
    check = next(c for c in resource_checks(Host(name="gpu", address="127.0.0.1"), facts_all, spec, "nccl")
                 if c.name == "gpu_health")
    assert check.status is Status.PASS, check
