"""The error report of ``check-config``: pydantic's errors, one line each, naming the file (or
the environment variable) and the key, what was given and what is allowed.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from trading_agent.settings.defaults import deep_merge, inherits_model
from trading_agent.settings.root import ENV_PREFIX, Settings
from trading_agent.settings.toml_types import (
    WrongType,
    toml_repr,
    union_members,
    union_tags,
    unwrap,
)

__all__ = ["ErrorReport"]

_SECRET_KEY = re.compile(r"(^|_)(api_?key|secret|token|password|passphrase)$", re.IGNORECASE)


class ErrorReport:
    """Turns pydantic's errors into one line each, naming the file (or variable) and key.

    Args:
        path: The config file, named in each line.
        file_data: What the file holds (parsed, its wrong types marked).
        env_data: What the environment variables set, nested like the file.
    """

    def __init__(self, path: Path, file_data: dict[str, Any], env_data: dict[str, Any]) -> None:
        self.path = path
        self.file_data = file_data
        self.env_data = env_data
        self.raw = deep_merge(file_data, env_data)

    def lines(self, exc: ValidationError) -> list[str]:
        """The report's lines.

        Args:
            exc: What validating the settings raised.

        Returns:
            One line per problem, as ``FILE: key.path: message (got VALUE; allowed ...)``; a
            desk's copy of a problem in a table it inherits is told once, at the top level.
        """
        found: list[tuple[list[str | int], str]] = []
        for error in exc.errors(include_url=False):
            keys, line = self._line(error)
            if (keys, line) not in found:
                found.append((keys, line))
        # A desk's copy of a problem in the top-level [model] or [exchange] it inherits is
        # the same problem: it is reported once, at the top level.
        top_level = {(tuple(keys), line.split(": ", 2)[-1]) for keys, line in found}
        lines: list[str] = []
        for keys, line in found:
            if (len(keys) >= 3 and keys[0] == "desks" and keys[2] in ("model", "exchange")
                    and (tuple(keys[2:]), line.split(": ", 2)[-1]) in top_level):
                continue
            lines.append(line)
        return lines

    def _line(self, error: Any) -> tuple[list[str | int], str]:
        keys, parent, annotation = _walk(tuple(error["loc"]))
        keys = self._inherited_from(keys)
        kind = error["type"]
        message = str(error["msg"]).removeprefix("Value error, ")
        value = error.get("input")
        details: list[str] = []
        if kind in ("union_tag_not_found", "union_tag_invalid"):
            keys = [*keys, "provider"]
            tags = union_tags(annotation)
            message = ("missing the key that picks the kind" if kind == "union_tag_not_found"
                       else "unknown kind")
            value = error.get("ctx", {}).get("tag") if kind == "union_tag_invalid" else None
            if value is not None:
                details.append(f"got {_show(value, keys)}")
            details.append("allowed: " + ", ".join(repr(tag) for tag in tags))
        elif kind == "missing" and len(keys) == 3 and keys[0] == "desks" and keys[2] == "model":
            message = (f"no model: add a top-level [model] table or a [desks.{keys[1]}.model] "
                       "table")
            details.append("allowed: " + _describe(annotation, parent, keys))
        elif isinstance(value, WrongType):
            message = value.reason
            details.append(f"got {_show(value.value, keys)}")
            if annotation is not None:
                details.append("allowed: " + _describe(annotation, parent, keys))
        elif kind == "missing":
            message = "required key is missing"
            details.append("allowed: " + _describe(annotation, parent, keys))
        elif kind == "extra_forbidden":
            message = "unknown key"
            details.append(f"got {_show(value, keys)}")
            fields = sorted(parent.model_fields) if parent is not None else []
            close = difflib.get_close_matches(str(keys[-1]), fields, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            if _SECRET_KEY.search(str(keys[-1])):
                hint += ("secrets never go in the file: name the environment variable that "
                         "holds it (such as api_key_env). ")
            details.append(f"{hint}allowed keys: {', '.join(fields)}")
        else:
            shown = _show(value, keys)
            if not isinstance(value, Mapping | BaseModel) and shown not in message:
                details.append(f"got {shown}")
            if kind != "value_error" and annotation is not None:
                details.append("allowed: " + _describe(annotation, parent, keys))
        place = self._source(keys)
        where = _format_path(keys) or "(top level)"
        suffix = f" ({'; '.join(details)})" if details else ""
        return keys, f"{place}: {where}: {message}{suffix}"

    def _inherited_from(self, keys: list[str | int]) -> list[str | int]:
        """A desk's error about a key it inherited is reported at the top-level key."""
        if len(keys) < 4 or keys[0] != "desks" or keys[2] not in ("model", "exchange"):
            return keys
        desk = self.raw.get("desks", {}).get(keys[1], {})
        section = keys[2]
        own = desk.get(section) if isinstance(desk, Mapping) else None
        if section == "model" and not inherits_model(self.raw.get("model"), own):
            return keys
        if _has_path(own, keys[3:]):
            return keys
        if _has_path(self.raw.get(section), keys[3:]) or (
                section == "model" and isinstance(self.raw.get("model"), Mapping)):
            return [section, *keys[3:]]
        return keys

    def _source(self, keys: list[str | int]) -> str:
        """The file, or the environment variable that set the value."""
        if not keys:
            return str(self.path)
        node: Any = self.env_data
        names: list[str] = []
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                return str(self.path)
            names.append(str(key))
            node = node[key]
            if not isinstance(node, Mapping):
                break
        variable = ENV_PREFIX + "__".join(names).upper()
        return f"environment variable {variable}"


