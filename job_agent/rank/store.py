"""The job's rendezvous store: the key-value store each generation's process group forms through.

torch's `TCPStore` listens on every interface and serves any client: a peer without the job's secret could
read, write and delete the keys a group forms from (and so steer a rank to its own address). torchpass
serves the store itself, over the job's authenticated protocol (`job_agent.wire.protocol`: the mutual HMAC
challenge, then a tag on every frame): `StoreServer` in the coordinator, bound to the address it is given;
`RendezvousStore`, a `torch.distributed.Store`, in each rank. Only rendezvous goes through it (a few keys of
a few hundred bytes per rank and generation), so every operation is a plain request and answer, and a wait
is a bounded poll.
"""

from __future__ import annotations

import base64
import contextlib
import socket
import threading
import time
from datetime import timedelta
from typing import Annotated, Literal

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from job_agent import wire
from job_agent.wire import protocol
from job_agent.wire.protocol import AuthError, ProtocolError
from torchpass.errors import ErrorType

AUTH_TIMEOUT = timedelta(seconds=2)  # a peer silent before it proves the secret is dropped
MAX_CONNECTIONS = 256
STORE_PREFIX = "gen"  # each generation's group forms under `gen<g>/`: a prefix reused reads stale keys
MAX_KEYS = 100_000
MAX_BYTES = 64 * 2**20
_POLL_FIRST, _POLL_MAX = 0.002, 0.05  # seconds between two looks for a key not yet set
_RECONNECT_EVERY = 0.5  # seconds between two tries to reach a store that is gone


def _b64(value: bytes | str) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.b64encode(raw).decode()


