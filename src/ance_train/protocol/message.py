"""The base of every message on a Redis stream: schema version, run id, validation."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

SCHEMA_VERSION = 1


class MalformedMessage(ValueError):
    """A stream entry that is not a valid message of its stream (bad JSON, fields, version)."""


class Message(BaseModel):
    """Fields every message has. ``run_id`` is filled in by the bus when it publishes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    TYPE: ClassVar[str]

    version: int = SCHEMA_VERSION
    run_id: str = ""

    @model_validator(mode="after")
    def _supported_version(self) -> Message:
        if self.version != SCHEMA_VERSION:
            raise ValueError(f"schema version {self.version} is not supported "
                             f"(this build reads version {SCHEMA_VERSION})")
        return self

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, data: str | bytes) -> Any:
        """The message in ``data``; :class:`MalformedMessage` says what is wrong with it."""
        try:
            return cls.model_validate(json.loads(data))
        except (ValueError, TypeError) as error:  # JSONDecodeError and ValidationError too
            detail = _describe(error) if isinstance(error, ValidationError) else str(error)
            raise MalformedMessage(f"not a valid {cls.TYPE} message: {detail}") from None


def _describe(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'message'}: {e['msg']}"
                     for e in error.errors())
