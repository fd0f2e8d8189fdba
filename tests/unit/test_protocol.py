"""The control channel's framing and mutual authentication, over real loopback sockets."""

from __future__ import annotations

import socket
import threading

import pytest

from job_agent import protocol, wire


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
