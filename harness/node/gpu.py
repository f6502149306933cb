"""The GPUs as the NVIDIA driver sees them, through NVML (libnvidia-ml.so.1, which every driver installs) and
ctypes: how many there are, what each process uses of them -- its share of the SMs' time since the last
read and the memory it holds -- whether each is fit to run a job (device_health), and the Xid events the driver
wrote to the kernel log (xid_events: NVML's event sets see only what happens while one is open). Standard library only
(shipped to nodes with the agent): importing torch to ask would cost seconds and a CUDA context. Where there
is no driver, nothing is read and nothing is made up: the reader says why.

NVML names processes by the PIDs of the machine's own PID namespace; a rank in a container with a PID
namespace of its own is not found by its PID there, and its use stays unknown.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import time
from typing import NamedTuple, TypedDict

LIBRARY = "libnvidia-ml.so.1"
SUCCESS, INSUFFICIENT_SIZE, NOT_FOUND = 0, 7, 6
NOT_AVAILABLE = (1 << 64) - 1  # NVML's value for a memory figure it does not know (e.g. under MIG)
MAX_PROCESSES = 256  # per device and read: far more ranks than a GPU holds
RECOVERY_ACTION_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: what the driver says the GPU needs
RECOVERY_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 3: "its peer-to-peer traffic drained",
                    4: "its work drained and a GPU reset"}  # 0: none
UNCORRECTED, VOLATILE = 1, 0  # nvmlMemoryErrorType_t, nvmlEccCounterType_t: uncorrectable, since the driver loaded
KERNEL_LOG = "/dev/kmsg"
# "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus." after the record's header
# "priority,sequence,microseconds since boot,flags;".
XID_RECORD = re.compile(r"^\d+,\d+,(?P<us>\d+),[^;]*;NVRM: Xid \((?:PCI:)?(?P<pci>[^)]*)\): (?P<xid>\d+),? ?"
                        r"(?P<text>.*)$")
MAX_XIDS = 32  # the newest kept: a GPU that logs thousands says the same with fewer


class GpuHealth(TypedDict):
    """What the driver says of one GPU's fitness (None: it does not say, e.g. an older driver or a GPU without
    ECC): the recovery it needs (NVML's recovery action; None: none), its uncorrectable ECC errors since the
    driver loaded, and whether memory rows wait to be remapped (a reset applies them) or a remapping failed."""

    index: int
    recovery: str | None
    ecc_uncorrected: int | None
    rows_pending: bool | None
    rows_failed: bool | None


class XidEvent(TypedDict):
    """An Xid the driver logged: its number, the GPU's PCI address, how many seconds before the read (the node's
    own clock: no skew between hosts) and the driver's words."""

    xid: int
    pci: str
    age_s: float
    text: str


class GpuUse(NamedTuple):
    """A process's use of the GPUs: the percentage of the SMs' time it ran kernels since the last read (summed
    over devices), and the bytes of GPU memory it holds (-1: the driver does not say, e.g. under MIG)."""

    util: float
    memory: int


class _Process(ctypes.Structure):
    """nvmlProcessInfo_v2_t: what nvmlDeviceGetComputeRunningProcesses_v3 lists per process."""

    _fields_ = [("pid", ctypes.c_uint), ("used_memory", ctypes.c_ulonglong), ("gpu_instance", ctypes.c_uint),
                ("compute_instance", ctypes.c_uint)]


class _UtilSample(ctypes.Structure):
    """nvmlProcessUtilizationSample_t."""

    _fields_ = [("pid", ctypes.c_uint), ("timestamp", ctypes.c_ulonglong), ("sm", ctypes.c_uint),
                ("memory", ctypes.c_uint), ("encoder", ctypes.c_uint), ("decoder", ctypes.c_uint)]


class _FieldValue(ctypes.Structure):
    """nvmlFieldValue_t: one field nvmlDeviceGetFieldValues answers, its value a union of 8 bytes."""

    _fields_ = [("field_id", ctypes.c_uint), ("scope_id", ctypes.c_uint), ("timestamp", ctypes.c_longlong),
                ("latency_us", ctypes.c_longlong), ("value_type", ctypes.c_int), ("answer", ctypes.c_int),
                ("value", ctypes.c_ulonglong)]


