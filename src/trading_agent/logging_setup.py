"""Logging: structlog, JSON lines for journald, a readable console on a terminal.

Every line passes the same small processors: ``merge_contextvars`` first (so a desk and turn
bound once with ``structlog.contextvars.bound_contextvars(desk=..., turn=...)`` appear on
every line logged inside), then level and UTC timestamp, then the secret redactor, then the
renderer. The standard library's loggers (uvicorn, httpx) go through the same chain.

Secrets are redacted by a processor, not by remembering: the value of every environment
variable the config names as a secret (and of variables whose names say they are secrets,
``*_API_KEY``, ``*_TOKEN``...) is replaced wherever it appears, and values under keys such
as ``api_key``, ``secret``, ``token`` or ``password`` are hidden whole.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Collection, Iterable, Mapping, MutableMapping
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import Event

__all__ = [
    "REDACTED",
    "SecretRedactor",
    "configure_logging",
    "log_events",
    "secret_values",
]

REDACTED = "[REDACTED]"

_SECRET_KEY = re.compile(r"(^|[_-])(api_?key|secret|token|password|passphrase|authorization)$",
                         re.IGNORECASE)
_SECRET_ENV_NAME = re.compile(r"(API_?KEY|SECRET|TOKEN|PASSWORD|PASSPHRASE)$", re.IGNORECASE)
_MIN_NAMED_SECRET = 4
"""Shorter values of configured secrets are not searched for (they would mangle text)."""
_MIN_GUESSED_SECRET = 8
"""The same for variables that only look like secrets by their names."""

_QUIET_LOGGERS = ("httpx", "httpcore", "openai", "uvicorn.access", "ccxt")


def secret_values(secret_env_names: Iterable[str],
                  environ: Mapping[str, str] | None = None) -> set[str]:
    """The values to hide: of the named variables, and of variables named like secrets.

    Args:
        secret_env_names: The variables the config names as holding secrets.
        environ: The environment (``os.environ`` by default).

    Returns:
        The non-trivial values.
    """
    environ = os.environ if environ is None else environ
    values = {environ[name] for name in secret_env_names
              if len(environ.get(name, "")) >= _MIN_NAMED_SECRET}
    values |= {value for name, value in environ.items()
               if _SECRET_ENV_NAME.search(name) and len(value) >= _MIN_GUESSED_SECRET}
    return values


class SecretRedactor:
    """A structlog processor that hides secrets in every value of a log line.

    Args:
        secrets: The secret values, replaced wherever they appear in a string.
    """

    def __init__(self, secrets: Collection[str] = ()) -> None:
        # Longest first, so a secret containing another is replaced whole.
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def __call__(self, logger: WrappedLogger, method_name: str,
                 event_dict: EventDict) -> EventDict:
        for key in list(event_dict):
            event_dict[key] = self._clean(key, event_dict[key])
        return event_dict

    def _clean(self, key: object, value: Any) -> Any:
        if isinstance(key, str) and _SECRET_KEY.search(key) and value not in (None, ""):
            return REDACTED
        if isinstance(value, str):
            for secret in self._secrets:
                if secret in value:
                    value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, Mapping):
            return {k: self._clean(k, v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._clean(None, v) for v in value]
        if isinstance(value, bytes | int | float | bool) or value is None:
            return value
        # Anything else is rendered as text anyway: check that text.
        return self._clean(key, str(value))


def _drop_color_message(logger: WrappedLogger, method_name: str,
                        event_dict: EventDict) -> EventDict:
    # uvicorn adds a copy of its message with terminal colours.
    event_dict.pop("color_message", None)
    return event_dict


def configure_logging(level: str = "info",
                      log_format: Literal["auto", "json", "console"] = "auto", *,
                      secret_env_names: Iterable[str] = (),
                      stream: TextIO | None = None,
                      environ: Mapping[str, str] | None = None) -> None:
    """Sets up structlog and the standard library's logging for the whole process.

    Args:
        level: The lowest level logged (``debug``, ``info``, ``warning``, ``error``).
        log_format: ``json``, ``console``, or ``auto`` (JSON unless the stream is a terminal).
        secret_env_names: The environment variables the config names as secrets
            (``Settings.secret_env_vars()``).
        stream: Where lines go (stdout by default: journald reads it under systemd).
        environ: The environment the secrets are read from (``os.environ`` by default).
    """
    stream = sys.stdout if stream is None else stream
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    as_json = log_format == "json" or (log_format == "auto" and not stream.isatty())
    redactor = SecretRedactor(secret_values(secret_env_names, environ))
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        _drop_color_message,
    ]
    renderer: Processor
    if as_json:
        # Tracebacks as data, without local variables (they may hold secrets, and are long).
        tracebacks: Processor = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False))
        renderer = structlog.processors.JSONRenderer()
    else:
        tracebacks = structlog.processors.format_exc_info
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            tracebacks,
            redactor,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(numeric_level, logging.WARNING))
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        cache_logger_on_first_use=False,
    )


_EVENT_LEVELS = {"error": logging.ERROR, "retry": logging.WARNING,
                 "events_dropped": logging.WARNING, "overflow_recovery": logging.WARNING}
_NOT_LOGGED = frozenset({"text_delta", "tool_heartbeat"})


async def log_events(subscription: Subscription, *,
                     skip: Collection[str] = _NOT_LOGGED) -> None:
    """Logs every event of a bus subscription, with its desk and turn bound, until closed.

    Args:
        subscription: A subscription to the daemon's bus.
        skip: Event types not logged (text deltas and heartbeats by default: too many).
    """
    logger = structlog.get_logger("trading_agent.events")
    async for event in subscription:
        if event.type in skip:
            continue
        _log_event(logger, event)


def _log_event(logger: Any, event: Event) -> None:
    fields: MutableMapping[str, Any] = event.to_dict()
    for key in ("type", "desk", "turn", "at"):
        fields.pop(key, None)
    for key in ("subagent", "parent_call"):
        if fields.get(key) is None:
            fields.pop(key, None)
    fields["event_id"] = fields.pop("id")
    with structlog.contextvars.bound_contextvars(desk=event.desk, turn=event.turn):
        logger.log(_EVENT_LEVELS.get(event.type, logging.INFO), event.type, **fields)
