"""Through the daemon: a paper desk's stop fires on a candle with no tool call; the operators
see a ``protection`` event and the desk is told in a turn of its own."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import anyio

from tests.daemon_config import write_daemon_config
from tests.scripted_server import Reply, ScriptedServer
from tests.waiting import wait_until
from trading_agent.app.services import open_daemon
from trading_agent.daemon.events import ProtectionReported
from trading_agent.settings import load_settings
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.replay import ReplayFeed

START = datetime(2024, 1, 1, tzinfo=UTC)
CANDLES = [("100", "100", "100", "100"), ("100", "100", "100", "100"),
           ("99", "100", "97", "98"), ("92", "93", "90", "91")]  # the last gaps below 95


def _config(folder: Path, base_url: str) -> Path:
    lines = ["timestamp_ms,open,high,low,close,volume"]
    for index, (open_, high, low, close) in enumerate(CANDLES):
        opened = int((START + timedelta(minutes=5 * index)).timestamp() * 1000)
        lines.append(f"{opened},{open_},{high},{low},{close},1")
    (folder / "btc.csv").write_text("\n".join(lines) + "\n")
    return write_daemon_config(
        folder, base_url, model={"request_timeout": None},
        exchange={"replay": {"files": {"BTC/USDT": str(folder / "btc.csv")}, "speed": 0,
                             "start_offset": 2},
                  "paper": {"starting_balances": {"USDT": "1000"}, "taker_fee": "0",
                            "slippage_bps": "0"}},
        desks={"alpha": {"system_prompt": "You are alpha."}})


async def test_a_stop_that_fires_tells_the_operators_and_the_desk(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.responder = lambda request: Reply("Noted: the stop closed the trade.")
    settings = load_settings(_config(tmp_path, scripted_server.base_url))
    async with open_daemon(settings) as daemon:
        venue = daemon.venues["alpha"]
        feed = venue.feed
        assert isinstance(feed, ReplayFeed)
        assert venue.risk is not None and venue.protection is not None
        entry = OrderRequest("BTC/USDT", "buy", "market", Decimal(1), turn="t0")
        await venue.protection.attach(entry, Decimal(95), Decimal(110))
        await venue.risk.place_order(entry)  # fills at 100, the last close
        with daemon.event_bus.subscribe("test", accept=lambda e: isinstance(
                e, ProtectionReported)) as reported:
            async with anyio.create_task_group() as group:
                await group.start(daemon.supervisor.run)
                feed.advance()  # low 97: above the stop
                feed.advance()  # opens at 92: through the stop at 95
                event = await wait_until(reported.get_nowait, "the protection event")
                await wait_until(lambda: any("stop-loss at 95" in str(m.get("content"))
                                             for r in scripted_server.requests
                                             for m in r.messages), "the desk to be told")
                [trade] = await venue.books.trades()
                daemon.supervisor.shutdown()

    assert isinstance(event, ProtectionReported)
    assert (event.desk, event.what, event.kind, event.exit_price, event.profit) == (
        "alpha", "fired", "stop_loss", "92", "-8")
    assert event.text == ("alpha: the BTC/USDT stop-loss at 95 closed 1 BTC at 92 (fired on "
                          "the candle of 2024-01-01 00:15 UTC); the trade's profit -8.00 "
                          "USDT.")
    assert (trade.exit_price, trade.exit_reason) == (Decimal(92), "stop_loss")
