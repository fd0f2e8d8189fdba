"""The striped transfer: a receiver takes disjoint slices of the state from several donors at once.

Real tensors, real sockets, the real protocol. The donors that serve are `StateServer`s; the ones
that misbehave (die mid-slice, stall, have a slice altered on the way) are real sockets speaking the
same protocol through `job_agent.wire.protocol`, each failing in one way a real donor or link does.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from job_agent import wire
from job_agent.rank.state import TrackedState
from job_agent.transfer import receiver
from job_agent.transfer.donor import StateServer, TransferError
from job_agent.transfer.snapshot import state_hash
from job_agent.wire.protocol import ProtocolError, authenticate_server, recv_frame, send_frame
from tests.unit.test_state_transfer import SECRET, WAIT, _at, _fresh, _trained
from torchpass.incident.proof import stripe_problems
from torchpass.incident.steps import ReceiverProof, TransferProof

STEP = 7


@pytest.fixture(autouse=True)
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test models are small: slice them anyway, 1 KiB and up."""
    monkeypatch.setattr(receiver, "MIN_SLICE", 1024)


class _Servers:
    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.results: list[dict[str, Any]] = []

    def real(self, state: TrackedState, receivers: int = 1) -> int:
        server = StateServer(SECRET, "127.0.0.1")
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["digest"] = server.serve(state.snapshot(STEP), receivers, WAIT, lambda n: None)
            except TransferError as e:
                out["error"] = str(e)

        self._start(run)
        self.results.append(out)
        return server.port

    def faulty(self, state: TrackedState, fault: str) -> int:
        """A donor holding `state` that fails its slice: "die" half-way, "stall" after the header,
        or "flip" (one byte of the slice altered after the donor hashed it: what a bad link or NIC
        does)."""
        listener = socket.create_server(("127.0.0.1", 0))
        snap = state.snapshot(STEP)

        def run() -> None:
            conn, _ = listener.accept()
            listener.close()
            with conn:
                authenticate_server(conn, SECRET)
                send_frame(conn, wire.StateHeader(header=snap.header, manifest=snap.manifest()))
                if fault == "stall":
                    time.sleep(3)  # the fault itself: silent after the header, then gone
                    return
                want = recv_frame(conn)
                assert isinstance(want, wire.StateWant)
                data = b"".join(bytes(v) for v in snap.host_range(want.start, want.stop))
                if fault == "die":
                    conn.sendall(data[: len(data) // 2])
                    return
                altered = bytearray(data)
                altered[len(data) // 3] ^= 0x01
                conn.sendall(bytes(altered))
                send_frame(
                    conn,
                    wire.StateEnd(digest=snap.digest(), slice_digest=state_hash(data).hexdigest()),
                )
                with contextlib.suppress(OSError, ProtocolError):
                    recv_frame(conn)  # the receiver drops this donor: its session just ends

        self._start(run)
        return int(listener.getsockname()[1])

    def _start(self, run: Any) -> None:
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(10)


@pytest.fixture
def servers() -> Iterator[_Servers]:
    s = _Servers()
    yield s
    s.join()


def _proof(stats: Any, donor: TrackedState) -> TransferProof:
    digest = donor.snapshot(STEP).digest()
    receiver = ReceiverProof(
        slot=3,
        stream_digest=stats.digest,
        installed_digest=stats.digest,
        installed_step=stats.step,
        bytes=stats.nbytes,
        stripes=stats.stripes,
        dropped=stats.dropped,
    )
    return TransferProof(
        donor_slot=0,
        receiver_slots=(3,),
        donor_digest=digest,
        step_before=STEP,
        step_after=STEP,
        bytes=stats.nbytes,
        seconds=0.1,
        receivers=(receiver,),
        receiver_digests={3: stats.digest},
        donor_digests={0: digest, 1: digest, 2: digest},
    )


def test_three_donors_each_send_one_slice_and_the_state_is_theirs_bit_for_bit(
    servers: _Servers,
) -> None:
    donor = _trained(0, width=64)
    ports = [servers.real(donor) for _ in range(3)]
    spare = _fresh(1, width=64)
    stats = receiver.receive_state(spare, _at(*ports), SECRET, WAIT)
    servers.join()
    assert (
        stats.step == STEP
        and stats.digest == donor.snapshot(STEP).digest() == spare.snapshot(STEP).digest()
    )
    assert [s.donor for s in stats.stripes] == [0, 1, 2] and stats.dropped == ()
    assert stats.stripes[0].start == 0 and stats.stripes[-1].stop == stats.nbytes
    assert all(r.get("digest") == stats.digest for r in servers.results)
    assert stripe_problems(_proof(stats, donor), _proof(stats, donor).receivers[0]) == []


@pytest.mark.parametrize("fault", ["die", "stall", "flip"])
def test_a_donor_failing_its_slice_is_dropped_and_another_sends_it(
    servers: _Servers, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    monkeypatch.setattr(receiver, "STALL", timedelta(seconds=1))
    donor = _trained(0, width=64)
    ports = [servers.real(donor), servers.faulty(donor, fault), servers.real(donor)]
    spare = _fresh(1, width=64)
    stats = receiver.receive_state(spare, _at(*ports), SECRET, WAIT)
    assert stats.digest == donor.snapshot(STEP).digest() == spare.snapshot(STEP).digest()
    assert stats.dropped == (1,)
    # slice 1 came from 0 or 2
    assert len(stats.stripes) == 3 and 1 not in {s.donor for s in stats.stripes}
    assert stripe_problems(_proof(stats, donor), _proof(stats, donor).receivers[0]) == []


def test_a_slice_no_donor_can_send_fails_the_transfer_and_nothing_is_installed(
    servers: _Servers,
) -> None:
    donor = _trained(0, width=64)
    ports = [servers.faulty(donor, "die"), servers.faulty(donor, "flip")]
    spare = _fresh(1, width=64)
    sched_before = spare.extras["sched"].state_dict()
    with pytest.raises(TransferError, match="could not be had from any donor"):
        receiver.receive_state(spare, _at(*ports), SECRET, WAIT)
    assert spare.extras["sched"].state_dict() == sched_before  # never loaded


def test_replicas_that_differ_are_never_mixed(servers: _Servers) -> None:
    ports = [servers.real(_trained(0, width=64)), servers.real(_trained(5, width=64))]
    with pytest.raises(TransferError, match="donors' states differ"):
        receiver.receive_state(_fresh(1, width=64), _at(*ports), SECRET, WAIT)


def test_two_receivers_take_slices_of_the_same_donors_at_once(servers: _Servers) -> None:
    """Each donor serves both receivers concurrently: one waiting on the other can never
    deadlock."""
    donor = _trained(0, width=64)
    ports = [servers.real(donor, receivers=2) for _ in range(2)]
    got: dict[int, str] = {}

    def one(i: int) -> None:
        got[i] = receiver.receive_state(_fresh(i, width=64), _at(*ports), SECRET, WAIT).digest

    threads = [threading.Thread(target=one, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    servers.join()
    assert got == {1: donor.snapshot(STEP).digest(), 2: donor.snapshot(STEP).digest()}


def test_the_proof_check_fails_on_a_gap_an_altered_slice_and_a_stranger(servers: _Servers) -> None:
    donor = _trained(0, width=64)
    ports = [servers.real(donor) for _ in range(2)]
    stats = receiver.receive_state(_fresh(1, width=64), _at(*ports), SECRET, WAIT)
    proof = _proof(stats, donor)
    first, second = proof.receivers[0].stripes
    cases = {
        "gap": (second,),
        "hashes to": (first.model_copy(update={"digest": "0" * 64}), second),
        "no donor of this recovery": (first, second.model_copy(update={"donor": 9})),
        "not the donor's state": (first, second.model_copy(update={"donor_digest": "f" * 64})),
    }
    for why, bad in cases.items():
        r = proof.receivers[0].model_copy(update={"stripes": bad})
        assert any(why in p for p in stripe_problems(proof, r)), why
