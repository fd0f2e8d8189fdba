"""The frames of the state stream between a donor and a receiver, and the donors a `Receive` names
(`Source`). `job_agent.wire` holds them all in its union.

A receiver opens one authenticated session with each donor it was given. The donor sends the state's
header and manifest; the receiver asks for byte ranges of the state (`StateWant`, over the tensors'
bytes laid end to end in manifest order), each answered by the bytes and a `StateEnd` carrying the
digest of that range and of the donor's whole state; `StateAck` ends the session.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, model_validator

from job_agent.wire.base import ID, TEXT, FrameModel

MAX_SOURCES = 8  # donors one receiver may take slices from at once


class TensorEntry(FrameModel):
    path: str = Field(max_length=TEXT)
    dtype: str = Field(max_length=32)
    shape: tuple[NonNegativeInt, ...]


class StateHeader(FrameModel):
    t: Literal["state"] = "state"
    header: dict[str, Any]
    manifest: tuple[TensorEntry, ...]


class StateWant(FrameModel):
    """A receiver asks for bytes [start, stop) of the state."""

    t: Literal["want"] = "want"
    start: NonNegativeInt
    stop: NonNegativeInt

    @model_validator(mode="after")
    def _ordered(self) -> StateWant:
        if self.stop < self.start:
            raise ValueError(f"stop {self.stop} before start {self.start}")
        return self


class StateEnd(FrameModel):
    t: Literal["end"] = "end"
    digest: str = Field(
        max_length=ID, description="the donor's whole state (header and every tensor)"
    )
    slice_digest: str = Field(
        default="", max_length=ID, description="the bytes of the range just sent"
    )


class StateAck(FrameModel):
    t: Literal["ack"] = "ack"


class Source(FrameModel):
    """A donor serving the state: the slot of its rank and where it listens."""

    slot: NonNegativeInt
    host: str = Field(min_length=1, max_length=ID)
    port: int = Field(gt=0, lt=65536)
