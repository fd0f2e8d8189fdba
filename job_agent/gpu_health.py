"""GPU health on one node, read through NVML (`nvidia-ml-py`): what the GPUs say before and as they fail.

Two kinds of signal, each naming the GPU it concerns:

- a **failure**: a critical XID event (79 fallen off the bus; 48, 94, 95 uncorrectable ECC; 74 NVLink;
  63, 64 row remapping recorded or failed) or a GPU NVML reports lost. The ranks on that GPU are gone
  or about to be: their state comes from a replica.
- a **warning** (`planned`): the temperature at or over its threshold, the uncorrectable ECC count rising,
  or rows waiting to be remapped. The GPU still works: its ranks are moved off it pre-emptively, a planned
  move (they freeze with the others at a step boundary, then leave, and spares take their slots).

Each condition is reported once while it lasts: re-reading the same state reports nothing new, so a
detector restarted on the same node, or polling again, starts nothing twice (a temperature that falls
below the threshold and rises again is a new warning; ECC counts are compared with the last reading).
A machine without NVML (no driver, no library) has no GPUs: `GpuHealth.gpus` is empty and `reason` says
why; nothing raises.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import pynvml

from torchpass.models import FailureKind

K = FailureKind
# XID -> what it means, per NVIDIA's XID catalogue (the ones that take a GPU out of training).
CRITICAL_XIDS: dict[int, tuple[FailureKind, str]] = {
    79: (K.GPU_FELL_OFF_BUS, "GPU has fallen off the bus"),
    48: (K.GPU_ECC_UNCORRECTABLE, "double-bit (uncorrectable) ECC error"),
    94: (K.GPU_ECC_UNCORRECTABLE, "contained uncorrectable ECC error"),
    95: (K.GPU_ECC_UNCORRECTABLE, "uncontained uncorrectable ECC error"),
    74: (K.NVLINK_ERROR, "NVLink error"),
    63: (K.GPU_ECC_UNCORRECTABLE, "row remapping recorded (ECC page retirement)"),
    64: (K.GPU_ECC_UNCORRECTABLE, "row remapping failed (ECC page retirement failure)"),
}
NO_GPUS = (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded)


@dataclass(frozen=True)
class GpuSignal:
    gpu: int
    kind: FailureKind
    planned: bool  # the GPU still works: move its ranks off it at a step boundary, before it fails
    detail: str
    xid: int | None = None


@dataclass
class _Seen:
    hot: bool = False
    ecc: int | None = None
    pending: bool = False
    lost: bool = False
    xids: set[int] = field(default_factory=set)


class GpuHealth:
    """The GPUs of this node as NVML reports them; `poll` returns what changed since the last call."""

    def __init__(self, max_temperature: int = 85, library: str | None = None) -> None:
        self.max_temperature = max_temperature
        self.gpus: list[int] = []
        self.reason = ""
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        self._seen: dict[int, _Seen] = {}
        try:
            if library is not None:  # a library of our choosing (tests): loaded before nvmlInit
                pynvml.nvmlLib = ctypes.CDLL(library)
            pynvml.nvmlInit()
        except NO_GPUS as e:
            self.reason = f"no GPUs: {e}"
            return
        self._events = pynvml.nvmlEventSetCreate()
        for i in range(pynvml.nvmlDeviceGetCount()):
            self.gpus.append(i)
            self._seen[i] = _Seen()
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
                self._handles[i] = handle
            except pynvml.NVMLError_GpuIsLost:
                pass  # reported by the first poll

    def close(self) -> None:
        if self._events is not None:
            pynvml.nvmlEventSetFree(self._events)
            pynvml.nvmlShutdown()
            self._events = None

    def poll(self, wait_ms: int = 0) -> list[GpuSignal]:
        """The XID events that arrived (waiting up to `wait_ms` for the first), then each GPU's state."""
        if self._events is None:
            return []
        out = self._xids(wait_ms)
        for i in self.gpus:
            out += self._state(i)
        return out

    def _xids(self, wait_ms: int) -> list[GpuSignal]:
        out: list[GpuSignal] = []
        by_handle = {ctypes.addressof(h.contents): i for i, h in self._handles.items()}
        while True:
            try:
                event = pynvml.nvmlEventSetWait(self._events, wait_ms if not out else 0)
            except pynvml.NVMLError_Timeout:
                return out
            i = by_handle.get(ctypes.addressof(event.device.contents)) if event.device else None
            xid = int(event.eventData)
            if i is None or xid not in CRITICAL_XIDS or xid in self._seen[i].xids:
                continue
            self._seen[i].xids.add(xid)
            kind, what = CRITICAL_XIDS[xid]
            out.append(GpuSignal(i, kind, False, f"GPU {i}: XID {xid}, {what}", xid))

    def _state(self, i: int) -> list[GpuSignal]:
        seen, out = self._seen[i], []
        try:
            handle = self._handles.get(i) or pynvml.nvmlDeviceGetHandleByIndex(i)
            temperature = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            )
            _, _, pending, failed = pynvml.nvmlDeviceGetRemappedRows(handle)
        except pynvml.NVMLError_GpuIsLost:
            if not seen.lost:
                seen.lost = True
                out.append(GpuSignal(i, K.GPU_LOST, False, f"GPU {i}: NVML reports it lost"))
            return out
        if temperature >= self.max_temperature and not seen.hot:
            out.append(
                GpuSignal(
                    i,
                    K.GPU_TEMPERATURE,
                    True,
                    f"GPU {i}: {temperature} C, at or over {self.max_temperature} C",
                )
            )
        seen.hot = temperature >= self.max_temperature
        if seen.ecc is not None and ecc > seen.ecc:
            out.append(
                GpuSignal(
                    i,
                    K.GPU_ECC_UNCORRECTABLE,
                    True,
                    f"GPU {i}: uncorrectable ECC errors rose {seen.ecc} -> {ecc}",
                )
            )
        seen.ecc = ecc
        if (pending or failed) and not seen.pending:
            what = "row remapping failed" if failed else "rows waiting to be remapped (a reset applies them)"
            out.append(GpuSignal(i, K.GPU_ECC_UNCORRECTABLE, True, f"GPU {i}: {what}"))
        seen.pending = bool(pending or failed)
        return out
