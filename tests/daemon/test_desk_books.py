"""A desk's books follow its feed: resting paper orders fill and the risk day is recorded on
each new candle, with no tool call; desks on one replay config share one replayed clock."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon_config import write_daemon_config
from tests.scripted_server import ScriptedServer
from trading_agent.agent.trigger import Trigger
from trading_agent.app.services import open_daemon
from trading_agent.daemon.triggers import MarketWatcher
from trading_agent.errors import RiskLimitError
from trading_agent.settings import Settings, load_settings
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.store.store import database_path
from trading_agent.telemetry.webhooks import SIGNATURE_HEADER, TIMESTAMP_HEADER, verify_signature
from trading_agent.trading.exchange import Candle, OrderRequest
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import RiskPolicy

START = datetime(2024, 1, 1, 23, 40, tzinfo=UTC)
DAY_TWO = date(2024, 1, 2)

# open, high, low, close of consecutive 5m candles from 23:40; two are history at the start
# (replayed time 23:50).
CANDLES = [
    ("1000", "1000", "1000", "1000"),  # 23:40
    ("1000", "1000", "1000", "1000"),  # 23:45
    ("1000", "1000", "940", "990"),    # 23:50: trades through a buy at 950
    ("990", "1000", "990", "1000"),    # 23:55, closes at 00:00: the new day starts at 1000
    ("1000", "1000", "940", "940"),    # 00:00: down 60 on one BTC
    ("940", "1010", "940", "1010"),    # 00:05: and back above the day's start
]


def _write_candles(path: Path) -> None:
    lines = ["timestamp_ms,open,high,low,close,volume"]
    for index, (open_, high, low, close) in enumerate(CANDLES):
        opened = int((START + timedelta(minutes=5 * index)).timestamp() * 1000)
        lines.append(f"{opened},{open_},{high},{low},{close},1")
    path.write_text("\n".join(lines) + "\n")


def _config(folder: Path, base_url: str, *, desks: dict[str, Any] | None = None,
            tables: dict[str, Any] | None = None) -> Path:
    candles = folder / "btc.csv"
    _write_candles(candles)
    return write_daemon_config(
        folder, base_url, model={"request_timeout": None},
        exchange={"replay": {"files": {"BTC/USDT": str(candles)}, "speed": 0,
                             "start_offset": 2}},
        tables=tables,
        desks={"alpha": {"system_prompt": "You are alpha.",
                         "exchange": {"paper": {"starting_balances": {"USDT": "1000"}}}},
               "beta": {"system_prompt": "You are beta.",
                        "exchange": {"paper": {"starting_balances": {"USDT": "1000",
                                                                     "BTC": "1"}}},
                        "risk": {"max_daily_loss": "50"}},
               **(desks or {})})


async def _until(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    try:
        with anyio.fail_after(10):
            while not await condition():  # noqa: ASYNC110 (state in SQLite and the feed)
                await anyio.sleep(0.005)
    except TimeoutError:
        raise TimeoutError(f"timed out waiting for {what}") from None


async def test_resting_orders_fill_and_the_risk_day_starts_on_candles_without_a_tool_call(
        scripted_server: ScriptedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_SECRET", "s3cret-for-hooks")
    with _Receiver() as receiver:
        hook = {"url": receiver.url, "events": ["fill", "kill_switch"],
                "secret_env": "HOOK_SECRET"}
        settings = load_settings(_config(tmp_path, scripted_server.base_url,
                                         tables={"webhooks": [hook]}))
        await _run_books(settings)
        with anyio.fail_after(10):
            while len(receiver.received) < 2:  # noqa: ASYNC110
                await anyio.sleep(0.02)

    # The fill and the halt reached the webhook, signed with its secret.
    kinds = [body["kind"] for _, body in receiver.received]
    assert kinds == ["fill", "kill_switch"]
    for headers, _ in receiver.received:
        assert verify_signature(b"s3cret-for-hooks", headers["raw"],
                                headers[TIMESTAMP_HEADER.lower()],
                                headers[SIGNATURE_HEADER.lower()])
    fill = receiver.received[0][1]["event"]
    assert fill["type"] == "order_filled" and fill["desk"] == "alpha"
    assert fill["text"].startswith("Order P1 filled: bought 0.5 BTC on BTC/USDT at 950 (fee ")


async def _run_books(settings: Settings) -> None:
    database = database_path(settings.state_directory())
    async with open_daemon(settings) as daemon:
        alpha, beta = daemon.venues["alpha"], daemon.venues["beta"]
        risk = beta.risk
        assert isinstance(alpha.exchange.inner, PaperExchange) and risk is not None
        feed = alpha.feed
        assert isinstance(feed, ReplayFeed)
        await alpha.exchange.create_order(
            OrderRequest("BTC/USDT", "buy", "limit", Decimal("0.5"), Decimal("950")))
        supervisor = daemon.supervisor
        # The test moves the replay itself, one candle at a time, and waits for what each
        # candle must do to the books before it publishes the next.
        supervisor.services.clear()
        books = await SqlitePaperBooks.open(database, "alpha")
        try:
            async with anyio.create_task_group() as group:
                await group.start(supervisor.run)

                feed.advance()  # 23:50, low 940: the resting buy at 950 fills
                await _until(lambda: _has_fills(books), "the resting order to fill")
                snapshot = await books.load()

                feed.advance()  # closes at 00:00: beta's day starts at 1000 USDT + 1 BTC
                await _until(lambda: _day_known(risk), "beta's new day")
                feed.advance()  # down to 940: 60 lost, past the limit of 50
                await _until(lambda: _halted(risk), "beta's halt")
                feed.advance()  # back to 1010, above the day's start
                await _until(lambda: _caught_up(feed), "the last candle")

                with pytest.raises(RiskLimitError, match="max_daily_loss") as refused:
                    await risk.place_order(
                        OrderRequest("BTC/USDT", "buy", "market", Decimal("0.01")))
                supervisor.shutdown()
        finally:
            await books.close()

    # The books on disk hold the fill at the order's price, the maker fee paid in USDT.
    assert snapshot.open_orders == []
    assert snapshot.balances["BTC"] == (Decimal("0.5"), Decimal(0))
    assert snapshot.balances["USDT"] == (Decimal("1000") - Decimal("475") * Decimal("1.0008"),
                                         Decimal(0))
    day = risk.journal.day(DAY_TWO)
    assert day is not None and day.start_equity == Decimal("2000")
    assert "daily loss 60" in str(refused.value)


async def _has_fills(books: SqlitePaperBooks) -> bool:
    return bool(await books.fills())


async def _day_known(risk: RiskPolicy) -> bool:
    return risk.journal.day(DAY_TWO) is not None


async def _halted(risk: RiskPolicy) -> bool:
    day = risk.journal.day(DAY_TWO)
    return day is not None and day.halted is not None


async def _caught_up(feed: ReplayFeed) -> bool:
    return feed.finished


async def test_desks_on_one_replay_config_share_one_feed_and_one_replay_task(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    gamma = {"system_prompt": "You are gamma.", "exchange": {"replay": {"start_offset": 4}}}
    settings = load_settings(_config(tmp_path, scripted_server.base_url,
                                     desks={"gamma": gamma}))

    async with open_daemon(settings) as daemon:
        venues = daemon.venues
        supervisor = daemon.supervisor
        shared = venues["alpha"].feed
        assert venues["beta"].feed is shared
        assert venues["gamma"].feed is not shared
        assert [name for name, _ in supervisor.services] == [
            "replay 1 (BTC/USDT)", "replay 2 (BTC/USDT)", "spend caps"]
        assert all(name == "market" for runtime in supervisor.runtimes
                   for name, _ in runtime.services)
        async with anyio.create_task_group() as group:
            await group.start(supervisor.run)
            await _until(lambda: _finished(shared, venues["gamma"].feed), "both replays")
            supervisor.shutdown()
        alpha_now = venues["alpha"].exchange.now()
        beta_now = venues["beta"].exchange.now()
        beta_risk = venues["beta"].risk

    # Both desks saw the whole replay, on the same clock: the last candle's close.
    assert alpha_now == beta_now == START + timedelta(minutes=5 * len(CANDLES))
    assert beta_risk is not None and beta_risk.journal.day(DAY_TWO) is not None


async def _finished(*feeds: object) -> bool:
    return all(isinstance(feed, ReplayFeed) and feed.finished for feed in feeds)


def _candle(symbol: str, minute: int, close: str) -> Candle:
    price = Decimal(close)
    return Candle(symbol, "5m", START + timedelta(minutes=minute), price, price, price, price,
                  Decimal(1))


async def test_the_books_are_kept_once_per_candle_time_before_its_triggers_fire() -> None:
    feed = ReplayFeed({"BTC/USDT": [_candle("BTC/USDT", 5 * i, c)
                                    for i, c in enumerate(["100", "100", "102", "103"])],
                       "ETH/USDT": [_candle("ETH/USDT", 5 * i, c)
                                    for i, c in enumerate(["10", "10", "10", "10"])]},
                      speed=0, start_offset=1)
    seen: list[str] = []

    async def keep_books() -> None:
        await anyio.sleep(0.001)  # the books take time; the triggers wait for them
        seen.append("books")

    def fire(trigger: Trigger) -> None:
        seen.append(f"{trigger.kind} {trigger.source}")

    watcher = MarketWatcher(feed, ["BTC/USDT"], fire, move_percent=1.0, on_step=keep_books)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            group.start_soon(feed.run)
            await watcher.run()  # until the replay ends

    # Once per candle time (not per symbol), and each tick (102, then 103: 1% or more from
    # 100) after its candle's books.
    assert seen == ["books", "books", "tick BTC/USDT", "books", "tick BTC/USDT"]


class _Receiver:
    """A webhook receiver on 127.0.0.1: keeps each POST's headers (and raw body) and JSON."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, Any], dict[str, Any]]] = []
        received = self.received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                headers: dict[str, Any] = {k.lower(): v for k, v in self.headers.items()}
                headers["raw"] = raw
                received.append((headers, json.loads(raw)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> _Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
