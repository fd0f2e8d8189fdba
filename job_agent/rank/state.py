"""A rank's training state: what the agent tracks (model, optimizer, extras), what a step done again
starts from, and its checkpoints. As it travels between ranks it is a `Snapshot`
(`job_agent.transfer.snapshot`)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from job_agent import wire
from job_agent.transfer.snapshot import (
    Snapshot,
    StateMismatch,
    dtensor_type,
    flatten,
    unflatten,
)
from job_agent.wire.stream import TensorEntry


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


def _copied(value: Any) -> Any:
    """A copy nothing the script does next can change: tensors cloned (detached), containers
    rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple | list):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return copy.deepcopy(value)


class Carried:
    """State a script carries from one step to the next on this rank alone (an RNN's hidden state,
    a prefetched batch, an accumulator), declared with `RankAgent.carry`. The script reads and sets
    `value`; the agent keeps it as each step begins, so a step done again starts from it, not from
    what the failed try left. No replica holds it: a process that takes a lost rank's slot starts
    from the value it was declared with, and the incident says the run differs from one that never
    failed (it is not recorded as live)."""

    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value
        self._kept = _copied(value)

    def keep(self) -> None:
        self._kept = _copied(self.value)

    def restore(self) -> None:
        self.value = _copied(self._kept)


class StepBuffers:
    """The model's persistent buffers as a step began (BatchNorm's running statistics and counter),
    the positions of the script's own random streams, and which parameters had no gradient: a
    forward and a backward change them before the step's update, so a step done again must start
    from these, not from what the failed try left (which would count its batch twice, draw other
    numbers, or add its gradients to the failed try's where the script clears them as a step ends,
    as nanoGPT does)."""

    def __init__(self, model: torch.nn.Module, streams: Sequence[Stateful] = ()) -> None:
        persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
        self._buffers = [b for b in model.buffers() if id(b) in persistent]
        self._saved = [torch.empty_like(b) for b in self._buffers]
        self._streams = list(streams)
        self._positions: list[dict[str, Any]] = []
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._no_grad: list[bool] = []
        self.carried: list[Carried] = []

    def keep(self) -> None:
        for c in self.carried:
            c.keep()
        for saved, b in zip(self._saved, self._buffers, strict=True):
            saved.copy_(b)
        self._positions = [s.state_dict() for s in self._streams]
        self._no_grad = [p.grad is None for p in self._params]

    def restore(self) -> None:
        with torch.no_grad():
            for saved, b in zip(self._saved, self._buffers, strict=True):
                b.copy_(saved)
            # A gradient there as the step began is one the script clears before its backward, or
            # the zeros it left clearing them in place: zeros again either way.
            for p, none in zip(self._params, self._no_grad, strict=True):
                if none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        for stream, position in zip(self._streams, self._positions, strict=True):
            stream.load_state_dict(position)
        for c in self.carried:
            c.restore()


