"""The rendezvous store's requests and answers: one operation of `torch.distributed.Store` each,
sent over the job's authenticated protocol (`protocol.send_body`). The server is the coordinator's
(`job_agent.coordinator.store_server`), the client each rank's (`job_agent.rank.store`)."""

from __future__ import annotations

import base64
import socket
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from job_agent.wire import protocol

# each generation's group forms under `gen<g>/`: a prefix reused reads stale keys
STORE_PREFIX = "gen"


def b64(value: bytes | str) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
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
    # add: the new value; check: 1 if every key is set; delete: 1 if it was; num_keys
    number: int = 0


def send(sock: socket.socket, message: BaseModel) -> None:
    protocol.send_body(sock, message.model_dump_json().encode())
