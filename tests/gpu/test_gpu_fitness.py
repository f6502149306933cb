"""The driver's own word on whether each GPU is fit for an attempt (harness.node.gpu.device_health, through NVML
and ctypes; its Xids, from the kernel log), and the GPU memory a previous attempt's process still holds, read on
a real GPU machine, as the probe reports them and as the per-attempt check judges them. The decisions on unfit
answers are tests/unit/test_gpu_fitness.py's, on recorded answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.node.gpu import device_health, driver_gpu_count, xid_events
from harness.node.probe import _gpus
from harness.preflight.checks import resource_checks
from harness.preflight.table import Status
from harness.spec.inventory import Host
from harness.spec.job import JobSpec

pytestmark = pytest.mark.usefixtures("cuda")
SPEC = JobSpec.model_validate({"name": "train", "nnodes": 1, "nproc_per_node": 1, "backend": "nccl",
                              "entrypoint": {"script": "train.py"}})
DISK = {"shm_bytes": 1 << 34, "workdir": "/w", "workdir_exists": True, "disk_free_bytes": 1 << 40}
HOLDER = """
import sys, torch
held = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("holding", flush=True)
sys.stdin.read()
"""


def test_every_gpu_is_read_and_a_healthy_machine_passes_the_check() -> None:
    health = device_health()
    print("NVML's answers:", json.dumps(health))  # kept in the device run's output: the note records them
    assert isinstance(health, list), health
    assert [gpu["index"] for gpu in health] == list(range(driver_gpu_count())) and health
    for gpu in health:
        assert gpu["recovery"] is None, gpu  # a machine lent for tests needs no reset
        assert gpu["rows_failed"] in (False, None) and gpu["rows_pending"] in (False, None), gpu
        assert gpu["ecc_uncorrected"] is None or gpu["ecc_uncorrected"] >= 0, gpu
    xids = xid_events()
    print("the kernel log's Xids:", json.dumps(xids))
    assert isinstance(xids, (list, str)), xids  # a container without CAP_SYSLOG may not read /dev/kmsg: it says so
    assert isinstance(xids, list) or xids.startswith("the kernel log cannot be read"), xids
    facts = _gpus()
    assert facts["gpu_health"] == health
    assert isinstance(facts["gpu_xids"], type(xids))
    check = next(c for c in resource_checks(Host(name="gpu", address="127.0.0.1"), {**facts, **DISK}, SPEC, "nccl")
                 if c.name == "gpu_health")
    print(check)
    fresh = isinstance(xids, list) and any(x["age_s"] < 600 and x["xid"] in (48, 79, 94, 95) for x in xids)
    assert check.status is Status.PASS or fresh, check


def test_gpu_memory_a_previous_attempts_process_still_holds_fails_the_host() -> None:
    """A rank that outlived its attempt (as one stuck in the driver does) holds GPU memory the next one needs:
    its host is down for the attempt and a spare takes its place. A process of no harness run only warns."""
    env = {**os.environ, "HARNESS_RUN_ID": "left-over", "HARNESS_ATTEMPT": "3", "CUDA_VISIBLE_DEVICES": "0"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        facts = _gpus()
        print("gpu_processes:", json.dumps(facts["gpu_processes"]))
        mine = [p for p in facts["gpu_processes"] if p["pid"] == holder.pid]
        assert mine and mine[0]["run_id"] == "left-over" and mine[0]["attempt"] == "3", facts["gpu_processes"]
        assert int(mine[0]["used_mib"]) >= 256, mine
        check = next(c for c in resource_checks(Host(name="gpu", address="127.0.0.1"), {**facts, **DISK}, SPEC,
                                                "nccl") if c.name == "gpu_memory")
        assert check.status is Status.FAIL, check
        assert f"pid {holder.pid} " in check.reason and "of run left-over attempt 3" in check.reason, check
    finally:
        holder.kill()
        holder.wait()
