"""State a script carries from step to step without declaring it, as the agent's hooks on the
tracked model see it (`job_agent.rank.inputs`): a tensor the model returned fed back to it in the
next step (an RNN's hidden state, detached), and a step done again whose model gets other inputs
than its first try (a batch drawn ahead, an iterator read in the step). Each sign is shown both
ways: what a script that carries nothing does is never taken for it."""

from __future__ import annotations

from typing import Any

import torch

from job_agent import wire
from job_agent.rank.inputs import InputWatch


class Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rnn(x, h)


class PassThrough(torch.nn.Module):
    """A model that hands its input back beside its output (for logging)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"out": self.lin(x), "x": x}


def _watch(model: torch.nn.Module, declared: list[Any] | None = None) -> tuple[InputWatch, list]:
    sent: list[wire.Frame] = []
    return InputWatch(model, sent.append, lambda: declared or []), sent


def test_a_hidden_state_fed_back_detached_is_seen_in_the_next_step() -> None:
    model = Recurrent()
    watch, sent = _watch(model)
    h = torch.zeros(1, 2, 4)
    for k in range(3):
        watch.begin(k, slot=1)
        _, h = model(torch.randn(2, 3, 4), h.detach())
    (carries,) = sent  # said once, at step 1
    assert isinstance(carries, wire.Carries) and carries.step == 1
    assert "rank 1" in carries.what and "returned in an earlier step" in carries.what


def test_a_fresh_hidden_state_each_step_carries_nothing() -> None:
    model = Recurrent()
    watch, sent = _watch(model)
    for k in range(3):
        watch.begin(k, slot=0)
        model(torch.randn(2, 3, 4), torch.zeros(1, 2, 4))
    assert sent == []


def test_declared_state_is_not_reported_again() -> None:
    model = Recurrent()

    class Held:
        value = torch.zeros(1, 2, 4)

    held = Held()
    watch, sent = _watch(model)
    watch._declared = lambda: [held.value]
    for k in range(3):
        watch.begin(k, slot=0)
        _, held.value = model(torch.randn(2, 3, 4), held.value.detach())
    assert sent == []


def test_an_input_handed_back_and_refilled_in_place_is_not_carried_state() -> None:
    model = PassThrough()
    watch, sent = _watch(model)
    buffer = torch.empty(2, 4)  # a static input buffer, refilled each step
    for k in range(3):
        watch.begin(k, slot=0)
        buffer.copy_(torch.randn(2, 4))
        model(buffer)
    assert sent == []


def test_a_redone_step_that_feeds_other_inputs_says_so() -> None:
    model = PassThrough()
    watch, sent = _watch(model)
    batches = iter([torch.randn(2, 4) for _ in range(3)])  # read in the step: the redo reads on
    watch.begin(0, slot=2)
    model(next(batches))
    watch.begin(0, slot=2)  # a peer was lost: step 0 again
    model(next(batches))
    (verdict,) = sent
    assert isinstance(verdict, wire.Redone) and verdict.k == 0 and verdict.checked
    assert verdict.differs and "rank 2 did step 0 again from other inputs" in verdict.differs


def test_a_redone_step_from_the_same_inputs_is_exact() -> None:
    model = PassThrough()
    watch, sent = _watch(model)
    batch = torch.randn(2, 4)
    watch.begin(5, slot=0)
    model(batch)
    watch.begin(5, slot=0)
    model(batch.clone())  # drawn again, equal
    model(torch.randn(2, 4))  # a later forward of the same step is not compared
    assert sent == [wire.Redone(k=5, checked=True)]


def test_a_redo_whose_first_try_never_reached_the_model_is_unchecked() -> None:
    model = PassThrough()
    watch, sent = _watch(model)
    watch.begin(4, slot=0)  # the first try failed before its forward
    watch.begin(4, slot=0)
    watch.settle()  # the redone step's first collective came first
    watch.settle()
    model(torch.randn(2, 4))
    assert sent == [wire.Redone(k=4, checked=False)]


def test_a_redone_step_fed_the_same_nan_is_exact() -> None:
    model = PassThrough()
    watch, sent = _watch(model)
    batch = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]] * 2)
    watch.begin(3, slot=0)
    model(batch)
    watch.begin(3, slot=0)
    model(batch.clone())
    assert sent == [wire.Redone(k=3, checked=True)]
