"""What the bot sends gets through a rate limit and an outage, without ever holding a desk up,
and an answer longer than a Telegram message comes in several."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import structlog

from tests.operator.harness import uds_client
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from tests.telegram.harness import ANN, BOT_TOKEN, ENVIRON, OWEN, VIV, TelegramRun, telegram_daemon
from tests.telegram_standin import until

SMALL_ORDER = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.01"}
"""About 166 USDT: below the approval threshold, so it fills at once."""


def _fills(run: TelegramRun, chat: int) -> list[str]:
    return [t for t in run.telegram.texts(chat) if t.startswith("alpha: Order ")
            and " filled: bought 0.01 BTC" in t]


async def _trade_through_the_api(run: TelegramRun) -> float:
    """A turn that buys, started from the operator API; how long it took to its answer."""
    started = time.monotonic()
    async with uds_client(run.running.endpoints.socket_path) as client:
        response = await client.post("/api/desks/alpha/messages",
                                     json={"text": "Buy 0.01 BTC.", "wait": True,
                                           "timeout": 10}, timeout=15)
    assert response.status_code == 200, response.text
    assert response.json()["reply"] == {"ok": True, "text": "Bought 0.01 BTC.", "error": ""}
    return time.monotonic() - started


async def test_a_rate_limit_is_waited_out_and_the_notification_delivered_after(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    async with telegram_daemon(tmp_path, scripted_server.base_url) as run:
        telegram = run.telegram
        telegram.rate_limit(1, methods=("sendMessage",))
        with structlog.testing.capture_logs() as logs:
            telegram.say(ANN, "/pause lunch")
            await until(lambda: all("alpha: paused by ann: lunch" in telegram.texts(chat)
                                    for chat in (ANN.id, VIV.id, OWEN.id)),
                        "the notification in every operator's chat")
            await until(lambda: "alpha paused: no turns until /resume." in telegram.texts(
                ANN.id), "the reply")
    [limited] = [c for c in telegram.calls if c.status == 429]
    later = [c for c in telegram.methods("sendMessage") if c.at > limited.at]
    assert later and min(c.at for c in later) - limited.at >= 0.9, \
        "nothing was sent before retry_after passed"
    assert [line["retry_after"] for line in logs
            if line["event"] == "telegram_rate_limited"] == [1.0]


async def test_telegram_down_at_start_and_while_a_desk_trades_never_holds_the_desk_up(
        scripted_server: ScriptedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", SMALL_ORDER)]),
                        Reply("Bought 0.01 BTC."),
                        Reply(tool_calls=[ToolCall("place_order", SMALL_ORDER)]),
                        Reply("Bought 0.01 BTC."))
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        async with telegram_daemon(tmp_path, scripted_server.base_url,
                                   down_at_start=True) as run:
            telegram = run.telegram
            # Down from the start: the daemon runs and its desk trades all the same.
            assert await _trade_through_the_api(run) < 5
            assert telegram.methods("sendMessage") == []
            telegram.set_down(False)
            await until(lambda: all(_fills(run, chat) for chat in (ANN.id, VIV.id, OWEN.id)),
                        "the fill told once Telegram is back", within=20)
            # Down again while the desk trades: the turn ends on time, the news waits.
            telegram.set_down(True)
            went_down = time.monotonic()
            assert await _trade_through_the_api(run) < 5
            await until(lambda: [c for c in telegram.calls if c.method == "sendMessage"
                                 and c.status == 0 and c.at > went_down],
                        "the fill tried while Telegram is down")
            telegram.set_down(False)
            await until(lambda: all(len(_fills(run, chat)) == 2
                                    for chat in (ANN.id, VIV.id, OWEN.id)),
                        "the second fill told once Telegram is back again", within=20)
            # The stand-in records a call before its answer reaches the bot, which logs the
            # outage's end once it has that answer.
            await until(lambda: any(line["event"] == "telegram_reachable_again"
                                    for line in logs), "the outage's end logged")
    events = [line["event"] for line in logs]
    assert events.count("telegram_unreachable_at_start") == 1
    assert events.count("telegram_unreachable") == 1
    assert "telegram_reachable_again" in events
    everything = "\n".join(str(line) for line in logs) + caplog.text
    assert BOT_TOKEN not in everything and BOT_TOKEN.split(":")[1] not in everything
    scripted_server.assert_complete()


async def test_an_answer_longer_than_a_telegram_message_comes_in_several(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    report = "\n".join(f"Line {n}: the market moved {n % 7} ticks." for n in range(300))
    assert len(report) > 2 * 4096
    scripted_server.add(Reply(report, text_chunks=12))
    async with telegram_daemon(tmp_path, scripted_server.base_url) as run:
        telegram = run.telegram
        telegram.say(ANN, "Write me the long report.")
        await until(lambda: "".join(telegram.texts(ANN.id)) == report, "the whole report")
    texts = telegram.texts(ANN.id)
    assert len(texts) == 3 and all(len(t) <= 4096 for t in texts)
    assert all(t.endswith("\n") for t in texts[:-1]), "cut at line breaks"


async def test_a_chart_a_tool_drew_comes_as_a_photo(scripted_server: ScriptedServer,
                                                    tmp_path: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("render_chart", {"symbol": "BTC/USDT"})]),
                        Reply("Here is the chart."))
    async with telegram_daemon(tmp_path, scripted_server.base_url,
                               desks={"alpha": {"tools": ["render_chart"]}}) as run:
        telegram = run.telegram
        telegram.say(ANN, "Show me a chart of BTC.")
        [photo] = await until(lambda: [m for m in telegram.messages(ANN.id) if m.photo],
                              "the chart as a photo")
        await until(lambda: any(t.endswith("Here is the chart.") for t in telegram.texts(ANN.id)),
                    "the answer")
    assert photo.photo is not None and photo.photo.startswith(b"\x89PNG")
    assert photo.text.startswith("alpha: ")
    assert telegram.methods("sendPhoto")[0].params["photo"]["file"] == photo.photo
    assert telegram.messages(VIV.id) == [], "only the chat that asked"
    scripted_server.assert_complete()


async def test_a_token_telegram_refuses_is_logged_once_without_the_token_and_desks_run(
        scripted_server: ScriptedServer, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", SMALL_ORDER)]),
                        Reply("Bought 0.01 BTC."))
    caplog.set_level(logging.DEBUG)
    wrong = "7000001:AAH-a-revoked-token-9876543210zyxw"
    monkeypatch.setitem(ENVIRON, "TELEGRAM_BOT_TOKEN", wrong)
    with structlog.testing.capture_logs() as logs:
        async with telegram_daemon(tmp_path, scripted_server.base_url, connected=False) as run:
            await until(lambda: len(run.telegram.methods("getMe", answered=False)) >= 2,
                        "getMe tried again")
            assert await _trade_through_the_api(run) < 5
    refused = [line for line in logs if line["event"] == "telegram_unreachable_at_start"]
    assert len(refused) == 1 and "InvalidToken" in refused[0]["error"]
    everything = "\n".join(str(line) for line in logs) + caplog.text
    assert wrong not in everything and wrong.split(":")[1] not in everything
