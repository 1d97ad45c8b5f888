"""The daily summary: each desk's profit, at the configured time (UTC), to every operator."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tests.scripted_server import ScriptedServer
from tests.telegram.harness import ANN, OWEN, VIV, telegram_daemon
from tests.telegram_standin import until
from trading_agent.telegram.config import TelegramSettings
from trading_agent.telegram.watcher import EventWatcher

MIDNIGHT = 1_767_225_600.0
"""2026-01-01 00:00 UTC."""


async def test_the_daily_summary_waits_for_its_time_and_tells_every_operator_each_desks_profit(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    async with telegram_daemon(tmp_path, scripted_server.base_url,
                               telegram={"daily_summary_at": "18:00",
                                         "notifications": {"daily_summary": "silent"}}) as run:
        bot = run.running.daemon.telegram
        assert bot is not None
        waits: list[float] = []
        now = [MIDNIGHT + 17 * 3600 + 30 * 60]  # 17:30 UTC

        async def sleep(seconds: float) -> None:
            waits.append(seconds)
            now[0] += seconds
            if len(waits) > 1:
                raise anyio.get_cancelled_exc_class()

        settings = TelegramSettings.model_validate({
            "token_env": "TELEGRAM_BOT_TOKEN", "default_desk": "alpha",
            "daily_summary_at": "18:00", "notifications": {"daily_summary": "silent"}})
        watcher = EventWatcher(settings, run.running.daemon.supervisor, bot.outbox,
                               [ANN.id, VIV.id, OWEN.id], clock=lambda: now[0], sleep=sleep)
        with pytest.raises(anyio.get_cancelled_exc_class()):
            await watcher.daily_summaries()
        telegram = run.telegram
        await until(lambda: all(any(t.startswith("Daily summary\nalpha profit: realized "
                                                 "today 0.00") for t in telegram.texts(chat))
                                for chat in (ANN.id, VIV.id, OWEN.id)), "the summary")
    assert waits == [1800.0, 86400.0], "at 18:00 today, then at 18:00 tomorrow"
    summaries = [m for m in telegram.messages(ANN.id) if m.text.startswith("Daily summary")]
    assert [m.silent for m in summaries] == [True]
