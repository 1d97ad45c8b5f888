"""Log lines: JSON or console, desk and turn on every line, secrets never written."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import structlog

from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent, RetryScheduled, TextDelta, ToolCallStarted
from trading_agent.logging_setup import REDACTED, SecretRedactor, configure_logging, log_events

SECRET = "sk-test-0123456789abcdef"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_bound_desk_and_turn_and_hide_secrets() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", secret_env_names=["MY_MODEL_KEY"], stream=stream,
                      environ={"MY_MODEL_KEY": SECRET, "EXCHANGE_API_SECRET": "hunter2hunter2",
                               "HOME": "/root"})
    log = structlog.get_logger("test")
    with structlog.contextvars.bound_contextvars(desk="alpha", turn="t-1"):
        log.info("request_failed", url=f"https://x/v1?key={SECRET}", api_key="abc",
                 headers={"Authorization": f"Bearer {SECRET}", "accept": "json"},
                 input_tokens=1200, token_env="MY_MODEL_KEY", notes=["hunter2hunter2", 5])
        logging.getLogger("uvicorn.error").warning("client sent %s", SECRET)
        try:
            raise RuntimeError(f"server said no to {SECRET}")
        except RuntimeError:
            log.exception("crashed")
    log.debug("not shown")
    log.info("outside")

    first, stdlib, crash, outside = _lines(stream)
    assert SECRET not in stream.getvalue() and "hunter2" not in stream.getvalue()
    assert (first["desk"], first["turn"], first["level"]) == ("alpha", "t-1", "info")
    assert first["event"] == "request_failed"
    assert first["url"] == f"https://x/v1?key={REDACTED}"
    assert first["api_key"] == REDACTED
    assert first["headers"] == {"Authorization": REDACTED, "accept": "json"}
    assert first["input_tokens"] == 1200  # a count, not a secret
    assert first["token_env"] == "MY_MODEL_KEY"  # a variable's name is not its value
    assert first["notes"] == [REDACTED, 5]
    assert first["timestamp"].endswith("Z")
    assert (stdlib["event"], stdlib["desk"], stdlib["logger"]) == (
        f"client sent {REDACTED}", "alpha", "uvicorn.error")
    assert crash["exception"][0]["exc_value"] == f"server said no to {REDACTED}"
    assert "locals" not in crash["exception"][0]["frames"][0]
    assert "desk" not in outside


def test_console_format_on_a_terminal_and_json_elsewhere() -> None:
    terminal = _Terminal()
    configure_logging("info", "auto", stream=terminal)
    structlog.get_logger().info("hello", desk="alpha")
    assert "hello" in terminal.getvalue() and not terminal.getvalue().startswith("{")

    piped = io.StringIO()
    configure_logging("info", "auto", stream=piped)
    structlog.get_logger().info("hello", desk="alpha")
    assert _lines(piped)[0]["event"] == "hello"

    console = io.StringIO()
    configure_logging("warning", "console", stream=console,
                      environ={"X_TOKEN": "tok-abcdefgh1234"})
    structlog.get_logger().info("hidden")
    structlog.get_logger().warning("shown", detail="tok-abcdefgh1234")
    assert "hidden" not in console.getvalue()
    assert "shown" in console.getvalue() and "tok-abcdefgh1234" not in console.getvalue()


def test_the_redactor_replaces_the_longest_secret_first() -> None:
    redactor = SecretRedactor(["abcd", "abcdefgh"])
    cleaned = redactor(None, "info", {"event": "x abcdefgh y abcd", "count": 3, "none": None})
    assert cleaned == {"event": f"x {REDACTED} y {REDACTED}", "count": 3, "none": None}


async def test_log_events_logs_each_event_with_its_desk_and_turn() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    bus = EventBus()
    subscription = bus.subscribe("log")
    async with anyio.create_task_group() as group:
        group.start_soon(log_events, subscription)
        bus.publish(ToolCallStarted(desk="alpha", turn="t1", call_id="c1", name="get_ticker",
                                    arguments="{}"))
        bus.publish(TextDelta(desk="alpha", turn="t1", text="Hel"))
        bus.publish(RetryScheduled(desk="beta", turn="t2", attempt=1, delay=2.0,
                                   reason="429", status_code=429))
        bus.publish(ErrorEvent(desk="beta", message="down", error_type="BackendError"))
        subscription.close()
    tool, retry, error = _lines(stream)
    assert (tool["event"], tool["desk"], tool["turn"], tool["name"]) == (
        "tool_call", "alpha", "t1", "get_ticker")
    assert tool["event_id"] == 1
    assert (retry["level"], retry["desk"], retry["status_code"]) == ("warning", "beta", 429)
    assert (error["level"], error["message"], error["turn"]) == ("error", "down", None)
