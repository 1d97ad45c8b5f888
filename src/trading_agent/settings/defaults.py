"""Each desk's defaults: the top-level ``[model]`` and ``[exchange]`` under its own keys, its
``risk.allowed_symbols`` from its ``symbols``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["apply_desk_defaults", "deep_merge", "inherits_model"]


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s keys over it, tables merged key by key.

    Args:
        base: The table under.
        override: The table over it.

    Returns:
        A new table (neither argument is changed).
    """
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def inherits_model(default: Any, own: Any) -> bool:
    """Whether a desk's model table is merged over the default (same provider, or none).

    Args:
        default: The top-level ``[model]`` table, as the file has it.
        own: The desk's ``[desks.<name>.model]`` table, or None.

    Returns:
        Whether the desk inherits the default's keys.
    """
    if not isinstance(default, Mapping):
        return False
    if own is None:
        return True
    return isinstance(own, Mapping) and own.get("provider", default.get("provider")) == (
        default.get("provider"))


def apply_desk_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """Each desk's model and exchange: the top-level tables with the desk's keys over them.

    Args:
        data: The whole configuration, as the file (and the environment) have it.

    Returns:
        The configuration with each desk's tables completed (``data`` is not changed).
    """
    desks = data.get("desks")
    if not isinstance(desks, Mapping):
        return data
    default_model = data.get("model")
    default_exchange = data.get("exchange", {})
    resolved: dict[str, Any] = {}
    for name, desk in desks.items():
        if not isinstance(desk, Mapping):
            resolved[name] = desk
            continue
        desk = dict(desk)
        own_model = desk.get("model")
        if isinstance(default_model, Mapping) and inherits_model(default_model, own_model):
            desk["model"] = deep_merge(default_model, own_model or {})
        own_exchange = desk.get("exchange")
        if isinstance(default_exchange, Mapping) and (own_exchange is None
                                                      or isinstance(own_exchange, Mapping)):
            desk["exchange"] = deep_merge(default_exchange, own_exchange or {})
        risk = desk.get("risk", {})
        symbols = desk.get("symbols")
        if isinstance(risk, Mapping) and "allowed_symbols" not in risk and isinstance(
                symbols, list):
            desk["risk"] = {**risk, "allowed_symbols": list(symbols)}
        resolved[name] = desk
    return {**data, "desks": resolved}
