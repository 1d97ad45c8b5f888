"""The one way a test writes a daemon config.

:func:`write_daemon_config` writes the TOML a test daemon runs on: its state under
``folder / "state"``, the scripted server's ``scripted-model`` as its model, and paper desks on
the packaged candles (the daemon's default exchange and feed). Each table takes keyword
overrides as plain data (a nested mapping is a sub-table, ``None`` drops a default key), so a
test spells only what it is about, and the file stays exactly what that test needs.

Example::

    write_daemon_config(tmp_path, server.base_url,
                        daemon={"restart_backoff_seconds": 0.05},
                        operator={"tcp_address": "127.0.0.1:0"},
                        desks={"alpha": {"tools": ["place_order"],
                                         "risk": {"max_order_notional": "10000"}}})
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["FAST_RESTARTS", "daemon_config", "desk", "render_tables", "write_daemon_config"]

Table = Mapping[str, Any]

FAST_RESTARTS: Table = {"restart_backoff_seconds": 0.05, "restart_backoff_max_seconds": 0.2}
"""``[daemon]`` keys for a desk that restarts at once after a failed turn."""


def desk(name: str, **options: Any) -> dict[str, Any]:
    """A paper desk's table on BTC/USDT with a prompt naming it; ``options`` add or replace
    keys (``None`` drops one)."""
    return _merged({"system_prompt": f"You are the trading desk {name}.",
                    "symbols": ["BTC/USDT"]}, options)


def _merged(defaults: Table, overrides: Table | None) -> dict[str, Any]:
    table = dict(defaults)
    for key, value in (overrides or {}).items():
        if value is None:
            table.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(table.get(key), Mapping):
            table[key] = _merged(table[key], value)
        else:
            table[key] = value
    return table


_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    return key if _BARE.fullmatch(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, Mapping):  # inside an array: an inline table
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, Sequence):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def render_tables(name: str, table: Table) -> str:
    """``table`` as the TOML table ``[name]``, its mappings as sub-tables after its keys (a
    mapping in a list is an inline table)."""
    lines = [f"[{name}]"]
    nested: list[str] = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            nested.append(render_tables(f"{name}.{_key(key)}", value))
        else:
            lines.append(f"{_key(key)} = {_value(value)}")
    return "\n".join(lines) + "\n" + "".join("\n" + text for text in nested)


def daemon_config(folder: Path, model_url: str, *,
                  desks: Mapping[str, Table] | Sequence[str] = ("alpha",),
                  daemon: Table | None = None, model: Table | None = None,
                  exchange: Table | None = None, operator: Table | None = None,
                  tables: Mapping[str, Table | Sequence[Table]] | None = None,
                  extra: str = "") -> str:
    """A daemon config's text.

    Args:
        folder: The test's folder; the state goes to ``folder / "state"``.
        model_url: The model server's base URL (the scripted server's ``/v1``).
        desks: Desk names (each :func:`desk` with its defaults) or each name's overrides of
            those defaults.
        daemon: Overrides of ``[daemon]``.
        model: Overrides of ``[model]`` (an OpenAI-compatible ``scripted-model``, a 32,000
            token window, a 10 s request timeout).
        exchange: The ``[exchange]`` table, when the test sets one.
        operator: The ``[operator]`` table, when the test sets one.
        tables: Further top-level tables (``fleet``, ``telemetry``...), in order; a list of
            mappings is an array of tables (``[[webhooks]]``).
        extra: TOML appended as it is, for what a test writes on purpose (a broken key).

    Returns:
        The TOML text.
    """
    parts = [
        render_tables("daemon", _merged({"state_dir": str(folder / "state")}, daemon)),
        render_tables("model", _merged({"provider": "openai", "base_url": model_url,
                                        "model": "scripted-model", "context_window": 32000,
                                        "request_timeout": 10}, model)),
    ]
    if exchange is not None:
        parts.append(render_tables("exchange", exchange))
    if operator is not None:
        parts.append(render_tables("operator", operator))
    for name, table in (tables or {}).items():
        if isinstance(table, Mapping):
            parts.append(render_tables(name, table))
        else:  # an array of tables, such as [[webhooks]]
            parts.extend(render_tables(name, item).replace(f"[{name}]", f"[[{name}]]", 1)
                         for item in table)
    named = desks.items() if isinstance(desks, Mapping) else ((name, {}) for name in desks)
    for name, overrides in named:
        parts.append(render_tables(f"desks.{name}", desk(name, **overrides)))
    if extra:
        parts.append(extra)
    return "\n".join(parts)


def write_daemon_config(folder: Path, model_url: str, *, file_name: str = "daemon.toml",
                        **tables: Any) -> Path:
    """Writes :func:`daemon_config` (same keywords) to ``folder / file_name``; returns the
    path."""
    path = folder / file_name
    path.write_text(daemon_config(folder, model_url, **tables), encoding="utf-8")
    return path
