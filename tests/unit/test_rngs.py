"""The script's own random streams as tracked state: each kind's position moves with a checkpoint
(and so with a transfer, which flattens the same way), a stream at another position digests
differently, and what is neither state nor a stream is refused with the fix."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from job_agent.rank.rngs import as_stateful, seed_globals
from job_agent.rank.state import TrackedState

STREAMS: dict[str, tuple[Callable[[int], Any], Callable[[Any], float]]] = {
    "torch.Generator": (
        lambda s: torch.Generator().manual_seed(s),
        lambda g: torch.rand(1, generator=g).item(),
    ),
    "random.Random": (random.Random, lambda r: r.random()),
    "numpy Generator (PCG64)": (np.random.default_rng, lambda g: float(g.random())),
    "numpy Generator (MT19937)": (
        lambda s: np.random.Generator(np.random.MT19937(s)),
        lambda g: float(g.random()),
    ),
    "numpy RandomState": (np.random.RandomState, lambda r: float(r.rand())),
    # Philox's key and SFC64's state hold uint64 words over 2**63, which no signed integer holds.
    "numpy Generator (Philox)": (
        lambda s: np.random.Generator(np.random.Philox(s)),
        lambda g: float(g.random()),
    ),
    "numpy Generator (SFC64)": (
        lambda s: np.random.Generator(np.random.SFC64(s)),
        lambda g: float(g.random()),
    ),
    "numpy Generator (PCG64DXSM)": (
        lambda s: np.random.Generator(np.random.PCG64DXSM(s)),
        lambda g: float(g.random()),
    ),
}


def _state(stream: Any) -> TrackedState:
    torch.manual_seed(0)
    return TrackedState(torch.nn.Linear(4, 1), None, {"rng": as_stateful("rng", stream)})


@pytest.mark.parametrize("kind", sorted(STREAMS))
def test_a_streams_position_moves_with_the_state(kind: str, tmp_path: Path) -> None:
    make, draw = STREAMS[kind]
    donor_stream = make(1)
    for _ in range(5):
        draw(donor_stream)
    donor = _state(donor_stream)
    donor.save_checkpoint(tmp_path / "c.pt", 7)
    receiver_stream = make(2)
    receiver = _state(receiver_stream)
    # another position: other bytes
    assert receiver.snapshot(7).digest() != donor.snapshot(7).digest()
    assert receiver.load_checkpoint(tmp_path / "c.pt") == 7
    assert receiver.snapshot(7).digest() == donor.snapshot(7).digest()
    assert [draw(receiver_stream) for _ in range(3)] == [draw(donor_stream) for _ in range(3)]


def test_what_is_neither_state_nor_a_stream_is_refused_with_the_fix() -> None:
    with pytest.raises(
        TypeError, match=r"track\(\.\.\., counter=\.\.\.\) got a int: an extra needs state_dict"
    ):
        as_stateful("counter", 3)
    for unkept in (random.SystemRandom(), np.random.SeedSequence(1)):  # no position to keep
        with pytest.raises(TypeError, match="an extra needs state_dict"):
            as_stateful("r", unkept)


def test_the_global_streams_draw_the_same_for_the_same_seed() -> None:
    def draws() -> tuple[float, float, float]:
        return torch.rand(1).item(), random.random(), float(np.random.rand())

    seed_globals(11)
    first = draws()
    seed_globals(12)
    assert draws() != first
    seed_globals(11)
    assert draws() == first


@pytest.mark.parametrize("kind", sorted(STREAMS))
def test_a_step_done_again_draws_what_its_failed_try_drew(kind: str) -> None:
    """A failed try draws before its collective fails: the step done again starts from the position
    the stream had as the step began (without the rewind it draws the next numbers)."""
    make, draw = STREAMS[kind]
    stream = make(3)
    state = _state(stream)
    state.buffers.keep()  # the step begins
    tried = [draw(stream) for _ in range(2)]
    state.buffers.restore()  # the step is done again
    assert [draw(stream) for _ in range(2)] == tried
    assert [draw(stream) for _ in range(2)] != tried
