"""GPU health on one node, read through NVML (`nvidia-ml-py`): what the GPUs say before and as they
fail.

Two kinds of signal, each naming the GPU it concerns:

- a **failure**: a critical XID event (79 fallen off the bus; 48, 94, 95 uncorrectable ECC; 74
  NVLink; 63, 64 row remapping recorded or failed) or a GPU NVML reports lost. The ranks on that GPU
  are gone or about to be: their state comes from a replica.
- a **warning** (`planned`): the temperature at or over its threshold, the uncorrectable ECC count
  rising, or rows waiting to be remapped. The GPU still works: its ranks are moved off it
  pre-emptively, a planned move (they freeze with the others at a step boundary, then leave, and
  spares take their slots).

Each condition is reported once while it lasts: re-reading the same state reports nothing new, so a
detector restarted on the same node, or polling again, starts nothing twice (a temperature that
falls below the threshold and rises again is a new warning; ECC counts are compared with the last
reading; an XID event is delivered once). A reading a GPU does not offer (ECC on a board without it,
row remapping before Ampere) is left out and the others go on. A machine without NVML (no driver, no
library, a driver of another version) has no GPUs: `GpuHealth.gpus` is empty and `reason` says why;
nothing raises.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Mapping
from dataclasses import dataclass
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


def _read(call: Any, *args: Any) -> Any:
    """One NVML reading, or None where this GPU does not offer it (no ECC on the board, no row
    remapper before Ampere) or it failed for another reason: one missing value never stops the
    others. A lost GPU raises."""
    try:
        return call(*args)
    except pynvml.NVMLError_GpuIsLost:
        raise
    except pynvml.NVMLError:
        return None


class GpuHealth:
    """The GPUs of this node as NVML reports them; `poll` returns what changed since the last
    call."""

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
            count = pynvml.nvmlDeviceGetCount()
        # no library, no driver, a driver of another version, no permission
        except pynvml.NVMLError as e:
            self.reason = f"no GPUs: {e}"
            return
        # None: no XID events, the rest is still read
        self._events = _read(pynvml.nvmlEventSetCreate)
        for i in range(count):
            self.gpus.append(i)
            self._seen[i] = _Seen()
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                self._handles[i] = handle
                if self._events is not None:
                    _read(
                        pynvml.nvmlDeviceRegisterEvents,
                        handle,
                        pynvml.nvmlEventTypeXidCriticalError,
                        self._events,
                    )
            except pynvml.NVMLError:
                pass  # lost already, or unreadable: the first poll says which

    def close(self) -> None:
        if self._events is not None:
            _read(pynvml.nvmlEventSetFree, self._events)
            self._events = None
        if self.gpus:
            _read(pynvml.nvmlShutdown)
            self.gpus = []

    def poll(self, wait_ms: int = 0) -> list[GpuSignal]:
        """The XID events that arrived within `wait_ms` (or none, at once, with no event set), then
        each GPU's state."""
        if not self.gpus:
            return []
        out = self._xids(wait_ms) if self._events is not None else []
        for i in self.gpus:
            out += self._state(i)
        return out

    def _xids(self, wait_ms: int) -> list[GpuSignal]:
        """Critical XIDs until `wait_ms` is out or none is waiting once one arrived. Each event is
        delivered once by NVML (and only those after the event set was made), so none is read twice;
        a second XID of the same number later is a new failure."""
        out: list[GpuSignal] = []
        by_handle = {ctypes.addressof(h.contents): i for i, h in self._handles.items()}
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            left = 0 if out else max(0, int((deadline - time.monotonic()) * 1000))
            try:
                event = pynvml.nvmlEventSetWait(self._events, left)
            # the timeout; or a GPU lost, which its state read then reports
            except pynvml.NVMLError:
                return out
            i = by_handle.get(ctypes.addressof(event.device.contents)) if event.device else None
            xid = int(event.eventData)
            if i is not None and xid in CRITICAL_XIDS:
                kind, what = CRITICAL_XIDS[xid]
                out.append(GpuSignal(i, kind, False, f"GPU {i}: XID {xid}, {what}", xid))
            # a stream of other XIDs never holds up the state reads
            elif time.monotonic() >= deadline:
                return out

    def _state(self, i: int) -> list[GpuSignal]:
        seen, out = self._seen[i], []
        try:
            handle = self._handles.get(i) or pynvml.nvmlDeviceGetHandleByIndex(i)
            self._handles[i] = handle
            temperature = _read(
                pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
            )
            ecc = _read(
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_VOLATILE_ECC,
            )
            remap = _read(pynvml.nvmlDeviceGetRemappedRows, handle)
        except pynvml.NVMLError_GpuIsLost:
            if not seen.lost:
                seen.lost = True
                out.append(GpuSignal(i, K.GPU_LOST, False, f"GPU {i}: NVML reports it lost"))
            return out
        except pynvml.NVMLError:
            return out  # no handle this time: read again at the next poll
        if temperature is not None:
            hot = temperature >= self.max_temperature
            if hot and not seen.hot:
                detail = f"GPU {i}: {temperature} C, at or over {self.max_temperature} C"
                out.append(GpuSignal(i, K.GPU_TEMPERATURE, True, detail))
            seen.hot = hot
        if ecc is not None:
            if seen.ecc is not None and ecc > seen.ecc:
                detail = f"GPU {i}: uncorrectable ECC errors rose {seen.ecc} -> {ecc}"
                out.append(GpuSignal(i, K.GPU_ECC_UNCORRECTABLE, True, detail))
            seen.ecc = ecc
        if remap is not None:
            _, _, pending, failed = remap
            if (pending or failed) and not seen.pending:
                what = (
                    "row remapping failed"
                    if failed
                    else "rows waiting to be remapped (a reset applies them)"
                )
                out.append(GpuSignal(i, K.GPU_ECC_UNCORRECTABLE, True, f"GPU {i}: {what}"))
            seen.pending = bool(pending or failed)
        return out


def nvml_index(local_rank: int, count: int, environ: Mapping[str, str]) -> int | None:
    """The NVML index of the GPU a process with `local_rank` uses
    (`job_agent.rank.tensors.pick_device`: CUDA device `local_rank % visible`), given the node's
    CUDA_VISIBLE_DEVICES; None where that cannot be told (devices named by UUID). NVML numbers GPUs
    by PCI bus: CUDA's numbering matches it when CUDA_DEVICE_ORDER=PCI_BUS_ID, which a node agent
    sets for its processes."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return local_rank % count if count else None
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not ids or not all(v.isdigit() for v in ids):
        return None
    return int(ids[local_rank % len(ids)])
