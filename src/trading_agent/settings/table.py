"""The base of every config table."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Table"]


class Table(BaseModel):
    """A config table: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
