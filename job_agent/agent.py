"""The rank agent: adopted by a training script in a few lines, it makes each step survivable.

    agent = RankAgent()
    model, opt = build()
    agent.track(model, opt)
    agent.run(train_step, steps=1000)   # train_step(step) calls agent.all_reduce_gradients()

Inside `run` the agent reports step progress, seeds per-step randomness from (seed, step, rank) so nothing
rank-private ever has to move, and turns a failed collective into a freeze: it drops the broken process
group, reports the last completed step and obeys the coordinator (serve or receive state, re-form the
group for the next generation). The step that was in flight is then redone, so the job's state is bit for
bit the one of a run that never failed. A spare runs the same script: it builds the model, warms the
optimizer and waits in `run` until it is given a slot.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from job_agent import protocol
from job_agent.settings import AgentSettings
from job_agent.state import Stateful, TrackedState
from job_agent.transport import StateServer, TransferError, receive_state

_EXIT_COORDINATOR_LOST = 70
_EXIT_DEVICE_ERROR = 75
_COLLECTIVE_MARKERS = ("gloo", "Connection closed by peer", "Connection reset by peer", "NCCL", "Broken pipe")
_DEVICE_MARKERS = ("CUDA error", "CUDA driver", "cudaError", "device-side assert")


class CollectiveFailure(Exception):
    """A collective failed because a peer died, hung or was fenced: a migration, not a bug."""


class RecoveryTimeout(Exception):
    """The coordinator gave no instruction within recovery_timeout while this rank was frozen."""


def _mix(seed: int, step: int, slot: int) -> int:
    """splitmix64 of (seed, step, slot): per-rank, per-step randomness that never has to be moved."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + slot * 0x94D049BB133111EB) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63