class TrackedState:
    """The state a rank agent keeps consistent across migrations."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extras: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extras = dict(extras or {})
        streams = [v for v in self.extras.values() if getattr(v, "rewound_each_step", False)]
        self.buffers = StepBuffers(model, streams)
        # path -> this rank's DTensor there, as of the last snapshot
        self._sharded: dict[str, Any] = {}
        self.stepped = False  # the optimizer stepped in the step in flight: its update is applied
        if optimizer is not None:
            optimizer.register_step_post_hook(self._on_optimizer_step)

    def _on_optimizer_step(self, *_: object) -> None:
        self.stepped = True

    def begin_step(self) -> None:
        """A step begins: what a step done again starts from is kept, and the optimizer has not
        stepped."""
        self.buffers.keep()
        self.stepped = False

    def snapshot(self, step: int) -> Snapshot:
        tensors: list[tuple[str, torch.Tensor]] = []
        sharded = self._sharded = {}
        header = {
            "step": step,
            "model": flatten(self.model.state_dict(), "model", tensors, sharded),
            "optimizer": flatten(self.optimizer.state_dict(), "optimizer", tensors, sharded)
            if self.optimizer is not None
            else None,
            "extras": {
                k: flatten(v.state_dict(), f"extras.{k}", tensors, sharded)
                for k, v in self.extras.items()
            },
        }
        return Snapshot(header, tensors)

    def _as_held(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Received or restored local tensors, each made the DTensor this rank's own state has
        there."""
        self.snapshot(-1)  # fills self._sharded
        out = dict(tensors)
        for path, own in self._sharded.items():
            if path in out:
                out[path] = type(own).from_local(
                    out[path],
                    own.device_mesh,
                    own.placements,
                    run_check=False,
                    shape=own.shape,
                    stride=own.stride(),
                )
        return out

    def receive_targets(self, manifest: Sequence[TensorEntry]) -> list[torch.Tensor]:
        """Tensors to receive into, in manifest order: our own where they match, new ones
        otherwise."""
        own = dict(self.snapshot(-1).tensors)
        targets = []
        for entry in manifest:
            dtype = getattr(torch, entry.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise StateMismatch(f"unknown dtype {entry.dtype!r} at {entry.path}")
            mine = own.get(entry.path)
            if mine is not None and mine.dtype == dtype and tuple(mine.shape) == entry.shape:
                targets.append(mine)
            else:
                device = mine.device if mine is not None else torch.device("cpu")
                targets.append(torch.empty(entry.shape, dtype=dtype, device=device))
        return targets

    def layout(self) -> wire.ShardLayout:
        """Which shard of the model this rank holds, from its own parameters: the names, dtypes and
        shapes of every entry of the model's state, and for a DTensor its placements and this rank's
        coordinate on the sharded mesh dimensions. Ranks that hold the same shard are replicas of
        each other."""
        dtensor = dtensor_type()
        entries: list[list[Any]] = []
        sharded = False
        for name, t in self.model.state_dict().items():
            if not isinstance(t, torch.Tensor):
                continue
            entry: list[Any] = [name, str(t.dtype), list(t.shape)]
            if dtensor is not None and isinstance(t, dtensor):
                coord = t.device_mesh.get_coordinate() or []
                shard_dims = [i for i, p in enumerate(t.placements) if p.is_shard()]
                sharded = sharded or bool(shard_dims)
                entry += [str(t.placements), [coord[i] for i in shard_dims if i < len(coord)]]
            entries.append(entry)
        key = hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()[:16]
        return wire.ShardLayout(
            shard=key,
            parallelism="sharded" if sharded else "data_parallel",
            carried=tuple(c.name for c in self.buffers.carried),
        )

    def load(self, header: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> int:
        """Install a received or restored state; returns its step."""
        tensors = self._as_held(tensors)
        try:
            self.model.load_state_dict(unflatten(header["model"], tensors))
            if self.optimizer is not None and header["optimizer"] is not None:
                self.optimizer.load_state_dict(unflatten(header["optimizer"], tensors))
            for name, obj in self.extras.items():
                obj.load_state_dict(unflatten(header["extras"][name], tensors))
        except (KeyError, RuntimeError, ValueError) as e:
            raise StateMismatch(f"received state does not fit this rank: {e}") from e
        return int(header["step"])

    def warm(self) -> None:
        """Create the optimizer's lazily built state now, so a spare can receive into it in place.

        Only for spares: it takes one optimizer step on zero gradients, and everything it touches is
        overwritten by the transfer.
        """
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # --- checkpoints: the fallback when live migration is impossible
    # ---------------------------------

    def save_checkpoint(self, path: Path, step: int) -> None:
        """Atomically (a crash mid-write never leaves a torn checkpoint), readable by its owner
        only: it holds the model and the optimizer."""
        snap = self.snapshot(step)
        tmp = path.with_suffix(".tmp")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            torch.save({"header": snap.header, "tensors": dict(snap.tensors)}, f)
        os.replace(tmp, path)

    def save_rotated(self, directory: Path, step: int, keep: int, slot: int = 0) -> Path:
        """Save step `step` in `directory`, keeping the latest `keep` checkpoints there. A sharded
        job's ranks each save their own shard, beside rank 0's file (`shard_file`)."""
        path = shard_file(directory / f"step-{step:08d}.pt", slot)
        self.save_checkpoint(path, step)
        mine = sorted(p for p in directory.glob("step-*.pt") if _slot_of(p) == slot)
        for old in mine[:-keep]:
            old.unlink(missing_ok=True)
        return path

    def load_checkpoint(self, path: Path) -> int:
        data = torch.load(path, weights_only=True, map_location="cpu")
        return self.load(data["header"], data["tensors"])


def shard_file(path: Path, slot: int) -> Path:
    """Where rank `slot` of a sharded job keeps its shard of the checkpoint whose rank-0 file is
    `path`."""
    return path.with_name(f"{path.name.removesuffix('.pt')}.rank-{slot}.pt") if slot else path


def _slot_of(path: Path) -> int:
    _, _, rank = path.name.removesuffix(".pt").partition(".rank-")
    return int(rank) if rank.isdigit() else 0
