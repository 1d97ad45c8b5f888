"""The commands, each checked against the operator's role, and their audit rows."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.operator.harness import uds_client
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from tests.telegram.harness import ANN, OWEN, VIV, telegram_daemon
from tests.telegram_standin import BotApiStandIn, User, until

ORDER = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.1"}


async def _ask(telegram: BotApiStandIn, user: User, command: str) -> str:
    """Sends a command and returns the bot's next message to that user."""
    before = len(telegram.texts(user.id))
    telegram.say(user, command)
    await until(lambda: len(telegram.texts(user.id)) > before, f"the answer to {command}")
    return telegram.texts(user.id)[before]


async def test_each_command_answers_within_the_operators_role_and_is_audited(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    async with telegram_daemon(tmp_path, scripted_server.base_url) as run:
        telegram = run.telegram
        assert (await _ask(telegram, ANN, "/kill on")) == \
            "/kill needs the owner role; you are a trader."
        assert (await _ask(telegram, ANN, "/reload")) == \
            "/reload needs the owner role; you are a trader."
        assert (await _ask(telegram, ANN, "/desk beta")).startswith(
            "Refused: there is no desk 'beta'; the desks: alpha")
        assert (await _ask(telegram, ANN, "/desks")).startswith("→ alpha: idle, paper")
        assert (await _ask(telegram, VIV, "/status")).startswith("alpha: idle (paper")
        assert (await _ask(telegram, VIV, "/positions")) == "alpha positions:\nNo open positions."
        assert (await _ask(telegram, VIV, "/trades")) == "alpha trades:\nNo trades."
        assert (await _ask(telegram, VIV, "/balance")).startswith("alpha (paper): equity ")
        assert (await _ask(telegram, ANN, "/pin Never trade on Fridays.")) == \
            "Pinned #1 to alpha: Never trade on Fridays."
        assert (await _ask(telegram, VIV, "/pins")).startswith("#1 by ann at ")
        assert (await _ask(telegram, VIV, "/unpin 1")) == \
            "/unpin needs the trader role; you are a viewer."
        assert (await _ask(telegram, ANN, "/unpin 1")) == "Unpinned #1 from alpha."
        telegram.say(OWEN, "/kill on Exchange trouble")
        await until(lambda: any(t.startswith("Kill switch ON for desk alpha: ")
                                for t in telegram.texts(OWEN.id)), "the kill switch on")
        await until(lambda: any(t.startswith("alpha: kill switch ON") and
                                t.endswith("Exchange trouble") for t in telegram.texts(VIV.id)),
                    "the kill switch notification")
        telegram.say(OWEN, "/kill off")  # its answer and the notifications, in any order
        await until(lambda: any(t.startswith("Kill switch off for desk alpha")
                                for t in telegram.texts(OWEN.id)), "the kill switch off")
        telegram.say(VIV, "/help")
        [help_text] = await until(lambda: [t for t in telegram.texts(VIV.id)
                                           if t.startswith("You are viv, a viewer.")], "/help")
        assert "/status" in help_text and "/pause" not in help_text
        async with uds_client(run.running.endpoints.socket_path) as client:
            actions = (await client.get("/api/audit")).json()["actions"]
    rows = [(a["who"], a["action"], a["surface"], a["outcome"]) for a in actions]
    assert rows == [
        ("ann", "kill-switch", "telegram", "refused"),
        ("ann", "reload", "telegram", "refused"),
        ("ann", "pin", "telegram", "ok"),
        ("viv", "unpin", "telegram", "refused"),
        ("ann", "unpin", "telegram", "ok"),
        ("owen", "kill-switch", "telegram", "ok"),
        ("owen", "kill-switch", "telegram", "ok"),
    ]


async def test_an_approval_decided_elsewhere_edits_the_telegram_messages(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    release = threading.Event()
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", ORDER)]),
                        Reply("Denied; no order.", hold_until=release))
    async with telegram_daemon(tmp_path, scripted_server.base_url) as run:
        telegram = run.telegram
        telegram.say(ANN, "Buy 0.1 BTC.")
        await until(lambda: all(any(m.reply_markup for m in telegram.messages(chat))
                                for chat in (ANN.id, VIV.id, OWEN.id)), "the approvals")
        async with uds_client(run.running.endpoints.socket_path) as client:
            [pending] = (await client.get("/api/approvals")).json()["approvals"]
            response = await client.post(f"/api/approvals/{pending['id']}/deny",
                                         json={"reason": "too big"})
            assert response.status_code == 200
        await until(lambda: all(
            any(m.text.endswith(f"❌ denied by {OS_USER}: too big") and not m.reply_markup
                for m in telegram.messages(chat)) for chat in (ANN.id, VIV.id, OWEN.id)),
            "every copy edited")
        release.set()
