"""The job's rendezvous store (`job_agent.rank.store`): what each generation's process group forms
through, served only to peers that prove the job's secret. Real sockets and the real protocol; the
groups themselves form over it in every integration test (real gloo ranks)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from job_agent import wire
from job_agent.coordinator import store_server
from job_agent.coordinator.store_server import StoreServer
from job_agent.rank.store import RendezvousStore
from job_agent.wire import protocol
from job_agent.wire.store import StoreRequest
from tests.unit.job_driver import poll_until

SECRET = b"s" * 32
WAIT = timedelta(seconds=5)


@pytest.fixture
def server() -> Iterator[StoreServer]:
    s = StoreServer(SECRET, "127.0.0.1")
    yield s
    s.close()


def test_every_operation_a_group_needs_round_trips(server: StoreServer) -> None:
    client = RendezvousStore("127.0.0.1", server.port, SECRET, WAIT)
    client.set("gen0/a", b"\x00\xffaddress")
    assert client.get("gen0/a") == b"\x00\xffaddress" and client.check(["gen0/a"])
    assert not client.check(["gen0/a", "gen0/b"])
    assert client.add("gen0/n", 2) == 2 and client.add("gen0/n", 3) == 5
    assert client.compare_set("gen0/c", "", "first") == b"first"
    assert client.compare_set("gen0/c", "wrong", "second") == b"first"
    assert client.compare_set("gen0/c", "first", "second") == b"second"
    assert client.num_keys() == 3
    assert client.delete_key("gen0/a") and not client.delete_key("gen0/a")
    with pytest.raises(dist.DistStoreError, match="timed out"):
        client.wait(["gen0/never"], timedelta(seconds=0.2))
    # Through torch's own PrefixStore, as init_process_group uses it.
    prefixed = dist.PrefixStore("gen1", client)
    prefixed.set("k", "v")
    assert client.get("gen1/k") == b"v" and prefixed.get("k") == b"v"
    client.close()


def test_old_generations_keys_are_dropped(server: StoreServer) -> None:
    client = RendezvousStore("127.0.0.1", server.port, SECRET, WAIT)
    for g in range(4):
        client.set(f"gen{g}/0", b"x")
    client.set("other", b"y")
    assert server.drop_before("gen", 2) == 2
    assert not client.check(["gen0/0"]) and not client.check(["gen1/0"])
    assert client.check(["gen2/0", "gen3/0", "other"])
    client.close()


def test_a_rank_waiting_in_an_abandoned_generation_gives_up_at_once(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank lost as a recovery's group forms leaves the others polling for its keys; the
    coordinator abandons that generation and they stop now, not at the store's timeout (60 s in a
    job, which once cost the whole world), while the next generation forms as usual."""
    client = RendezvousStore("127.0.0.1", server.port, SECRET, timedelta(seconds=60))
    failed: list[BaseException] = []
    checks: list[list[str]] = []
    check = client.check

    def counted(keys: list[str]) -> bool:
        checks.append(keys)
        return check(keys)

    monkeypatch.setattr(client, "check", counted)

    def wait() -> None:
        try:
            client.wait(["gen3/never"])
        except dist.DistStoreError as e:
            failed.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    poll_until(lambda: len(checks) >= 2, "the waiter to ask the store for its key twice")
    assert waiter.is_alive() and not failed  # still waiting: nothing refused before the abandon
    server.abandon("gen", 3)
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    # The abandon's own error, not the store's timeout ("timed out after 60 s waiting for store
    # keys").
    assert "generation 3 was abandoned" in str(failed[0])
    with pytest.raises(dist.DistStoreError, match="abandoned"):
        client.set("gen3/late", b"x")
    client.set("gen4/0", b"x")
    assert client.get("gen4/0") == b"x" and client.check(["gen4/0"])
    client.close()


def test_a_peer_without_the_secret_reads_and_writes_nothing(server: StoreServer) -> None:
    """The threat: torch's TCPStore, which the coordinator ran before, serves any client. Here a
    peer with the wrong secret is refused at the handshake, one that skips it (torch's own TCPStore
    client, raw frames, garbage) is dropped, and the store still serves the job."""
    owner = RendezvousStore("127.0.0.1", server.port, SECRET, WAIT)
    owner.set("gen0/0", b"the real address")
    with pytest.raises((protocol.AuthError, ConnectionError)):
        RendezvousStore("127.0.0.1", server.port, b"w" * 32, WAIT)
    with pytest.raises((dist.DistStoreError, RuntimeError)):
        intruder = dist.TCPStore(
            "127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=1)
        )
        intruder.set("gen0/0", "an attacker's address")
    with socket.create_connection(("127.0.0.1", server.port)) as raw:  # a frame, no handshake
        body = StoreRequest(op="set", keys=("gen0/0",), value="QQ==").model_dump_json().encode()
        raw.sendall(len(body).to_bytes(4, "big") + body)
        raw.settimeout(5)
        got = b""
        with contextlib.suppress(ConnectionResetError):  # closed with our bytes unread: a reset
            while chunk := raw.recv(4096):
                got += chunk
        assert len(got) == 16  # the server's challenge, then the connection ends: no answer
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(b"\x00garbage")
    assert owner.get("gen0/0") == b"the real address" and owner.num_keys() == 1
    owner.close()


def test_bad_requests_get_a_typed_error_and_the_limits_hold(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = RendezvousStore("127.0.0.1", server.port, SECRET, WAIT)
    client.set("gen0/n", b"not a number")
    with pytest.raises(dist.DistStoreError, match="store add"):
        client.add("gen0/n", 1)
    assert isinstance(server.answer(wire.encode(wire.StatusRequest())), wire.Error)
    assert isinstance(server.answer(b"\x00 not json"), wire.Error)
    bad = StoreRequest(op="set", keys=("k",), value="!!not base64!!")
    assert isinstance(server.answer(bad.model_dump_json().encode()), wire.Error)
    with pytest.raises(ValueError, match="exactly one key"):
        StoreRequest(op="get", keys=())
    monkeypatch.setattr(store_server, "MAX_KEYS", 2)
    client.set("gen0/other", b"x")
    with pytest.raises(dist.DistStoreError, match="limit of 2 keys"):
        client.set("gen0/third", b"x")
    monkeypatch.setattr(store_server, "MAX_BYTES", 100)
    with pytest.raises(dist.DistStoreError, match="limit of 100 bytes"):
        client.set("gen0/other", b"x" * 200)
    client.close()
