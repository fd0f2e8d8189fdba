"""A process's answers to one state-transfer command (`job_agent.coordinator.answers`): each settles
its own transfer's future, once; an answer numbered for another transfer settles nothing."""

from __future__ import annotations

from job_agent import wire
from job_agent.coordinator.answers import TransferAnswers

DIGEST = "d" * 64


def _served(transfer: int) -> wire.Served:
    return wire.Served(digest=DIGEST, step=4, bytes=10, seconds=0.1, transfer=transfer)


async def test_a_donor_listens_then_accounts_for_what_it_served() -> None:
    a = TransferAnswers(3)
    assert not a.listening.done() and a.serving() is None
    serving = wire.Serving(host="10.0.0.2", port=4000, step=4, transfer=3)
    a.take(serving)
    assert a.serving() == serving and not a.account.done()
    a.take(_served(3))
    assert a.served() == _served(3) and a.received() is None and a.failed() is None


async def test_a_late_answer_to_an_earlier_transfer_is_never_taken_for_this_one() -> None:
    """A donor's account of transfer 2 arriving while transfer 3 runs (the plan was re-made around a
    loss) once counted as its answer to 3: matched by number, it answers nothing here."""
    a = TransferAnswers(3)
    a.take(wire.Serving(host="10.0.0.2", port=4000, step=4, transfer=2))
    a.take(_served(2))
    a.take(wire.TransferFailed(error="from before", transfer=2))
    assert not a.listening.done() and not a.account.done()


async def test_a_failure_settles_both_and_the_first_answer_stands() -> None:
    a = TransferAnswers(1)
    a.take(wire.TransferFailed(error="disk full", transfer=1))
    assert a.listening.done() and a.account.done()
    assert a.serving() is None and a.failed() == wire.TransferFailed(error="disk full", transfer=1)
    a.take(_served(1))  # a second answer changes nothing
    assert a.served() is None and a.failed() is not None
