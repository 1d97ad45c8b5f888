"""The file held to its TOML types: a value whose type is not its key's is marked, so that
the schema refuses it where pydantic would convert it.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Union

from pydantic import BaseModel

from trading_agent.settings.root import Settings

__all__ = ["WrongType", "mark_loose_types", "toml_repr", "union_members", "union_tags", "unwrap"]


class WrongType:
    """A value of the file whose TOML type is not the key's, put in its place so that the
    schema refuses it there, where pydantic would convert it (``true`` to 1, ``"no"`` to
    false, ``1e27`` to an integer).

    Only the file is held to its types: an environment variable is text, and ``"5"`` or
    ``"false"`` there is read as the number or the boolean it spells.

    Attributes:
        value: The value as the file has it.
        reason: What is wrong, for the error line.
    """

    __slots__ = ("reason", "value")

    def __init__(self, value: Any, reason: str) -> None:
        self.value = value
        self.reason = reason

    def __repr__(self) -> str:
        return toml_repr(self.value)


def mark_loose_types(data: dict[str, Any]) -> None:
    """Replaces, in place, each value of the file whose TOML type is not its key's with a
    :class:`WrongType`: an integer key takes only an integer, a boolean key only ``true`` or
    ``false``, a number key only a finite integer or float, a decimal key no boolean, a date
    key no number."""
    model = data.get("model")
    provider = model.get("provider") if isinstance(model, Mapping) else None
    _check_types(data, Settings, provider)


def _check_types(value: Any, annotation: Any, provider: Any) -> Any:
    """``value``, or a :class:`WrongType` in its place; tables and arrays are checked (and
    changed) in place.

    Args:
        value: A value of the file.
        annotation: The type its key has in the schema.
        provider: The top-level model's ``provider``, which a desk's model table without one
            inherits (it picks the table's keys).
    """
    annotation = unwrap(annotation)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        models = union_members(annotation)
        if models and isinstance(value, dict):
            tag = value.get("provider", provider)
            for member in models:
                if tag in typing.get_args(member.model_fields["provider"].annotation):
                    return _check_types(value, member, provider)
        return value  # several plain types (bool | str) have validators of their own
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if isinstance(value, dict):
            for key, item in value.items():
                field = annotation.model_fields.get(key)
                if field is not None:
                    value[key] = _check_types(item, field.annotation, provider)
        return value
    if origin is dict and isinstance(value, dict):
        item_type = typing.get_args(annotation)[1]
        for key, item in value.items():
            value[key] = _check_types(item, item_type, provider)
        return value
    if origin in (list, tuple) and isinstance(value, list):
        item_type = typing.get_args(annotation)[0]
        value[:] = [_check_types(item, item_type, provider) for item in value]
        return value
    reason = _type_mismatch(value, annotation)
    return value if reason is None else WrongType(value, reason)


def _type_mismatch(value: Any, annotation: Any) -> str | None:
    """Why a value of the file cannot be taken for a key of this type, or None."""
    written = ("a boolean" if isinstance(value, bool) else
               "a string" if isinstance(value, str) else
               "a number with a fraction or an exponent" if isinstance(value, float) else
               "an integer" if isinstance(value, int) else None)
    if written is None:
        return None  # a table, an array or a date: the schema's own check refuses them
    unquote = "; write the number without quotes" if isinstance(value, str) else ""
    if annotation is bool and not isinstance(value, bool):
        hint = "; write true or false without quotes" if isinstance(value, str) else ""
        return f"{written} where true or false is expected{hint}"
    if annotation is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{written} where an integer is expected{unquote}"
    if annotation in (float, Decimal) and isinstance(value, float) and not math.isfinite(value):
        return "inf or nan where a finite number is expected"
    if annotation is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        return f"{written} where a number is expected{unquote}"
    if annotation is Decimal and isinstance(value, bool):
        return f"{written} where a number is expected"
    if annotation is datetime and isinstance(value, int | float):
        return f"{written} where a date and time is expected"
    return None


def toml_repr(value: Any) -> str:
    """A value as the file writes it (``true``, not ``True``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def unwrap(annotation: Any) -> Any:
    """Drops ``Annotated`` and ``None`` from an annotation."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return unwrap(members[0])
    return annotation


def union_members(annotation: Any) -> list[type[BaseModel]]:
    """The tables a union of tables (such as ``ModelSettings``) may be, or none."""
    annotation = unwrap(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [a for a in typing.get_args(annotation)
                if isinstance(a, type) and issubclass(a, BaseModel)]
    return []


def union_tags(annotation: Any) -> list[str]:
    """The ``provider`` values that pick the members of a union of tables, in their order."""
    tags: list[str] = []
    for member in union_members(annotation):
        field = member.model_fields.get("provider")
        if field is not None:
            tags.extend(typing.get_args(field.annotation))
    return tags
