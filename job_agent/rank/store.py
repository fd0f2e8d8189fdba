"""A rank's client of its job's rendezvous store (`job_agent.coordinator.store_server`): the
`torch.distributed.Store` each generation's process group forms through, over the job's
authenticated protocol. Every operation is a plain request and answer, and a wait is a bounded poll.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from pydantic import ValidationError

from job_agent import wire
from job_agent.wire import protocol
from job_agent.wire.store import StoreReply, StoreRequest, b64, send, unb64

_POLL_FIRST, _POLL_MAX = 0.002, 0.05  # seconds between two looks for a key not yet set
_RECONNECT_EVERY = 0.5  # seconds between two tries to reach a store that is gone


class RendezvousStore(dist.Store):
    """A rank's client of the job's `StoreServer`: what `init_process_group(store=...)` reads and
    writes."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: timedelta) -> None:
        super().__init__()
        self.set_timeout(timeout)
        self._timeout = timeout
        self._addr, self._secret = (host, port), secret
        self._sock = protocol.connect(host, port, secret, timeout)
        self._lock = threading.Lock()

    def _exchange(self, req: StoreRequest) -> bytes:
        """One request and its answer. A store gone (its coordinator restarted, hosting it again at
        the same address) is reconnected to, within the store's timeout, and asked again: what it
        held went with it, but every group forms under a prefix of its own, which a new generation
        writes anew."""
        try:
            send(self._sock, req)
            return protocol.recv_body(self._sock)
        except (OSError, ConnectionError, protocol.ProtocolError):
            self._sock.close()
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            try:
                self._sock = protocol.connect(*self._addr, self._secret, self._timeout)
                send(self._sock, req)
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
            why = (
                error.reason if isinstance(error, wire.Error) else f"unexpected answer {error.t!r}"
            )
            raise dist.DistStoreError(f"store {op}: {why}") from None

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", (key,), value=b64(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        reply = self._call("get", (key,))
        if reply.value is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"store key {key!r} is gone")
        return unb64(reply.value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", (key,), amount=amount).number

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        reply = self._call("compare_set", (key,), expected=b64(expected), value=b64(desired))
        return unb64(reply.value or "")

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
                raise dist.DistStoreError(
                    f"timed out after {limit:.0f} s waiting for store keys {keys}"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