def _raw(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


_KEY = Annotated[str, Field(max_length=1024)]
_VALUE = 2**20  # base64 characters: a value of 768 KiB; rendezvous values are a few hundred bytes


class StoreRequest(_Message):
    """One operation of `torch.distributed.Store`; values are base64."""

    t: Literal["store"] = "store"
    op: Literal["set", "get", "add", "compare_set", "check", "delete", "num_keys"]
    keys: tuple[_KEY, ...] = Field(default=(), max_length=1024)
    value: str = Field(default="", max_length=_VALUE)
    expected: str = Field(default="", max_length=_VALUE)
    amount: int = Field(default=0, ge=-(2**62), le=2**62)

    @model_validator(mode="after")
    def _one_key(self) -> StoreRequest:
        if self.op not in ("check", "num_keys") and len(self.keys) != 1:
            raise ValueError(f"store {self.op} takes exactly one key, not {len(self.keys)}")
        return self


class StoreReply(_Message):
    t: Literal["stored"] = "stored"
    value: str | None = None  # get, compare_set: base64; None: no such key
    number: int = 0  # add: the new value; check: 1 if every key is set; delete: 1 if it was; num_keys


def _send(sock: socket.socket, message: BaseModel) -> None:
    protocol.send_body(sock, message.model_dump_json().encode())


class StoreFull(Exception):
    """The store holds its limit of keys or bytes."""


class StoreServer:
    """Serves one job's store to authenticated peers; listens on `host` (`port`, or an ephemeral one)."""

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
        threading.Thread(target=self._accept_loop, name="torchpass-store-accept", daemon=True).start()

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
            threading.Thread(target=self._serve, args=(conn,), name="torchpass-store", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(AUTH_TIMEOUT.total_seconds())
            protocol.authenticate_server(conn, self._secret)  # nothing is read or written before this
            conn.settimeout(None)
            while True:
                _send(conn, self.answer(protocol.recv_body(conn)))
        except (OSError, ConnectionError, AuthError, ProtocolError):
            pass  # a peer without the secret, or one that left: its connection ends, the store goes on
        finally:
            with self._lock:
                self._peers.discard(conn)
            conn.close()

    def answer(self, body: bytes) -> StoreReply | wire.Error:
        """The reply to one request (a typed error naming what is wrong for anything but a valid one)."""
        try:
            req = StoreRequest.model_validate_json(body)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "request"
            return wire.Error(
                code=ErrorType.BAD_FRAME, reason=f"bad store request: {where}: {first['msg']}"[:4000]
            )
        try:
            with self._lock:
                gone = {_generation(k, STORE_PREFIX) for k in req.keys} & self._abandoned
                if gone:  # its group will never form: a rank waiting in it gives up now, not at a timeout
                    return wire.Error(code=ErrorType.REFUSED, reason=f"generation {min(gone)} was abandoned")
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
                self._put(key, _raw(req.value))
            case "get":
                value = self._data.get(key)
                return StoreReply(value=None if value is None else _b64(value))
            case "add":
                number = int(self._data.get(key, b"0")) + req.amount
                self._put(key, str(number).encode())
                return StoreReply(number=number)
            case "compare_set":
                current = self._data.get(key)
                expected = _raw(req.expected)
                if (current is None and not expected) or current == expected:
                    self._put(key, _raw(req.value))
                return StoreReply(value=_b64(self._data.get(key, _raw(req.expected))))
            case "check":
                return StoreReply(number=int(all(k in self._data for k in req.keys)))
            case "delete":
                return StoreReply(number=int(self._pop(key)))
            case "num_keys":
                return StoreReply(number=len(self._data))
        return StoreReply()

    def drop_before(self, prefix: str, generation: int) -> int:
        """Remove the keys of generations before `generation` (each formed under `{prefix}{g}/`): no group
        reads them again. Returns how many went."""
        with self._lock:
            old = [k for k in self._data if _generation(k, prefix) < generation]
            for k in old:
                self._pop(k)
        return len(old)

    def abandon(self, prefix: str, generation: int) -> None:
        """Generation `generation`'s group will never form (a rank was lost as it formed): every request on
        its keys is refused from now on, so the ranks blocked in forming it stop waiting at once."""
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


class RendezvousStore(dist.Store):
    """A rank's client of the job's `StoreServer`: what `init_process_group(store=...)` reads and writes."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._timeout = timeout
        self._addr, self._secret = (host, port), secret
        self._sock = protocol.connect(host, port, secret, timeout)
        self._lock = threading.Lock()

    def _exchange(self, req: StoreRequest) -> bytes:
        """One request and its answer. A store gone (its coordinator restarted, hosting it again at the
        same address) is reconnected to, within the store's timeout, and asked again: what it held went
        with it, but every group forms under a prefix of its own, which a new generation writes anew."""
        try:
            _send(self._sock, req)
            return protocol.recv_body(self._sock)
        except (OSError, ConnectionError, protocol.ProtocolError):
            self._sock.close()
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                self._sock = protocol.connect(*self._addr, self._secret, self._timeout)
                _send(self._sock, req)
                return protocol.recv_body(self._sock)
            except (OSError, ConnectionError, protocol.ProtocolError) as e:
                self._sock.close()
                if time.monotonic() >= deadline:
                    raise dist.DistStoreError(f"the job's store is gone: {e}") from None
                time.sleep(_RECONNECT_EVERY)

    def _call(self, op: str, keys: tuple[str, ...] = (), **fields: object) -> StoreReply:
        req = StoreRequest.model_validate({"op": op, "keys": keys, **fields})
        with self._lock:
            body = self._exchange(req)
        try:
            return StoreReply.model_validate_json(body)
        except ValidationError:
            try:
                error = wire.decode(body)
            except wire.BadFrame as e:
                raise dist.DistStoreError(f"store {op}: unreadable answer: {e}") from None
            why = error.reason if isinstance(error, wire.Error) else f"unexpected answer {error.t!r}"
            raise dist.DistStoreError(f"store {op}: {why}") from None

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", (key,), value=_b64(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        reply = self._call("get", (key,))
        if reply.value is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"store key {key!r} is gone")
        return _raw(reply.value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", (key,), amount=amount).number

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        reply = self._call("compare_set", (key,), expected=_b64(expected), value=_b64(desired))
        return _raw(reply.value or "")

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", tuple(keys)).number)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", (key,)).number)

    def num_keys(self) -> int:
        return self._call("num_keys").number

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key is set; DistStoreError after `timeout` (the store's own by default)."""
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        pause = _POLL_FIRST
        while not self.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"timed out after {limit:.0f} s waiting for store keys {keys}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
