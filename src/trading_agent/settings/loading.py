"""Reading the config file: TOML, the environment over it, relative paths, and the secrets the
environment must hold.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_settings import EnvSettingsSource
from pydantic_settings.exceptions import SettingsError

from trading_agent.errors import ConfigError
from trading_agent.settings.report import ErrorReport
from trading_agent.settings.root import Settings, toml_data
from trading_agent.settings.toml_types import mark_loose_types

__all__ = ["load_settings", "missing_secrets"]

_RELATIVE_PATHS: tuple[tuple[str, ...], ...] = (
    ("daemon", "state_dir"),
    ("operator", "socket_path"),
    ("operator", "tls_cert_file"),
    ("operator", "tls_key_file"),
    ("fleet", "nats_ca_file"),
    ("fleet", "nats_cert_file"),
    ("fleet", "nats_key_file"),
    ("fleet", "nats_creds_file"),
)


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Makes the file's relative paths relative to the file's folder (in place)."""

    def fix(table: Any, key: str) -> None:
        if isinstance(table, dict) and isinstance(table.get(key), str):
            path = Path(table[key]).expanduser()
            table[key] = os.path.normpath(path if path.is_absolute() else base / path)

    for section, key in _RELATIVE_PATHS:
        fix(data.get(section), key)
    fix(data.get("model"), "cache_dir")

    def fix_replay(exchange: Any) -> None:
        if isinstance(exchange, dict) and isinstance(exchange.get("replay"), dict):
            files = exchange["replay"].get("files")
            if isinstance(files, dict):
                for symbol in list(files):
                    fix(files, symbol)

    fix_replay(data.get("exchange"))
    desks = data.get("desks")
    if isinstance(desks, dict):
        for desk in desks.values():
            if isinstance(desk, dict):
                fix_replay(desk.get("exchange"))
                fix(desk.get("model"), "cache_dir")


def load_settings(path: Path | str, *, check_environment: bool = False) -> Settings:
    """Reads and validates a config file, with the ``TRADING_AGENT_*`` variables over it.

    Args:
        path: The TOML file.
        check_environment: Also require every secret the config names to be set in the
            environment (what ``run`` needs; ``check-config`` only warns).

    Returns:
        The settings.

    Raises:
        ConfigError: The file cannot be read, is not valid TOML, or breaks the schema; the
            message lists every problem, one a line, as
            ``FILE: key.path: message (got VALUE; allowed ...)``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {_describe_toml_error(exc, text)}") from exc
    _resolve_paths(data, path.resolve().parent)
    mark_loose_types(data)
    token = toml_data.set(data)
    try:
        settings = Settings()
    except SettingsError as exc:
        raise ConfigError(f"{path}: environment: {exc}") from exc
    except ValidationError as exc:
        problems = ErrorReport(path, data, _environment_data()).lines(exc)
        raise ConfigError("\n".join(problems)) from exc
    finally:
        toml_data.reset(token)
    if check_environment:
        missing = missing_secrets(settings, path)
        if missing:
            raise ConfigError("\n".join(missing))
    return settings


def missing_secrets(settings: Settings, path: Path | str,
                    environ: Mapping[str, str] | None = None) -> list[str]:
    """The secrets the daemon needs that the environment does not hold.

    Args:
        settings: The settings.
        path: The config file, named in each line.
        environ: The environment (``os.environ`` by default).

    Returns:
        One line per missing variable, naming the key that refers to it; and one for a
        fleet key too short (its length, never its value).
    """
    environ = os.environ if environ is None else environ
    lines: list[str] = []
    seen: set[str] = set()
    for key_path, name, required in settings.secret_references():
        if required and not environ.get(name) and name not in seen:
            seen.add(name)
            lines.append(f"{path}: {key_path}: the environment variable {name} is not set or "
                         f"empty (got {name!r}; allowed: the name of a variable set in the "
                         "daemon's environment, such as in /etc/trading-agent/env)")
    key_env = settings.fleet.key_env
    if settings.in_fleet and key_env and environ.get(key_env) and key_env not in seen:
        try:
            settings.fleet.fleet_key(environ)
        except ValueError as exc:
            lines.append(f"{path}: {exc}")
    return lines


def _describe_toml_error(exc: tomllib.TOMLDecodeError, text: str) -> str:
    message = str(exc)
    if message.endswith("(at end of document)"):
        return _describe_unclosed(message.removesuffix("(at end of document)").strip(), text)
    found = re.search(r"\(at line (\d+), column (\d+)\)", message)
    if found is None:
        return f"invalid TOML: {message}"
    reason = message[:found.start()].strip()
    line = int(found.group(1))
    lines = text.splitlines()
    shown = f" (the line: {lines[line - 1].strip()!r})" if 0 < line <= len(lines) else ""
    return f"line {line}, column {found.group(2)}: invalid TOML: {reason}{shown}"


def _describe_unclosed(reason: str, text: str) -> str:
    """An error at the end of the file: a string, array, inline table or table header was
    opened and never closed. tomllib reports the end of the file; the line named here is
    the one where that value opens."""
    line = _unclosed_line(text)
    if line is None:
        return f"invalid TOML at the end of the file: {reason}"
    shown = text.splitlines()[line - 1].strip()
    return (f"line {line}: invalid TOML: the string, array or table opened on this line is "
            f"never closed (at the end of the file: {reason}; the line: {shown!r})")


def _unclosed_line(text: str) -> int | None:
    """The line (from 1) where the outermost value still open at the end of ``text`` opens.

    A small scan of TOML's brackets, strings and comments, enough for a file that tomllib
    read without error up to its end.
    """
    opened: list[int] = []  # the lines of the brackets still open, outermost first
    header: int | None = None  # the line of a [table] header still open
    line, index, size = 1, 0, len(text)
    while index < size:
        char = text[index]
        if char == "\n":
            line += 1
        elif char == "#":
            end = text.find("\n", index)
            index = size if end < 0 else end
            continue
        elif char in "\"'":
            quote = char * 3 if text.startswith(char * 3, index) else char
            start_line, index = line, index + len(quote)
            while index < size and not text.startswith(quote, index):
                if text[index] == "\\" and char == '"':
                    index += 1  # an escape: the next character never ends the string
                elif text[index] == "\n":
                    line += 1
                index += 1
            if index >= size:
                return start_line
            # A multi-line string may end in up to two quotes of its own before its closing three.
            for _ in range(2 if len(quote) == 3 else 0):
                if text.startswith(char, index + 3):
                    index += 1
            index += len(quote)
            continue
        elif char == "[" and not opened and header is None and (
                not text[text.rfind("\n", 0, index) + 1:index].strip()):
            header = line
            if text.startswith("[[", index):
                index += 1
        elif char == "]" and header is not None and not opened:
            header = None
        elif char in "[{":
            opened.append(line)
        elif char in "]}" and opened:
            opened.pop()
        index += 1
    if opened:
        return opened[0]
    return header


def _environment_data() -> dict[str, Any]:
    """What the environment variables set, nested like the file (for naming error sources)."""
    try:
        return EnvSettingsSource(Settings)()
    except SettingsError:
        return {}
