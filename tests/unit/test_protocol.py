"""The control channel's framing and mutual authentication, over real loopback sockets."""

from __future__ import annotations

import socket
import threading

import pytest

from job_agent import wire
from job_agent.wire import protocol


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def test_frames_round_trip() -> None:
    a, b = _pair()
    with a, b:
        protocol.send_frame(a, wire.Step(k=7))
        assert protocol.recv_frame(b) == wire.Step(k=7)


def test_a_frame_that_is_not_json_is_a_protocol_error() -> None:
    a, b = _pair()
    with a, b:
        a.sendall(b"\x00\x00\x00\x03abc")
        with pytest.raises(protocol.ProtocolError, match="Invalid JSON"):
            protocol.recv_frame(b)


def test_an_oversized_frame_is_refused_before_reading_it() -> None:
    a, b = _pair()
    with a, b:
        a.sendall((protocol.MAX_FRAME + 1).to_bytes(4, "big"))
        with pytest.raises(protocol.ProtocolError, match="exceeds"):
            protocol.recv_frame(b)


def test_a_frame_without_type_is_refused() -> None:
    a, b = _pair()
    with a, b:
        a.sendall(b'\x00\x00\x00\x07{"k":1}')
        with pytest.raises(protocol.ProtocolError, match="'t'"):
            protocol.recv_frame(b)


def _handshake(
    server_secret: bytes, client_secret: bytes
) -> tuple[BaseException | None, BaseException | None]:
    a, b = _pair()
    errors: dict[str, BaseException | None] = {"server": None, "client": None}

    def server() -> None:
        try:
            protocol.authenticate_server(a, server_secret)
        except (protocol.AuthError, ConnectionError, OSError) as e:
            errors["server"] = e
            a.close()

    t = threading.Thread(target=server)
    t.start()
    try:
        protocol.authenticate_client(b, client_secret)
    except (protocol.AuthError, ConnectionError, OSError) as e:
        errors["client"] = e
    t.join(5)
    a.close()
    b.close()
    return errors["server"], errors["client"]


def test_peers_with_the_same_secret_authenticate_each_other() -> None:
    assert _handshake(b"s" * 32, b"s" * 32) == (None, None)


def test_a_peer_with_the_wrong_secret_is_refused() -> None:
    server_err, client_err = _handshake(b"s" * 32, b"x" * 32)
    assert isinstance(server_err, protocol.AuthError)
    assert client_err is not None  # the server hangs up instead of proving anything


def _authenticated() -> tuple[socket.socket, socket.socket]:
    """(server side, client side) of a connection that passed the handshake."""
    a, b = _pair()
    t = threading.Thread(target=protocol.authenticate_server, args=(a, b"s" * 32))
    t.start()
    protocol.authenticate_client(b, b"s" * 32)
    t.join(5)
    return a, b


def test_authenticated_frames_round_trip_both_ways() -> None:
    a, b = _authenticated()
    with a, b:
        for k in range(3):
            protocol.send_frame(b, wire.Step(k=k))
            protocol.send_frame(a, wire.Freeze())
            assert protocol.recv_frame(a) == wire.Step(k=k)
            assert protocol.recv_frame(b) == wire.Freeze()


def _raw(frame: wire.Frame, tag: bytes) -> bytes:
    body = wire.encode(frame)
    return len(body).to_bytes(4, "big") + body + tag


def test_a_frame_injected_after_the_handshake_fails_its_tag() -> None:
    """Someone who can write into the connection but lacks its key: the frame is refused."""
    a, b = _authenticated()
    with a, b:
        b.sendall(_raw(wire.Drain(slot=1), b"\0" * 32))
        with pytest.raises(protocol.AuthError, match="failed its tag"):
            protocol.recv_frame(a)


def test_a_frame_altered_in_flight_fails_its_tag() -> None:
    a, b = _authenticated()
    with a, b:
        protocol.send_frame(b, wire.Inject(action=wire.InjectAction.KILL, slot=1))
        sent = a.recv(65536)
        altered = sent.replace(b'"slot":1', b'"slot":2')
        assert altered != sent
        c, d = _pair()  # deliver the altered bytes through a socket that shares the session's key
        with c, d:
            protocol._sessions[d] = protocol._sessions[a]
            c.sendall(altered)
            with pytest.raises(protocol.AuthError, match="failed its tag"):
                protocol.recv_frame(d)


def test_a_replayed_frame_fails_its_tag() -> None:
    a, b = _authenticated()
    with a, b:
        protocol.send_frame(b, wire.Drain(slot=1))
        sent = a.recv(65536)
        b.sendall(sent)  # the genuine bytes again, as a replay
        b.sendall(sent)
        assert protocol.recv_frame(a) == wire.Drain(slot=1)
        with pytest.raises(protocol.AuthError, match="frame 1 failed its tag"):
            protocol.recv_frame(a)
