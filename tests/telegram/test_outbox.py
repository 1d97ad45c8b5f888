"""The outbox against the Bot API stand-in: bounded while Telegram is down, and a streamed
answer's superseded edits never sent."""

from __future__ import annotations

import anyio
import structlog

from telegram import Bot
from tests.telegram.harness import ANN, BOT_TOKEN
from tests.telegram_standin import running_standin, until
from trading_agent.telegram.outbox import Outbox, SendMessage, StreamMessage


async def test_while_telegram_is_down_the_queue_keeps_the_newest_and_sends_the_latest_text(
        ) -> None:
    async with running_standin(BOT_TOKEN) as telegram, \
            Bot(BOT_TOKEN, base_url=f"{telegram.base_url}/bot") as bot, \
            anyio.create_task_group() as group:
        outbox = Outbox(bot, BOT_TOKEN, edit_interval=0.05, max_queued=10)
        group.start_soon(outbox.run)
        telegram.set_down(True)
        stream = StreamMessage(ANN.id, "alpha", "turn-1")
        with structlog.testing.capture_logs() as logs:
            outbox.post(SendMessage(ANN.id, "notice 0"))
            await until(lambda: telegram.methods("sendMessage", answered=False),
                        "the first try, cut")
            for n in range(1, 15):
                outbox.post(SendMessage(ANN.id, f"notice {n}"))
            for n in range(50):
                stream.text += f"{n} "
                outbox.update_stream(stream)
            stream.final = True
            outbox.update_stream(stream)
            telegram.set_down(False)
            await until(lambda: any(t.startswith("0 1 2") for t in telegram.texts(ANN.id)),
                        "the streamed answer")
        group.cancel_scope.cancel()
    texts = telegram.texts(ANN.id)
    assert outbox.dropped == 5
    assert texts[:10] == ["notice 0", *(f"notice {n}" for n in range(6, 15))]
    assert texts[10:] == [" ".join(str(n) for n in range(50)) + " "]
    assert telegram.methods("editMessageText") == [], "only the latest text was sent"
    events = [line["event"] for line in logs]
    assert events.count("telegram_queue_full") == 5
    assert events.count("telegram_unreachable") == 1
