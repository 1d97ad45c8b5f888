"""The Telegram tests read the bot's log lines (``structlog.testing.capture_logs``): each
starts from structlog's defaults, since a test run earlier in the same worker may have left
a logger that filters out ``info`` (the daemon's own logging set-up does, at its level)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
