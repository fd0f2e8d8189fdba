"""Random streams a script keeps of its own, made state the agent tracks, and the global streams
seeded for each step.

The agent seeds the process-wide streams (torch's, Python's `random` and numpy's legacy global one)
from (seed, step, rank) as each step begins, so a redone step and a spare draw what the lost rank
would have. A stream the script holds itself (a `torch.Generator` for augmentation, a
`random.Random`, a numpy `Generator` or `RandomState`) is passed to `track()` like any extra: its
position then moves with the rest of the state, and is rewound to where it stood as the step began
when a step is done again (the failed try drew from it before its collective failed).
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

from job_agent.rank.state import Stateful


def seed_globals(seed: int) -> None:
    """Seed torch's, Python's and (if the script imported it) numpy's global random streams."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


class GlobalDraws:
    """Where the global streams stood at a moment, to tell whether the script has drawn from them
    since."""

    def __init__(self) -> None:
        self._at = _positions()

    def drawn(self) -> list[str]:
        """The global streams drawn from since (or seeded anew)."""
        now = _positions()
        return [
            name
            for name, state in now.items()
            if name in self._at and not _same(state, self._at[name])
        ]


def _positions() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = numpy.random.get_state()
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):  # numpy's: (name, key array, position, ...)
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") and hasattr(a, "tolist"):  # a numpy array
        return bool(a.shape == b.shape and (a == b).all())
    return bool(a == b)


def as_stateful(name: str, obj: Any) -> Stateful:
    """`obj` as tracked state: as it is when it has `state_dict`/`load_state_dict`, else wrapped
    when it is a random stream. Anything else is refused with the fix, before training starts."""
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return obj  # type: ignore[no-any-return,unused-ignore]
    stream: _TorchStream | _PythonStream | _NumpyStream | None = None
    if isinstance(obj, torch.Generator):
        stream = _TorchStream(obj)
    elif isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        stream = _PythonStream(obj)
    elif type(obj).__module__.startswith("numpy.random") and (
        hasattr(obj, "bit_generator") or hasattr(obj, "get_state")
    ):
        stream = _NumpyStream(obj)
    if stream is not None:
        try:
            stream.load_state_dict(stream.state_dict())  # what cannot be read back is refused now
        except Exception as e:
            raise TypeError(f"track(..., {name}=...): its state cannot be kept: {e}") from e
        return stream
    raise TypeError(
        f"track(..., {name}=...) got a {type(obj).__name__}: an extra needs state_dict() and "
        "load_state_dict() (or is a torch.Generator, random.Random, numpy Generator or RandomState)"
    )


class _TorchStream:
    rewound_each_step = True  # drawn from before the step's collective

    def __init__(self, g: torch.Generator) -> None:
        self.g = g

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.g.get_state()}

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.g.set_state(state["state"].cpu())


class _PythonStream:
    rewound_each_step = True  # drawn from before the step's collective

    def __init__(self, r: random.Random) -> None:
        self.r = r

    def state_dict(self) -> dict[str, Any]:
        version, words, gauss = self.r.getstate()
        return {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss}

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        self.r.setstate((state["version"], tuple(state["words"].tolist()), state["gauss"]))


class _NumpyStream:
    """A numpy `Generator` (its bit generator's state) or a legacy `RandomState`."""

    rewound_each_step = True

    def __init__(self, r: Any) -> None:
        self.r = r
        self.legacy = not hasattr(r, "bit_generator")

    def state_dict(self) -> dict[str, Any]:
        state = self.r.get_state(legacy=False) if self.legacy else self.r.bit_generator.state
        return {"state": _plain(state)}

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        import numpy

        held = _arrays(state["state"], numpy)
        if self.legacy:
            self.r.set_state(held)
        else:
            self.r.bit_generator.state = held


def _plain(obj: Any) -> Any:
    """numpy's state with its arrays as tensors of their bytes (a uint64 word over 2**63, as
    Philox's key holds, fits no signed integer type: the bytes are kept as they are, with the
    dtype)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if hasattr(obj, "dtype") and getattr(obj, "shape", None) == ():  # a numpy scalar
        return obj.item()
    if hasattr(obj, "tobytes") and hasattr(obj, "dtype"):
        raw = (
            torch.frombuffer(bytearray(obj.tobytes()), dtype=torch.uint8)
            if obj.size
            else torch.empty(0)
        )
        return {"array": raw.to(torch.uint8), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    return obj


def _arrays(obj: Any, numpy: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"array", "dtype", "shape"}:
            raw = obj["array"].numpy().tobytes()
            return numpy.frombuffer(raw, dtype=obj["dtype"]).reshape(obj["shape"]).copy()
        return {k: _arrays(v, numpy) for k, v in obj.items()}
    return obj
