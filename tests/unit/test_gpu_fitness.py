"""Whether a GPU host is fit for an attempt, from the driver's own answers (NVML: its recovery action, row
remapping, uncorrectable ECC errors; the kernel log's Xids) and the GPU memory a previous attempt's process still
holds, as the probe reports them: decided here on recorded answers; read for real on a GPU machine by
tests/gpu/test_gpu_fitness.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.node.gpu import GpuHealth, XidEvent, device_health, xid_events
from harness.node.probe import GpuProcess, _gpu_process
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
                                      "no uncorrectable ECC error, no hardware Xid"),
    (FIT | {"index": 1, "recovery": "a GPU reset"}, Status.FAIL, "GPU 1 needs a GPU reset (the driver's recovery "
                                                                 "action)"),
    (FIT | {"index": 1, "recovery": "a node reboot", "rows_pending": True}, Status.FAIL,
     "GPU 1 needs a node reboot (the driver's recovery action); GPU 1 has memory rows waiting to be remapped (a GPU "
     "reset applies them)"),
    (FIT | {"index": 1, "rows_failed": True}, Status.FAIL, "GPU 1 failed to remap a memory row"),
    (FIT | {"index": 1, "ecc_uncorrected": 3}, Status.WARN, "uncorrectable ECC errors since the driver loaded "
                                                            "(GPU 1: 3), no recovery asked for"),
    (FIT | {"index": 1, "recovery": None, "ecc_uncorrected": None, "rows_pending": None, "rows_failed": None},
     Status.PASS, "2 GPU(s) fit: no recovery action, no row remapping pending or failed, no uncorrectable ECC error, "
                  "no hardware Xid"),
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


def _kernel_log(tmp_path: Path, *records: tuple[float, str]) -> str:
    """A recorded /dev/kmsg: each record (seconds since boot, message) with its header and a KEY=value line."""
    path = tmp_path / "kmsg"
    path.write_text("".join(f"4,{i},{int(at * 1e6)},-;{text}\n SUBSYSTEM=pci\n" for i, (at, text) in enumerate(records)))
    return str(path)


@pytest.mark.parametrize("uptime_s", [100.0, 3 * 7 * 86400.0])  # a machine booted a minute ago, and weeks ago
def test_xids_are_read_from_the_kernel_log_with_their_age(tmp_path: Path, uptime_s: float) -> None:
    """The log's clock and now are both fixed: the machine's own uptime plays no part."""
    log = _kernel_log(tmp_path, (12.5, "NVRM: Xid (PCI:0000:3b:00): 13, pid=71, name=python, Graphics Exception"),
                      (uptime_s - 50, "usb 1-1: new device"),
                      (uptime_s - 30, "NVRM: Xid (PCI:0000:3b:00): 79, pid=71, name=python, GPU has fallen off the bus."))
    events = xid_events(log, now_s=uptime_s)
    assert isinstance(events, list) and [(e["xid"], e["pci"], e["age_s"]) for e in events] == [
        (13, "0000:3b:00", round(uptime_s - 12.5, 1)), (79, "0000:3b:00", 30.0)]
    assert events[1]["text"] == "pid=71, name=python, GPU has fallen off the bus."
    assert xid_events(str(tmp_path / "none")) == f"the kernel log cannot be read ({tmp_path / 'none'}: No such file " \
                                                 f"or directory)"


XID_79 = XidEvent(xid=79, pci="0000:3b:00", age_s=12.0, text="GPU has fallen off the bus.")


@pytest.mark.parametrize(("xids", "status", "reason"), [
    ([XID_79], Status.FAIL, "Xid 79 on GPU 0000:3b:00 12 s ago (GPU has fallen off the bus.)"),
    ([XID_79 | {"age_s": 86400.0}], Status.WARN,
     "older hardware Xids: Xid 79 on GPU 0000:3b:00 86400 s ago (GPU has fallen off the bus.)"),
    ([XID_79 | {"xid": 13, "text": "Graphics Exception"}], Status.PASS,
     "2 GPU(s) fit: no recovery action, no row remapping pending or failed, no uncorrectable ECC error, no hardware "
     "Xid"),
    ("the kernel log cannot be read (/dev/kmsg: Operation not permitted)", Status.PASS,
     "2 GPU(s) fit: no recovery action, no row remapping pending or failed, no uncorrectable ECC error, Xids not "
     "read: the kernel log cannot be read (/dev/kmsg: Operation not permitted)"),
])
def test_a_fresh_hardware_xid_fails_its_host_an_old_one_warns_a_programs_own_passes(
        xids: list[XidEvent] | str, status: Status, reason: str) -> None:
    """Fresh: within XID_FRESH_S, the fault a restart follows; the program's own Xids (13: its kernel's
    exception) say nothing of the host."""
    facts = _facts([FIT, FIT | {"index": 1}]) | {"gpu_xids": xids}
    check = next(c for c in resource_checks(HOST, facts, JOB, "nccl") if c.name == "gpu_health")
    assert (check.status, check.reason) == (status, reason)


def test_gpu_memory_held_by_a_harness_runs_process_fails_the_host_anothers_warns() -> None:
    """The probe tags a GPU-holding process with the run and attempt its environment names (read for real here
    from a process started so; NVML's listing of it is tests/gpu's)."""
    env = {**os.environ, "HARNESS_RUN_ID": "r-1", "HARNESS_ATTEMPT": "2"}
    sleeper = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); input()"], env=env, text=True,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert sleeper.stdout is not None and sleeper.stdout.readline() == "up\n"  # its exec done: its env readable
        left = _gpu_process(sleeper.pid, "python", "2048", "1")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert left == {"pid": sleeper.pid, "name": "python", "used_mib": "2048", "gpu": "1", "run_id": "r-1",
                    "attempt": "2"}
    other = _gpu_process(os.getpid(), "jupyter", "512", "0")
    assert "run_id" not in other or other["run_id"] != "r-1"

    def rows(*processes: GpuProcess) -> dict[str, Any]:
        facts = _facts([FIT]) | {"gpu_processes": list(processes)}
        return {c.name: c for c in resource_checks(HOST, facts, JOB, "nccl")}

    both = rows(other | {"pid": 7, "name": "jupyter"}, left)
    failed = both["gpu_memory"]
    assert failed.status is Status.FAIL and failed.reason == (
        f"GPU memory still held by a harness run's process that outlived its attempt: pid {sleeper.pid} (python) "
        f"2048 MiB on GPU 1, of run r-1 attempt 2")
    assert "kill -9" in failed.fix
    assert both["gpus"].status is Status.WARN and "pid 7 (jupyter)" in both["gpus"].reason
    assert str(sleeper.pid) not in both["gpus"].reason
    alone = rows({"pid": 7, "name": "jupyter", "used_mib": "512", "gpu": "0"})
    assert alone["gpus"].status is Status.WARN and "gpu_memory" not in alone, "another program's memory only warns"
