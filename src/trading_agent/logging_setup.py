"""Logging: structlog, JSON lines for journald, a readable console on a terminal.

Every line passes the same small processors: ``merge_contextvars`` first (so a desk and turn
bound once with ``structlog.contextvars.bound_contextvars(desk=..., turn=...)`` appear on
every line logged inside), then level and UTC timestamp, then the secret redactor, then the
renderer. The standard library's loggers (uvicorn, httpx) go through the same chain.

Secrets are redacted by a processor, not by remembering: the value of every environment
variable the config names as a secret (and of variables whose names say they are secrets,
``*_API_KEY``, ``*_TOKEN``...) is replaced wherever it appears, and values under keys such
as ``api_key``, ``secret``, ``token`` or ``password`` are hidden whole.

A flood is summarised, not written: :class:`RepeatLimitedHandler` writes the same event (same
logger, level and event name) at most :data:`MAX_REPEATS_PER_SECOND` times a second and then
one line, ``"N more like this suppressed"`` (with ``repeated``, the event, and ``suppressed``,
the count). Once the descriptors ran out, asyncio alone logged "Too many open files"
thousands of times a second.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import Event

__all__ = [
    "MAX_REPEATS_PER_SECOND",
    "REDACTED",
    "RepeatLimitedHandler",
    "SecretRedactor",
    "configure_logging",
    "log_events",
    "redact_secrets",
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

MAX_REPEATS_PER_SECOND = 20
"""The same event is written at most this many times a second; the rest are counted."""

_MAX_WINDOWS = 1024
"""Events tracked at once before finished seconds are swept (memory stays bounded)."""


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

    def redact(self, text: str) -> str:
        """``text`` with each secret replaced by :data:`REDACTED`."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    def _clean(self, key: object, value: Any) -> Any:
        if isinstance(key, str) and _SECRET_KEY.search(key) and value not in (None, ""):
            return REDACTED
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, Mapping):
            return {k: self._clean(k, v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._clean(None, v) for v in value]
        if isinstance(value, bytes | int | float | bool) or value is None:
            return value
        # Anything else is rendered as text anyway: check that text.
        return self._clean(key, str(value))


_process_redactor = SecretRedactor()
"""The redactor :func:`configure_logging` set up last: the secrets of this process."""


def redact_secrets(text: str) -> str:
    """``text`` with the secrets this process's log lines hide replaced by :data:`REDACTED`.

    For text that enters from outside and is kept or shown again (an operator's message):
    the same secrets as the logs, once :func:`configure_logging` has run; none before.

    Args:
        text: The text.

    Returns:
        The text without the secrets.
    """
    return _process_redactor.redact(text)


@dataclass
class _Window:
    """One event's current second: what was written and what was held back."""

    start: float
    name: str
    level: int
    event: str
    written: int = 1
    suppressed: int = 0


def _repeat_key(record: logging.LogRecord) -> tuple[str, int, str]:
    """What makes two lines "the same event": logger, level, and the structlog event name
    or the first line of the standard library's message template (before its arguments)."""
    message = record.msg  # from structlog: the event dict
    event = str(message.get("event", "")) if isinstance(message, Mapping) else str(message)
    return record.name, record.levelno, event.partition("\n")[0][:200]


class RepeatLimitedHandler(logging.StreamHandler[TextIO]):
    """A stream handler that writes the same event at most ``per_second`` times a second.

    Beyond that, lines are counted; when their second is over, one line at the same level
    and logger says ``"N more like this suppressed"``, with the fields ``repeated`` (the
    event) and ``suppressed`` (N). It is written by the next line of that event or, if none
    comes, by a timer shortly after the second ends (and at :meth:`close`).

    Args:
        stream: Where lines go.
        per_second: The most lines of one event written in a second.
        clock: Monotonic seconds (``time.monotonic``).
    """

    def __init__(self, stream: TextIO, per_second: int = MAX_REPEATS_PER_SECOND, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(stream)
        self._per_second = per_second
        self._clock = clock
        self._windows: dict[tuple[str, int, str], _Window] = {}
        self._timer: threading.Timer | None = None

    def emit(self, record: logging.LogRecord) -> None:
        """Writes the line, or counts it if its event already filled this second."""
        now = self._clock()
        key = _repeat_key(record)
        window = self._windows.get(key)
        if window is not None and now - window.start >= 1.0:
            self._end(key, window)
            window = None
        if window is None:
            if len(self._windows) >= _MAX_WINDOWS:
                self._end_finished(now)
            self._windows[key] = _Window(now, record.name, record.levelno, key[2])
            super().emit(record)
        elif window.written < self._per_second:
            window.written += 1
            super().emit(record)
        else:
            window.suppressed += 1
            self._schedule(window.start + 1.0 - now)

    def close(self) -> None:
        """Writes what is still held back, then closes."""
        self.acquire()
        try:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for key, window in list(self._windows.items()):
                self._end(key, window)
        finally:
            self.release()
        super().close()

    def _end(self, key: tuple[str, int, str], window: _Window) -> None:
        del self._windows[key]
        if window.suppressed:
            super().emit(logging.makeLogRecord({
                "name": window.name, "levelno": window.level,
                "levelname": logging.getLevelName(window.level),
                "msg": f"{window.suppressed} more like this suppressed",
                "repeated": window.event, "suppressed": window.suppressed,
            }))

    def _end_finished(self, now: float) -> None:
        for key, window in list(self._windows.items()):
            if now - window.start >= 1.0:
                self._end(key, window)

    def _schedule(self, delay: float) -> None:
        if self._timer is None:
            # A little after the second ends, so the window is over when it fires.
            self._timer = threading.Timer(max(delay, 0.0) + 0.01, self._on_timer)
            self._timer.daemon = True
            self._timer.start()

    def _on_timer(self) -> None:
        self.acquire()
        try:
            self._timer = None
            now = self._clock()
            self._end_finished(now)
            pending = [w.start + 1.0 - now for w in self._windows.values() if w.suppressed]
            if pending:
                self._schedule(min(pending))
        finally:
            self.release()


def _drop_color_message(logger: WrappedLogger, method_name: str,
                        event_dict: EventDict) -> EventDict:
    # uvicorn adds a copy of its message with terminal colours.
    event_dict.pop("color_message", None)
    return event_dict


def configure_logging(level: str = "info",
                      log_format: Literal["auto", "json", "console"] = "auto", *,
                      secret_env_names: Iterable[str] = (),
                      stream: TextIO | None = None,
                      environ: Mapping[str, str] | None = None,
                      max_repeats_per_second: int = MAX_REPEATS_PER_SECOND) -> None:
    """Sets up structlog and the standard library's logging for the whole process.

    Args:
        level: The lowest level logged (``debug``, ``info``, ``warning``, ``error``).
        log_format: ``json``, ``console``, or ``auto`` (JSON unless the stream is a terminal).
        secret_env_names: The environment variables the config names as secrets
            (``Settings.secret_env_vars()``).
        stream: Where lines go (stdout by default: journald reads it under systemd).
        environ: The environment the secrets are read from (``os.environ`` by default).
        max_repeats_per_second: The most lines of one event written in a second; the rest
            are summarised (:class:`RepeatLimitedHandler`).
    """
    stream = sys.stdout if stream is None else stream
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    as_json = log_format == "json" or (log_format == "auto" and not stream.isatty())
    global _process_redactor
    redactor = _process_redactor = SecretRedactor(secret_values(secret_env_names, environ))
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
    handler = RepeatLimitedHandler(stream, max_repeats_per_second)
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
