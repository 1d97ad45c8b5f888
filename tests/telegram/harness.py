"""A daemon with its Telegram bot against the Bot API stand-in, for the bot's tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.daemon_config import write_daemon_config
from tests.operator.harness import InProcessDaemon, in_process_daemon
from tests.telegram_standin import BotApiStandIn, User, running_standin, until

__all__ = ["ANN", "BOT_TOKEN", "OWEN", "STRANGER", "VIV", "TelegramRun", "telegram_daemon"]

BOT_TOKEN = "7000001:AAH-test-token-0123456789abcdefghij"
"""The bot's token (what BotFather would give): in the daemon's environment only."""

ANN = User(1001, "Ann")
"""A trader."""

VIV = User(1002, "Viv")
"""A viewer."""

OWEN = User(1003, "Owen")
"""An owner."""

STRANGER = User(4242, "Mallory")
"""Not an operator."""

OPERATORS = [
    {"name": "ann", "role": "trader", "token_env": "ANN_TOKEN", "telegram_user_id": ANN.id},
    {"name": "viv", "role": "viewer", "token_env": "VIV_TOKEN", "telegram_user_id": VIV.id},
    {"name": "owen", "role": "owner", "token_env": "OWEN_TOKEN", "telegram_user_id": OWEN.id},
]

ENVIRON = {"TELEGRAM_BOT_TOKEN": BOT_TOKEN, "ANN_TOKEN": "ann-token-0123456789abcdef",
           "VIV_TOKEN": "viv-token-0123456789abcdef", "OWEN_TOKEN": "owen-token-0123456789abc"}


@dataclass
class TelegramRun:
    """The daemon and the stand-in it talks to."""

    running: InProcessDaemon
    telegram: BotApiStandIn


@contextlib.asynccontextmanager
async def telegram_daemon(folder: Path, model_url: str, *,
                          telegram: Mapping[str, Any] | None = None,
                          operator: Mapping[str, Any] | None = None,
                          desks: Mapping[str, Any] | None = None,
                          connected: bool = True,
                          down_at_start: bool = False) -> AsyncIterator[TelegramRun]:
    """A daemon (one paper desk, ``alpha``, whose orders above 1,000 USDT wait for approval)
    with ``[telegram]`` pointed at a started stand-in; waits until the bot polls unless
    ``connected`` is False (or Telegram is ``down_at_start``)."""
    async with running_standin(BOT_TOKEN) as standin:
        standin.names.update({user.id: user.first_name for user in (ANN, VIV, OWEN, STRANGER)})
        standin.set_down(down_at_start)
        config = write_daemon_config(
            folder, model_url,
            operator={"approval_timeout_seconds": 30, "approval_notional_threshold": 1000,
                      "operators": OPERATORS, **(operator or {})},
            tables={"telegram": {"token_env": "TELEGRAM_BOT_TOKEN", "default_desk": "alpha",
                                 "base_url": standin.base_url, "edit_interval_seconds": 0.2,
                                 "poll_timeout_seconds": 2, **(telegram or {})}},
            desks=desks or {"alpha": {"system_prompt": "You are alpha.",
                                      "tools": ["get_ticker", "place_order"],
                                      "risk": {"max_order_notional": "10000"}}})
        async with in_process_daemon(config, ENVIRON) as running:
            if connected and not down_at_start:
                await until(lambda: standin.methods("getUpdates", answered=False),
                            "the bot's first long poll")
            yield TelegramRun(running, standin)
