"""What the node agent watches of its own host and tells its coordinator: its GPUs' health (NVML)
and its watched filesystems and memory. A reading that fails is logged and read again; a watch never
dies of it. Nothing is acted on here: the coordinator decides what a report means for the job."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from job_agent import wire
from job_agent.launch.launcher import LocalLauncher
from job_agent.node.gpu_health import GpuHealth, GpuSignal, nvml_index
from job_agent.node.host_health import HostHealth
from job_agent.node.settings import NodeSettings
from job_agent.wire.base import TEXT

log = logging.getLogger("torchpass.node")


class HealthWatch:
    """The node's GPU and host watches, and what they say about where a new process may go."""

    def __init__(
        self,
        settings: NodeSettings,
        launcher: LocalLauncher,
        send: Callable[[wire.Frame], None],
        done: threading.Event,
    ) -> None:
        self._s, self._launcher, self._send, self._done = settings, launcher, send, done
        # NVML indices of the GPUs that failed, or warned (hot, ECC rising, remaps pending): not
        # given to a new process while another is free (one warned with no process on it said
        # nothing to anyone).
        self._avoided_gpus: set[int] = set()
        self._gpu_count = 0
        self._host = HostHealth(
            settings.watch_paths, settings.min_free_disk, settings.min_free_memory, settings.proc
        )
        self._host_lock = threading.Lock()

    def device_for_a_new_process(self) -> int:
        """Its LOCAL_RANK: a free GPU, one that failed or warned only when no other is free (a spare
        would be lost with it)."""
        free = self._launcher.free_devices(len(self._avoided_gpus) + 1)
        count = self._gpu_count
        healthy = [i for i in free if nvml_index(i, count, os.environ) not in self._avoided_gpus]
        return (healthy or free)[0]

    def oom_killed(self, agent_id: str) -> None:
        """A process of this node ended by SIGKILL nobody sent: if the kernel's OOM killer did it,
        say so (before its exit is said)."""
        with self._host_lock:
            oom = self._host.oom_killed(f"process {agent_id}")
        if oom is not None:
            log.error("node %s: %s", self._s.node, oom.detail)
            self._send(wire.HostReport(kind=oom.kind, detail=oom.detail, agent_ids=(agent_id,)))

    def gpus(self) -> None:
        """Read the GPUs' health and tell the coordinator what concerns the processes on each GPU
        (the one a process's LOCAL_RANK names, through CUDA_VISIBLE_DEVICES). A GPU running none of
        them starts nothing."""
        s = self._s
        health = GpuHealth(s.max_gpu_temperature)
        if not health.gpus:
            log.info("node %s: %s; GPU health not watched", s.node, health.reason or "no GPUs")
            return
        wait_ms, self._gpu_count = int(s.gpu_check_every * 1000), len(health.gpus)
        try:
            while not self._done.is_set():
                try:
                    signals = health.poll(wait_ms)
                # an NVML failure of a kind not foreseen: said, then read again
                except Exception as e:
                    log.error("node %s: reading the GPUs failed: %s", s.node, e)
                    self._done.wait(s.gpu_check_every)
                    continue
                for signal in signals:
                    self._gpu_signal(signal, len(health.gpus))
        finally:
            health.close()

    def host(self) -> None:
        """Read the host's watched filesystems and its memory; tell the coordinator what began or
        ended (it joins them to the failures they explain)."""
        every = self._s.host_check_every
        while not self._done.wait(every):
            with self._host_lock:
                changes = self._host.poll()
            for c in changes:
                (log.error if c.active else log.warning)("node %s: %s", self._s.node, c.detail)
                report = wire.HostReport(
                    kind=c.kind, active=c.active, detail=c.detail[:TEXT], path=c.path
                )
                self._send(report)

    def _gpu_signal(self, signal: GpuSignal, count: int) -> None:
        self._avoided_gpus.add(signal.gpu)
        on_it = tuple(
            a
            for a, d in self._launcher.devices().items()
            if nvml_index(d, count, os.environ) == signal.gpu
        )
        log.warning(
            "node %s: %s (processes on it: %s)", self._s.node, signal.detail, on_it or "none"
        )
        if on_it:
            report = wire.GpuReport(
                gpu=signal.gpu,
                agent_ids=on_it[:64],
                kind=signal.kind,
                planned=signal.planned,
                detail=signal.detail[:TEXT],
                xid=signal.xid,
            )
            self._send(report)