def _has_path(node: Any, keys: Sequence[str | int]) -> bool:
    for key in keys:
        found = (key in node if isinstance(node, Mapping) else
                 isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node))
        if not found:
            return False
        node = node[key]
    return True


def _walk(loc: tuple[Any, ...]) -> tuple[list[str | int], type[BaseModel] | None, Any]:
    """Follows an error's location through the schema.

    Returns:
        The key path as a user writes it (discriminator tags dropped), the model holding the
        last key, and the annotation of the last key (None when unknown).
    """
    keys: list[str | int] = []
    parent: type[BaseModel] | None = None
    annotation: Any = Settings
    field: FieldInfo | None = None
    for part in loc:
        current = unwrap(annotation)
        members = union_members(current)
        if members and isinstance(part, str) and part in union_tags(current):
            for member in members:
                if part in typing.get_args(member.model_fields["provider"].annotation):
                    annotation = member
            continue
        if part == "[key]":  # the error is about a table's key itself, not its value
            annotation = None
            continue
        keys.append(part)
        if isinstance(current, type) and issubclass(current, BaseModel):
            parent = current
            field = current.model_fields.get(str(part))
            annotation = field.annotation if field is not None else None
            if field is not None and field.metadata:
                annotation = Annotated[(annotation, *field.metadata)]
        elif typing.get_origin(current) is dict:
            parent, annotation = None, typing.get_args(current)[1]
        elif typing.get_origin(current) in (list, tuple):
            parent, annotation = None, typing.get_args(current)[0]
        else:
            parent, annotation = None, None
    return keys, parent, annotation


def _format_path(keys: Sequence[str | int]) -> str:
    text = ""
    for key in keys:
        if isinstance(key, int):
            text += f"[{key}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", key):
            text += f".{key}" if text else key
        else:
            quoted = '"' + key.replace('"', '\\"') + '"'
            text += f".{quoted}" if text else quoted
    return text


def _show(value: Any, keys: Sequence[str | int]) -> str:
    """A value for an error line: short, and hidden when its key looks like a secret."""
    if keys and _SECRET_KEY.search(str(keys[-1])):
        return "<hidden>"
    # A URL's password (postgresql://user:secret@host) is a secret whatever its key's name.
    text = _URL_PASSWORD.sub(r"\1:<hidden>@", toml_repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*):[^/@\s]*@")


def _constraints(metadata: Sequence[Any]) -> str:
    parts: list[str] = []
    for item in metadata:
        if isinstance(item, Gt):
            parts.append(f"> {_bound(item.gt)}")
        elif isinstance(item, Ge):
            parts.append(f">= {_bound(item.ge)}")
        elif isinstance(item, Lt):
            parts.append(f"< {_bound(item.lt)}")
        elif isinstance(item, Le):
            parts.append(f"<= {_bound(item.le)}")
        elif isinstance(item, MinLen) and item.min_length > 1:
            parts.append(f"at least {item.min_length} long")
        elif isinstance(item, MaxLen):
            parts.append(f"at most {item.max_length} long")
    return " " + ", ".join(parts) if parts else ""


def _bound(value: Any) -> str:
    """A bound as a config file writes it: ``3600``, not ``3600.0`` (pydantic shares one
    constraint object between equal bounds, so whether it holds an int or a float depends
    on which model was defined first)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _describe(annotation: Any, parent: type[BaseModel] | None = None,
              keys: Sequence[str | int] = ()) -> str:
    """What a key accepts, in the words of a config file."""
    metadata: list[Any] = []
    while typing.get_origin(annotation) is Annotated:
        args = typing.get_args(annotation)
        annotation, metadata = args[0], [*metadata, *args[1:]]
    bounds = _constraints(metadata)
    article = "a non-empty" if any(isinstance(m, MinLen) and m.min_length == 1
                                   for m in metadata) else "a"
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        tags = union_tags(annotation)
        if tags:
            text = "a table with provider = " + " or ".join(repr(t) for t in tags)
        else:
            text = " or ".join(_describe(m) for m in members) + bounds
        return text + (", or leave the key out" if optional else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list or origin is tuple:
        return f"{article} list{bounds}, each {_describe(typing.get_args(annotation)[0])}"
    if origin is dict:
        return f"{article} table{bounds}, each value {_describe(typing.get_args(annotation)[1])}"
    if annotation is str:
        return f"{article} string{bounds}"
    simple = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        Decimal: "a number (a string such as \"0.001\" keeps it exact)",
        str: "a string",
        Path: "a file path",
        datetime: "a date and time such as 2024-05-01T00:00:00Z",
    }
    if annotation in simple:
        return simple[annotation] + bounds
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a table with keys " + ", ".join(annotation.model_fields)
    return "a value of the right kind"
