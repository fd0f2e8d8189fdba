"""The job's rendezvous store, served by its coordinator: the key-value store each generation's
process group forms through.

torch's `TCPStore` listens on every interface and serves any client: a peer without the job's secret
could read, write and delete the keys a group forms from (and so steer a rank to its own address).
torchpass serves the store itself, over the job's authenticated protocol (`job_agent.wire.protocol`:
the mutual HMAC challenge, then a tag on every frame), bound to the address it is given; each rank's
client is `job_agent.rank.store.RendezvousStore`. Only rendezvous goes through it (a few keys of a
few hundred bytes per rank and generation), so every operation is a plain request and answer.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from datetime import timedelta

from pydantic import ValidationError

from job_agent import wire
from job_agent.wire import protocol
from job_agent.wire.protocol import AuthError, ProtocolError
from job_agent.wire.store import STORE_PREFIX, StoreReply, StoreRequest, b64, send, unb64
from torchpass.errors import ErrorType

AUTH_TIMEOUT = timedelta(seconds=2)  # a peer silent before it proves the secret is dropped
MAX_CONNECTIONS = 256
MAX_KEYS = 100_000
MAX_BYTES = 64 * 2**20


class StoreFull(Exception):
    """The store holds its limit of keys or bytes."""


class StoreServer:
    """Serves one job's store to authenticated peers; listens on `host` (`port`, or an ephemeral
    one)."""

    def __init__(self, secret: bytes, host: str, port: int = 0) -> None:
        self._secret = secret
        self._data: dict[str, bytes] = {}
        self._size = 0
        self._abandoned: set[int] = set()  # generations whose group will never form
        self._lock = threading.Lock()
        self._peers: set[socket.socket] = set()
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(
            target=self._accept_loop, name="torchpass-store-accept", daemon=True
        ).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if len(self._peers) >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._peers.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="torchpass-store", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(AUTH_TIMEOUT.total_seconds())
            # nothing is read or written before this
            protocol.authenticate_server(conn, self._secret)
            conn.settimeout(None)
            while True:
                send(conn, self.answer(protocol.recv_body(conn)))
        except (OSError, ConnectionError, AuthError, ProtocolError):
            # a peer without the secret, or one that left: its connection ends, the store goes on
            pass
        finally:
            with self._lock:
                self._peers.discard(conn)
            conn.close()

    def answer(self, body: bytes) -> StoreReply | wire.Error:
        """The reply to one request (a typed error naming what is wrong for anything but a valid
        one)."""
        try:
            req = StoreRequest.model_validate_json(body)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "request"
            return wire.Error(
                code=ErrorType.BAD_FRAME,
                reason=f"bad store request: {where}: {first['msg']}"[:4000],
            )
        try:
            with self._lock:
                gone = {_generation(k, STORE_PREFIX) for k in req.keys} & self._abandoned
                # its group will never form: a rank waiting in it gives up now, not at a timeout
                if gone:
                    return wire.Error(
                        code=ErrorType.REFUSED, reason=f"generation {min(gone)} was abandoned"
                    )
                return self._apply(req)
        except StoreFull as e:
            return wire.Error(code=ErrorType.REFUSED, reason=str(e))
        except ValueError as e:  # a value that is not base64, an add to a key that holds no number
            return wire.Error(code=ErrorType.BAD_FRAME, reason=f"store {req.op}: {e}")

    def _put(self, key: str, value: bytes) -> None:
        grown = len(value) - len(self._data.get(key, b""))
        if key not in self._data and len(self._data) >= MAX_KEYS:
            raise StoreFull(f"the store holds its limit of {MAX_KEYS} keys")
        if self._size + grown > MAX_BYTES:
            raise StoreFull(f"the store holds its limit of {MAX_BYTES} bytes")
        self._data[key] = value
        self._size += grown

    def _pop(self, key: str) -> bool:
        value = self._data.pop(key, None)
        if value is not None:
            self._size -= len(value)
        return value is not None

    def _apply(self, req: StoreRequest) -> StoreReply:
        key = req.keys[0] if req.keys else ""
        match req.op:
            case "set":
                self._put(key, unb64(req.value))
            case "get":
                value = self._data.get(key)
                return StoreReply(value=None if value is None else b64(value))
            case "add":
                number = int(self._data.get(key, b"0")) + req.amount
                self._put(key, str(number).encode())
                return StoreReply(number=number)
            case "compare_set":
                current = self._data.get(key)
                expected = unb64(req.expected)
                if (current is None and not expected) or current == expected:
                    self._put(key, unb64(req.value))
                return StoreReply(value=b64(self._data.get(key, unb64(req.expected))))
            case "check":
                return StoreReply(number=int(all(k in self._data for k in req.keys)))
            case "delete":
                return StoreReply(number=int(self._pop(key)))
            case "num_keys":
                return StoreReply(number=len(self._data))
        return StoreReply()

    def drop_before(self, prefix: str, generation: int) -> int:
        """Remove the keys of generations before `generation` (each formed under `{prefix}{g}/`): no
        group reads them again. Returns how many went."""
        with self._lock:
            old = [k for k in self._data if _generation(k, prefix) < generation]
            for k in old:
                self._pop(k)
        return len(old)

    def abandon(self, prefix: str, generation: int) -> None:
        """Generation `generation`'s group will never form (a rank was lost as it formed): every
        request on its keys is refused from now on, so the ranks blocked in forming it stop waiting
        at once."""
        assert prefix == STORE_PREFIX
        with self._lock:
            self._abandoned = {g for g in self._abandoned if g >= generation - 8} | {generation}

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            peers = list(self._peers)
        for conn in peers:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def _generation(key: str, prefix: str) -> int:
    head, _, _ = key.partition("/")
    number = head.removeprefix(prefix)
    return int(number) if head.startswith(prefix) and number.isdigit() else 1 << 62