class Nvml:
    """The driver, opened once (open_nvml). Each read of process_use covers the time since the one before."""

    def __init__(self, lib: ctypes.CDLL, devices: list[ctypes.c_void_p]) -> None:
        self._lib = lib
        self.devices = devices
        self._seen: dict[int, int] = {}  # device index -> the newest sample's timestamp (µs) read

    def process_use(self) -> dict[int, GpuUse]:
        """Every process that holds GPU memory or ran kernels since the last read, by PID."""
        memory: dict[int, int] = {}
        util: dict[int, float] = {}
        for index, device in enumerate(self.devices):
            for pid, used in self._processes(device).items():
                memory[pid] = max(memory.get(pid, 0), 0) + used if used >= 0 else memory.get(pid, -1)
            for pid, share in self._utilization(index, device).items():
                util[pid] = util.get(pid, 0.0) + share
        return {pid: GpuUse(round(util.get(pid, 0.0), 1), memory.get(pid, -1)) for pid in memory.keys() | util.keys()}

    def health(self) -> list[GpuHealth]:
        """Every GPU's fitness, as the driver says it now."""
        return [self._health(index, device) for index, device in enumerate(self.devices)]

    def close(self) -> None:
        self._lib.nvmlShutdown()

    def _health(self, index: int, device: ctypes.c_void_p) -> GpuHealth:
        field = _FieldValue(field_id=RECOVERY_ACTION_FIELD)
        recovery = None
        if self._lib.nvmlDeviceGetFieldValues(device, 1, ctypes.byref(field)) == SUCCESS and field.answer == SUCCESS:
            recovery = RECOVERY_ACTIONS.get(field.value & 0xFFFFFFFF)
        errors = ctypes.c_ulonglong(0)
        ecc = errors.value if self._lib.nvmlDeviceGetTotalEccErrors(device, UNCORRECTED, VOLATILE,
                                                                     ctypes.byref(errors)) == SUCCESS else None
        corrected, uncorrected, pending, failed = (ctypes.c_uint(0) for _ in range(4))
        rows = self._lib.nvmlDeviceGetRemappedRows(device, ctypes.byref(corrected), ctypes.byref(uncorrected),
                                                   ctypes.byref(pending), ctypes.byref(failed)) == SUCCESS
        return GpuHealth(index=index, recovery=recovery, ecc_uncorrected=ecc,
                         rows_pending=bool(pending.value) if rows else None,
                         rows_failed=bool(failed.value) if rows else None)

    def _processes(self, device: ctypes.c_void_p) -> dict[int, int]:
        count = ctypes.c_uint(MAX_PROCESSES)
        found = (_Process * MAX_PROCESSES)()
        if self._lib.nvmlDeviceGetComputeRunningProcesses_v3(device, ctypes.byref(count), found) != SUCCESS:
            return {}
        return {found[i].pid: -1 if found[i].used_memory == NOT_AVAILABLE else int(found[i].used_memory)
                for i in range(count.value)}

    def _utilization(self, index: int, device: ctypes.c_void_p) -> dict[int, float]:
        """Each process's mean SM share over the samples the driver took since the last read."""
        since = ctypes.c_ulonglong(self._seen.get(index, 0))
        count = ctypes.c_uint(0)
        answer = self._lib.nvmlDeviceGetProcessUtilization(device, None, ctypes.byref(count), since)
        if answer != INSUFFICIENT_SIZE or count.value == 0:
            return {}  # NOT_FOUND: no process ran a kernel since then
        samples = (_UtilSample * count.value)()
        if self._lib.nvmlDeviceGetProcessUtilization(device, samples, ctypes.byref(count), since) != SUCCESS:
            return {}
        shares: dict[int, list[int]] = {}
        for sample in samples[:count.value]:
            if sample.timestamp > since.value:
                shares.setdefault(sample.pid, []).append(sample.sm)
                self._seen[index] = max(self._seen.get(index, 0), sample.timestamp)
        return {pid: sum(values) / len(values) for pid, values in shares.items()}


def open_nvml() -> Nvml | str:
    """The driver's NVML with every GPU it has, or why there is none to read."""
    try:
        lib = ctypes.CDLL(LIBRARY)
    except OSError:
        return f"no NVIDIA driver here ({LIBRARY} not found)"
    if (answer := lib.nvmlInit_v2()) != SUCCESS:
        return f"the NVIDIA driver did not start NVML (error {answer})"
    count = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != SUCCESS:
        return "the NVIDIA driver did not count its GPUs"
    devices = []
    for index in range(count.value):
        device = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(device)) == SUCCESS:
            devices.append(device)
    return Nvml(lib, devices)


def device_health() -> list[GpuHealth] | str:
    """Every GPU's fitness, or why the driver cannot say."""
    nvml = open_nvml()
    if isinstance(nvml, str):
        return nvml
    try:
        return nvml.health()
    finally:
        nvml.close()


def xid_events(path: str = KERNEL_LOG, now_s: float | None = None) -> list[XidEvent] | str:
    """The newest Xid events in the kernel's log since boot (oldest first), or why it cannot be read (reading
    /dev/kmsg takes root or CAP_SYSLOG where kernel.dmesg_restrict is 1). now_s: the log's clock now (seconds
    since boot, CLOCK_MONOTONIC's by default), which each event's age is counted back from."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return f"the kernel log cannot be read ({path}: {exc.strerror})"
    found: list[XidEvent] = []
    now_us = (time.monotonic() if now_s is None else now_s) * 1e6  # the log counts microseconds since boot
    try:
        while True:
            try:
                record = os.read(fd, 8192)  # one record per read from /dev/kmsg
            except BlockingIOError:
                break  # the end of the log
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten while reading: the next one follows
                return f"the kernel log cannot be read ({path}: {exc.strerror})"
            if not record:
                break
            for line in record.decode(errors="replace").splitlines():  # a record and its " KEY=value" lines
                if (match := XID_RECORD.match(line)) is not None:
                    found.append(XidEvent(xid=int(match["xid"]), pci=match["pci"], text=match["text"].strip(),
                                          age_s=round(max(0.0, now_us - int(match["us"])) / 1e6, 1)))
            del found[:-MAX_XIDS]
    finally:
        os.close(fd)
    return found


def driver_gpu_count() -> int:
    """How many GPUs the NVIDIA driver has (0 without a driver)."""
    nvml = open_nvml()
    if isinstance(nvml, str):
        return 0
    try:
        return len(nvml.devices)
    finally:
        nvml.close()
