"""The base of every frame of the job's channels, and the bounds of their text fields."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
)

TEXT = 4000


ID = 200


class FrameModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
