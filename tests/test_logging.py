"""Log lines: JSON or console, desk and turn on every line, secrets never written."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import structlog

from trading_agent import logging_setup
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent, RetryScheduled, TextDelta, ToolCallStarted
from trading_agent.logging_setup import (
    REDACTED,
    RepeatLimitedHandler,
    SecretRedactor,
    configure_logging,
    log_events,
    redact_secrets,
)

SECRET = "sk-test-0123456789abcdef"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # configure_logging also sets the secrets operators' text is cleaned of: put them back.
    monkeypatch.setattr(logging_setup, "_process_redactor", logging_setup._process_redactor)
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
    assert redactor.redact("abcdefgh, abcd") == f"{REDACTED}, {REDACTED}"


def test_text_from_operators_is_cleaned_of_the_secrets_the_logs_hide() -> None:
    """What a desk stores and publishes of an operator's message goes through the same
    secrets as the log lines (configured once, by configure_logging)."""
    configure_logging("info", "json", secret_env_names=["MY_MODEL_KEY"], stream=io.StringIO(),
                      environ={"MY_MODEL_KEY": SECRET, "EXCHANGE_API_SECRET": "hunter2hunter2",
                               "SHORT_TOKEN": "abc"})
    assert redact_secrets(f"use {SECRET} and hunter2hunter2, not abc") == (
        f"use {REDACTED} and {REDACTED}, not abc")
    configure_logging("info", "json", stream=io.StringIO(), environ={})
    assert redact_secrets(f"use {SECRET}") == f"use {SECRET}"  # no longer a secret here


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


def _wait_for_lines(stream: io.StringIO, until: Any) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 5
    while not until(lines := _lines(stream)):
        assert time.monotonic() < deadline, lines[-5:]
        time.sleep(0.02)
    return lines


def test_a_flood_of_one_event_is_summarised_not_written() -> None:
    # asyncio logged "socket.accept() out of system resource" (with the socket on its next
    # line) thousands of times a second once the descriptors ran out.
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream, max_repeats_per_second=20)
    log = structlog.get_logger("test.flood")
    for attempt in range(1000):
        log.error("accept_failed", attempt=attempt)
        logging.getLogger("asyncio").error(
            "socket.accept() out of system resource\nsocket: <fd=%d>", 7)
    for name in range(30):
        log.info(f"distinct_{name}")

    def summarised(lines: list[dict[str, Any]]) -> bool:
        counted = {line.get("repeated"): 0 for line in lines}
        for line in lines:
            counted[line.get("repeated")] += line.get("suppressed", 0)
        written = {"accept_failed": sum(line["event"] == "accept_failed" for line in lines),
                   "socket.accept() out of system resource": sum(
                       line["event"].startswith("socket.accept()") for line in lines)}
        return all(written[event] + counted.get(event, 0) == 1000 for event in written)

    lines = _wait_for_lines(stream, summarised)
    accepted = [line for line in lines if line["event"] == "accept_failed"]
    # 20 a second: 40 if the loop happened to straddle the end of a second.
    assert 20 <= len(accepted) <= 40
    assert [line["attempt"] for line in accepted[:20]] == list(range(20))
    summaries = [line for line in lines if "suppressed" in line]
    assert {line["logger"] for line in summaries} == {"test.flood", "asyncio"}
    for summary in summaries:
        assert summary["event"] == f"{summary['suppressed']} more like this suppressed"
        assert summary["level"] == "error"
    assert [line["event"] for line in lines if line["event"].startswith("distinct_")] == [
        f"distinct_{name}" for name in range(30)]
    assert len(lines) < 100


def test_the_limit_starts_again_each_second() -> None:
    now = [100.0]
    stream = io.StringIO()
    handler = RepeatLimitedHandler(stream, per_second=3, clock=lambda: now[0])
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("test.limit")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for _ in range(5):
            logger.warning("disk slow on %s", "sda")
        logger.warning("another event")
        now[0] += 0.5
        logger.warning("disk slow on %s", "sdb")
        now[0] += 0.6  # the first second is over
        logger.warning("disk slow on %s", "sdc")
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
        handler.close()
    assert stream.getvalue().splitlines() == [
        "WARNING disk slow on sda", "WARNING disk slow on sda", "WARNING disk slow on sda",
        "WARNING another event",
        "WARNING 3 more like this suppressed",
        "WARNING disk slow on sdc",
    ]