class RankAgent:
    """One per training process (rank or warm spare); talks to the job's coordinator."""

    def __init__(self, settings: AgentSettings | None = None) -> None:
        self.settings = s = settings or AgentSettings.model_validate({})
        torch.set_num_threads(s.threads)
        self.slot = s.slot
        self.world_size = s.world_size
        self.device = _pick_device(s.device, s.local_rank)
        self.completed_step = -1
        self.generation = -1
        self._secret = s.read_secret()
        self._tracked: TrackedState | None = None
        self._grad_buckets: list[list[torch.Tensor]] | None = None
        self._inbox: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._finished = threading.Event()
        self._coll_timeout = timedelta(seconds=s.collective_timeout)
        host, port = s.store_addr
        self._store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=s.recovery_timeout)
        )
        self._sock = protocol.connect(*s.coordinator_addr, self._secret, timeout=30.0)
        protocol.send_frame(
            self._sock,
            {"t": "hello", "agent_id": s.agent_id, "role": s.role, "slot": s.slot, "pid": os.getpid()},
        )
        reply = protocol.recv_frame(self._sock)
        if reply["t"] != "welcome":
            raise RuntimeError(f"coordinator refused this process: {reply.get('reason')}")
        threading.Thread(target=self._read_loop, name="torchpass-control", daemon=True).start()
        threading.Thread(target=self._heartbeat_loop, name="torchpass-heartbeat", daemon=True).start()

    @property
    def rank(self) -> int:
        return self.slot

    @property
    def is_spare(self) -> bool:
        return self.slot < 0

    # --- adoption API ------------------------------------------------------------------------------

    def track(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extras: Stateful
    ) -> None:
        """Register the state that must survive a migration (model, optimizer, scheduler, scaler...)."""
        self._tracked = TrackedState(model, optimizer, extras)
        self._grad_buckets = None
        # Everything alive now (torch's modules, the model) lives as long as the process: moving it out
        # of the collector's view makes the collection at each freeze take microseconds instead of
        # ~150 ms.
        gc.collect()
        gc.freeze()
        if self.is_spare:
            self._tracked.warm()  # touch the memory now, receive into it in place later
        elif self.settings.restore is not None:
            self.completed_step = self._tracked.load_checkpoint(self.settings.restore)

    def all_reduce_gradients(self) -> None:
        """Average gradients over the data-parallel group, in a fixed order (bitwise reproducible)."""
        self._send({"t": "coll", "k": self.completed_step + 1})
        for bucket in self._buckets():
            flat = torch._utils._flatten_dense_tensors([p.grad for p in bucket])
            self.all_reduce(flat)
            flat.div_(self.world_size)
            for p, g in zip(
                bucket, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in bucket]), strict=True
            ):
                assert p.grad is not None
                p.grad.copy_(g)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum in place over all ranks, with a real per-collective timeout; raises CollectiveFailure."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = self._coll_timeout
        try:
            dist.distributed_c10d._get_default_group().allreduce([tensor], opts).wait()
        except RuntimeError as e:
            raise CollectiveFailure(str(e)) from None
        return tensor

    def run(self, train_step: Callable[[int], object], steps: int) -> None:
        """Run steps completed_step+1 .. steps-1, surviving failures of this rank's peers."""
        if self._tracked is None:
            raise RuntimeError("call agent.track(model, optimizer) before agent.run()")
        self._send({"t": "ready", "completed": self.completed_step, "steps": steps})
        self._obey_until_regrouped()
        while (step := self.completed_step + 1) < steps:
            self._check_inbox()
            self._send({"t": "step", "k": step})
            torch.manual_seed(_mix(self.settings.seed, step, self.slot))
            failure = self._attempt(train_step, step)
            if failure is not None:
                self._freeze(step, failure)
                continue
            self.completed_step = step
            self._maybe_checkpoint(step)
        self._finish()

    # --- the step and its failure modes ------------------------------------------------------------

    def _attempt(self, train_step: Callable[[int], object], step: int) -> str | None:
        """Run one step; return why it failed if a peer did, re-raise the script's own errors."""
        try:
            train_step(step)
        except CollectiveFailure as e:
            return str(e)
        except Exception as e:
            msg = str(e)
            if isinstance(e, RuntimeError) and any(m in msg for m in _COLLECTIVE_MARKERS):
                return msg
            if isinstance(e, torch.OutOfMemoryError) or any(m in msg for m in _DEVICE_MARKERS):
                self._send({"t": "device_error", "detail": msg[:2000]})
                traceback.print_exc()
                os._exit(_EXIT_DEVICE_ERROR)
            # The script's own bug: the user must see their traceback, and no migration starts.
            self._send({"t": "user_error", "step": step, "traceback": traceback.format_exc()[-4000:]})
            raise
        return None

    def _freeze(self, in_flight: int | None, reason: str) -> None:
        # Outside the except block, so no traceback keeps the old group's sockets alive (which would
        # leave peers blocked until the group timeout).
        self._drop_group()
        self._send(
            {"t": "frozen", "completed": self.completed_step, "in_flight": in_flight, "reason": reason}
        )
        self._obey_until_regrouped()

    def _check_inbox(self) -> None:
        if self._inbox.empty():
            return
        msg = self._inbox.get()
        if msg["t"] == "freeze":  # planned migration: stop at this step boundary
            self._freeze(None, "freeze requested")
        else:
            self._handle(msg)

    def _obey_until_regrouped(self) -> None:
        deadline = time.monotonic() + self.settings.recovery_timeout
        while True:
            try:
                msg = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RecoveryTimeout(
                    f"no instruction from the coordinator for {self.settings.recovery_timeout:.0f} s"
                ) from None
            if self._handle(msg):
                return

    def _handle(self, msg: dict[str, Any]) -> bool:
        """Carry out one coordinator command; True once the group is re-formed."""
        t = msg["t"]
        if t == "freeze":
            self._send(
                {"t": "frozen", "completed": self.completed_step, "in_flight": None, "reason": "freeze"}
            )
        elif t == "assign":
            self.slot = int(msg["slot"])
        elif t == "serve":
            self._serve(int(msg["receivers"]), float(msg["timeout"]))
        elif t == "receive":
            self._receive(msg["host"], int(msg["port"]), float(msg["timeout"]))
        elif t == "regroup":
            self._regroup(int(msg["generation"]), int(msg["world_size"]))
            return True
        elif t == "exit":
            self._exit(int(msg.get("code", 0)), msg.get("reason", ""))
        return False

    # --- recovery actions ----------------------------------------------------------------------------

    def _serve(self, receivers: int, timeout: float) -> None:
        assert self._tracked is not None
        server = StateServer(self._secret, self.settings.advertise_host)
        self._send({"t": "serving", "port": server.port, "step": self.completed_step})
        t0 = time.perf_counter()
        snap = self._tracked.snapshot(self.completed_step)
        try:
            digest = server.serve(snap, receivers, timeout, on_progress=lambda: None)
        except TransferError as e:
            self._send({"t": "transfer_failed", "error": str(e)})
            return
        self._send(
            {
                "t": "served",
                "digest": digest,
                "bytes": snap.nbytes,
                "seconds": time.perf_counter() - t0,
                "stream_seconds": server.stream_seconds,
            }
        )

    def _receive(self, host: str, port: int, timeout: float) -> None:
        assert self._tracked is not None
        try:
            stats = receive_state(self._tracked, host, port, self._secret, timeout)
        except TransferError as e:
            self._send({"t": "transfer_failed", "error": str(e)})
            return
        self.completed_step = stats.step
        self._send(
            {
                "t": "received",
                "digest": stats.digest,
                "bytes": stats.nbytes,
                "seconds": stats.seconds,
                "step": stats.step,
            }
        )

    def _regroup(self, generation: int, world_size: int) -> None:
        self._drop_group()
        self.generation = generation
        self.world_size = world_size
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # A new store prefix per generation: reusing one makes init read stale keys.
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"gen{generation}", self._store),
            rank=self.slot,
            world_size=world_size,
            timeout=self._coll_timeout,
        )
        self._send({"t": "joined", "generation": generation, "completed": self.completed_step})

    def _drop_group(self) -> None:
        if not dist.is_initialized():
            return
        with contextlib.suppress(RuntimeError):  # a broken group may fail to shut down cleanly
            dist.destroy_process_group()
        # Reference cycles (failed work objects, their exceptions) can keep the old group's sockets
        # open, which leaves peers blocked until the group timeout.
        gc.collect()

    def _maybe_checkpoint(self, step: int) -> None:
        s = self.settings
        if self.slot != 0 or not s.checkpoint_every or s.checkpoint_dir is None:
            return
        if (step + 1) % s.checkpoint_every:
            return
        assert self._tracked is not None
        path = s.checkpoint_dir / f"step-{step:08d}.pt"
        self._tracked.save_checkpoint(path, step)
        for old in sorted(s.checkpoint_dir.glob("step-*.pt"))[:-2]:
            old.unlink(missing_ok=True)
        self._send({"t": "checkpoint", "step": step, "path": str(path)})

    def _finish(self) -> None:
        assert self._tracked is not None
        digest = self._tracked.snapshot(self.completed_step).digest()
        self._send({"t": "done", "step": self.completed_step, "digest": digest})
        # Wait for the coordinator's word: leaving before every peer has finished the last collective
        # could break theirs.
        self._obey_exit()
        self._finished.set()
        self._drop_group()
        self._sock.close()

    def _obey_exit(self) -> None:
        while True:
            msg = self._inbox.get(timeout=self.settings.recovery_timeout)
            if msg["t"] == "exit":
                return

    def _exit(self, code: int, reason: str) -> None:
        if reason:
            print(f"torchpass: {reason}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)

    # --- control channel -----------------------------------------------------------------------------

    def _buckets(self) -> list[list[torch.Tensor]]:
        if self._grad_buckets is None:
            assert self._tracked is not None
            params = [p for p in self._tracked.model.parameters() if p.requires_grad]
            self._grad_buckets = _bucketize(params, 25 * 2**20)
        return [[p for p in b if p.grad is not None] for b in self._grad_buckets]

    def _send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            protocol.send_frame(self._sock, msg)

    def _read_loop(self) -> None:
        try:
            while True:
                msg = protocol.recv_frame(self._sock)
                # A non-zero exit is obeyed at once, even while the main thread is blocked in a collective.
                if msg["t"] == "exit" and (int(msg.get("code", 0)) != 0 or self.is_spare):
                    self._exit(int(msg.get("code", 0)), msg.get("reason", ""))
                self._inbox.put(msg)
        except (OSError, ConnectionError, protocol.ProtocolError):
            if not self._finished.is_set():
                self._exit(_EXIT_COORDINATOR_LOST, "lost the connection to the job coordinator; stopping")

    def _heartbeat_loop(self) -> None:
        while not self._finished.wait(self.settings.heartbeat_interval):
            try:
                self._send({"t": "hb"})
            except OSError:
                return


def _bucketize(params: Sequence[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        n = p.numel() * p.element_size()
        if buckets[-1] and size + n > cap_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += n
    return buckets


def _pick_device(name: str, local_rank: int) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")
