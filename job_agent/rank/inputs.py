"""What each step feeds the tracked model, watched for state the script carries from step to step
without having declared it (`RankAgent.carry`). No replica holds such state, so a migration that
replaces a rank's process, or a step done again, would end elsewhere than the run that never failed
while every replica stays equal to the others (no replica check can see it). Two signs give it away:

- **a tensor the model returned fed back to it in a later step** (an RNN's hidden state under
  truncated back-propagation, detached: the same storage): seen on every rank in the step after,
  failure or not, and reported once (`wire.Carries`);
- **a step done again whose first forward takes other inputs than its first try's did** (a batch
  drawn ahead and advanced by the failed try, a data iterator read in the step): seen by each rank
  that redoes a step after a peer's loss, and reported as the redone step's verdict
  (`wire.Redone`), which the incident waits for.

Storages are held by weak reference (`StorageWeakRef`): nothing the script made is kept alive, and
a storage freed meanwhile is never mistaken for a new one at the same address.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from job_agent import wire

MAX_TENSORS = 64  # tensors looked at in one forward's inputs, or in its outputs
_DEPTH = 4  # how deep into tuples, lists and dicts the inputs and outputs are looked at


def tensors_in(value: Any, depth: int = _DEPTH) -> Iterator[torch.Tensor]:
    """The plain tensors in a forward's arguments or result, in order (nested containers too). A
    tensor subclass (a DTensor) is left alone: comparing one may take a collective."""
    if type(value) is torch.Tensor:
        yield value
    elif depth > 0 and isinstance(value, tuple | list):
        for v in value:
            yield from tensors_in(v, depth - 1)
    elif depth > 0 and isinstance(value, Mapping):
        for v in value.values():
            yield from tensors_in(v, depth - 1)


def _first(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for t in tensors_in(value):
        if len(out) == MAX_TENSORS:
            break
        out.append(t)
    return out


def _storage(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, sparse)
        return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (a NaN equals itself there)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit the same tensors."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
            return False
        with torch.no_grad():
            if not torch.equal(_bits(x), _bits(y)):
                return False
    return True


class InputWatch:
    """Hooks on the tracked model that look at what each step feeds it."""

    def __init__(
        self,
        model: torch.nn.Module,
        send: Callable[[wire.Frame], None],
        declared: Callable[[], list[Any]],
    ) -> None:
        self._send = send
        self._declared = declared  # the values of the state declared with `carry`
        self.step = -1  # the step entered last
        self._redo: int | None = None  # the step being done again, until its verdict is sent
        self._tried: list[torch.Tensor] | None = None  # its first try's first forward's inputs
        self._returned: dict[int, StorageWeakRef] = {}  # what earlier steps' forwards returned
        self._returning: dict[int, StorageWeakRef] = {}  # what this step's forwards returned
        self._skip: set[int] = set()  # storages of the declared carried state
        self._slot = -1
        self._inputs_seen = True  # until a step begins: a forward outside steps is not looked at
        self.found: str | None = None  # what was reported as carried, once
        model.register_forward_pre_hook(self._before, with_kwargs=True)
        model.register_forward_hook(self._after, with_kwargs=True)

    def begin(self, k: int, slot: int) -> None:
        """Step `k` begins on rank `slot` (a step done again when it is the one entered last)."""
        self._slot = slot
        if k == self.step:
            self._redo = k
            self._returning = {}
        else:
            self.step, self._redo, self._tried = k, None, None
            self._returned, self._returning = self._returning, {}
        self._inputs_seen = False
        if self.found is None:  # once reported, what a forward returns is no longer looked at
            self._skip = {
                s for v in self._declared() for t in tensors_in(v) if (s := _storage(t)) is not None
            }

    def settle(self) -> None:
        """The step reached its first collective, or its end, with its redo's verdict not yet
        given (no forward of the tracked model came first): it was not looked at."""
        if self._redo is not None:
            self._verdict(None, checked=False)

    def _before(self, module: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._inputs_seen:  # the step's first forward only (micro-batches: the first)
            return
        self._inputs_seen = True
        inputs = _first((args, kwargs))
        if self._redo is not None:
            tried = self._tried
            if tried is None:
                self._verdict(None, checked=False)  # its first try never reached the model
            elif not _same(tried, inputs):
                self._verdict(
                    f"rank {self._slot} did step {self._redo} again from other inputs to its model "
                    "than its first try had (state carried from step to step that the agent was "
                    "not told of: a batch drawn ahead, a data iterator read in the step, a hidden "
                    "state)",
                    checked=True,
                )
            else:
                self._verdict(None, checked=True)
        else:
            self._tried = inputs  # kept (not copied) until the step is over
        if self.found is None:
            self._look_for_returned(inputs)

    def _after(
        self, module: object, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if self.found is not None:
            return
        # an input handed back (a pass-through) is not made by the model: the data's own buffer
        given = {_storage(t) for t in _first((args, kwargs))}
        for t in _first(output):
            s = _storage(t)
            if s is not None and s not in given and s not in self._returning:
                self._returning[s] = StorageWeakRef(t.untyped_storage())

    def _look_for_returned(self, inputs: list[torch.Tensor]) -> None:
        for i, t in enumerate(inputs):
            s = _storage(t)
            if s is None or s in self._skip:
                continue
            held = self._returned.get(s)
            if held is not None and not held.expired():
                self.found = (
                    f"rank {self._slot} fed its model at step {self.step} a tensor its forward "
                    f"returned in an earlier step (input {i}: state carried from step to step, "
                    "as an RNN's hidden state under truncated back-propagation)"
                )
                self._send(wire.Carries(step=self.step, what=self.found))
                return

    def _verdict(self, differs: str | None, checked: bool) -> None:
        assert self._redo is not None
        self._send(wire.Redone(k=self._redo, checked=checked, differs=differs))
        self._redo = None
