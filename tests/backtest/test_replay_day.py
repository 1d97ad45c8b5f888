"""A live day, replayed: a paper desk's short day through the daemon (in process, the
scripted model on loopback), then ``backtest --from-desk`` over it.

The day: a price move wakes the desk; while its first request is out the feed steps and an
operator writes (delivered mid-turn); it buys at market, at the new candle's price. An
operator's message while it is idle opens a turn of its own, which rests a limit sell; the
next candle fills it and the one after wakes the desk once more. The replay must send the
same requests, byte for byte, and make the same orders and fills; a tampered prompt, stored
message or stored fill must be named as the first difference, with exit code 3.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon_config import write_daemon_config
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from tests.waiting import wait_until
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import TurnEnded
from trading_agent.app.services import open_daemon
from trading_agent.backtest.desk_journal import journal_paths
from trading_agent.backtest.replay_day import ReplaySpec, replay_desk_day
from trading_agent.cli import main
from trading_agent.settings import load_settings
from trading_agent.trading.replay import ReplayFeed

START = datetime(2024, 3, 1, tzinfo=UTC)
CANDLES = [  # open, high, low, close
    ("100", "100", "100", "100"), ("100", "100", "100", "100"),  # the history (start_offset)
    ("100", "103", "100", "103"),    # +3%: a tick
    ("103", "103.8", "103", "103.5"),  # steps while the model thinks: the buy fills at 103.5
    ("103.5", "104.5", "102", "102"),  # the limit sell at 104 fills; no tick (-0.97%)
    ("102", "102", "100", "100.5"),   # -2.4% from 103: a tick
    ("100.5", "101", "100", "100.5"),
]
SPAN = ("2024-03-01T00:00", "2024-03-01T01:00")
BUY = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.5"}
SELL = {"symbol": "BTC/USDT", "side": "sell", "type": "limit", "amount": "0.5", "price": "104"}


def _replies(hold: threading.Event | None = None) -> list[Reply]:
    """The model's answers of the day, in order (the same for the live day and a re-ask)."""
    return [
        Reply(tool_calls=[ToolCall("place_order", BUY, id="call_buy")], hold_until=hold),
        Reply("Bought 0.5 BTC; noted your message."),
        Reply(tool_calls=[ToolCall("place_order", SELL, id="call_sell")]),
        Reply("A limit sell rests at 104."),
        Reply("The sell filled; holding cash."),
    ]


def _config(folder: Path, base_url: str, *, prompt: str = "You are the trading desk alpha.",
            mode: str = "paper", file_name: str = "paper.toml") -> Path:
    lines = ["timestamp_ms,open,high,low,close,volume"]
    for index, (open_, high, low, close) in enumerate(CANDLES):
        opened = int((START + timedelta(minutes=5 * index)).timestamp() * 1000)
        lines.append(f"{opened},{open_},{high},{low},{close},1")
    (folder / "btc.csv").write_text("\n".join(lines) + "\n")
    exchange: dict[str, Any] = {
        # A replay that never steps by itself: the test moves it, candle by candle.
        "replay": {"files": {"BTC/USDT": str(folder / "btc.csv")}, "speed": 0.0001,
                   "start_offset": 2},
        "paper": {"starting_balances": {"USDT": "1000"}, "taker_fee": "0.001",
                  "maker_fee": "0.001", "slippage_bps": "0"}}
    if mode == "live":
        exchange = {"mode": "live", "feed": "ccxt", "ccxt": {
            "exchange_id": "binance", "api_key_env": "NO_KEY", "secret_env": "NO_SECRET"}}
    return write_daemon_config(
        folder, base_url, model={"request_timeout": None},
        desks={"alpha": {"system_prompt": prompt, "tools": ["place_order", "get_positions"],
                         "risk": {"max_order_notional": "100000",
                                  "max_position_notional": "100000"},
                         "triggers": {"ticks": {"move_percent": 2}},
                         "exchange": exchange}},
        file_name=file_name)


async def _live_day(folder: Path, server: ScriptedServer) -> Path:
    """Runs the day through the daemon; returns its config."""
    hold = threading.Event()
    server.add(*_replies(hold))
    config = _config(folder, server.base_url)
    async with open_daemon(load_settings(config)) as daemon:
        venue = daemon.venues["alpha"]
        feed = venue.feed
        assert isinstance(feed, ReplayFeed)
        bus: EventBus = daemon.event_bus
        with bus.subscribe("test", accept=lambda e: isinstance(e, TurnEnded)) as ended:
            turns: list[Any] = []

            async def turns_ended(count: int) -> None:
                def done() -> bool:
                    while (event := ended.get_nowait()) is not None:
                        turns.append(event)
                    return len(turns) >= count
                await wait_until(done, f"{count} turns to end")

            async with anyio.create_task_group() as group:
                await group.start(daemon.supervisor.run)
                desk = daemon.supervisor.runtime("alpha").desk
                feed.advance()  # +3%: a tick
                await server.wait_for_requests(1)
                # While the model thinks, the feed steps (the buy fills at the new price) and
                # an operator writes (delivered before the next request).
                feed.advance()
                await desk.send_message("Keep it small today.", source="ops")
                hold.set()
                await turns_ended(1)
                await desk.send_message("Sell it if it reaches 104.", source="ops")
                await turns_ended(2)
                feed.advance()  # the sell fills on this candle
                async def both_filled() -> bool:
                    return len(await venue.books.fills()) == 2
                await wait_until(both_filled, "the limit sell to fill")
                feed.advance()  # a tick
                await turns_ended(3)
                assert len(await venue.books.fills()) == 2
                daemon.supervisor.shutdown()
    server.assert_complete()
    return config


def _spec(config: Path, **changes: Any) -> ReplaySpec:
    settings = load_settings(config)
    start, end = (datetime.fromisoformat(t).replace(tzinfo=UTC) for t in SPAN)
    return ReplaySpec(settings, "alpha", start, end, settings.state_directory(), **changes)


def _bodies(requests: Sequence[Any]) -> list[bytes]:
    return [request.body for request in requests]


async def test_a_paper_desks_day_replays_byte_for_byte(scripted_server: ScriptedServer,
                                                       tmp_path: Path) -> None:
    config = await _live_day(tmp_path, scripted_server)
    live = list(scripted_server.requests)
    assert len(live) == 5
    assert "Keep it small today." in json.dumps(live[1].json)  # delivered mid-turn
    journal = journal_paths(load_settings(config).state_directory(), "alpha")[0]
    stored = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [line["fill"]["price"] for line in stored if line["kind"] == "fill"] == [
        "103.5", "104"]  # the buy at the candle that closed while the model thought

    # From the stored answers (the strict cache): every request matched, orders and fills too.
    outcome = await replay_desk_day(_spec(config))
    assert outcome.difference is None, outcome.summary()
    assert (outcome.turns, outcome.requests, outcome.orders, outcome.fills) == (
        3, 5, (2, 2), (2, 2))
    assert outcome.summary().splitlines()[1].startswith("Matched: every request was byte")

    # Asking the model again, what reaches the server is what the desk sent live, byte for
    # byte.
    scripted_server.add(*_replies())
    again = await replay_desk_day(_spec(config, ask_model=True))
    assert again.difference is None, again.summary()
    assert _bodies(scripted_server.requests[5:]) == _bodies(live)
    scripted_server.assert_complete()

    # The daemon starts again on the same state: the desk goes on from its stored
    # conversation (its replay starts over at the first candle). The first run still replays.
    scripted_server.add(Reply("Back again."))
    async with open_daemon(load_settings(config)) as daemon:
        feed = daemon.venues["alpha"].feed
        assert isinstance(feed, ReplayFeed)
        async with anyio.create_task_group() as group:
            await group.start(daemon.supervisor.run)
            feed.advance()  # +3%: a tick
            await wait_until(lambda: len(scripted_server.requests) == 11, "the turn")
            await wait_until(lambda: '"continued"' in journal.read_text(), "the note")
            daemon.supervisor.shutdown()
    after = await replay_desk_day(_spec(config))
    assert (after.difference, after.turns, after.later_runs) == (None, 3, 1)
    assert "the daemon started the desk 1 more time" in after.summary()


async def test_a_changed_prompt_or_stored_message_is_named(scripted_server: ScriptedServer,
                                                           tmp_path: Path) -> None:
    config = await _live_day(tmp_path, scripted_server)
    out = tmp_path / "out"

    changed = _config(tmp_path, scripted_server.base_url, prompt="You are the desk alpha.",
                      file_name="changed.toml")
    code, printed = await _cli(changed, out)
    assert code == 3
    assert "DIFFERS (request): in turn 1 (tick trigger at 2024-03-01 00:15 UTC" in printed
    assert "the system prompt changed: recorded \"You are the trading desk alpha.\", now " \
           "\"You are the desk alpha.\"" in printed
    report = json.loads((out / "replay.json").read_text())
    assert report["matched"] is False and report["difference"]["what"] == "request"

    journal = journal_paths(load_settings(config).state_directory(), "alpha")[0]
    text = journal.read_text()
    journal.write_text(text.replace("Sell it if it reaches 104.", "Sell it if it reaches 105."))
    code, printed = await _cli(config, out, "--force")
    assert code == 3
    assert ("DIFFERS (request): in turn 2 (operator trigger at 2024-03-01 00:20 UTC: "
            "\"Sell it if it reaches 105.\"), no recorded answer for request 3 (strict "
            "cache): message 6 of 6 (user, text) differs from the recording: recorded "
            "\"… it if it reaches 104.\", now \"… it if it reaches 105.\"") in printed

    # A fill that differs, every request the same: named by its client order id and field.
    journal.write_text(text.replace('"price":"104","fee"', '"price":"104.5","fee"', 1))
    code, printed = await _cli(config, out, "--force")
    assert code == 3
    assert re.search(r"DIFFERS \(fill\): fill 2 \(ta\w+\) differs: price live '104.5', "
                     r"replayed '104'", printed), printed

    journal.write_text(text)
    code, printed = await _cli(config, out, "--force")
    assert code == 0, printed
    assert "Matched" in printed


async def _cli(config: Path, out: Path, *more: str) -> tuple[int, str]:
    """``trading-agent backtest CONFIG --from-desk alpha``, in a thread (it runs its own
    event loop); the exit code and what it printed."""
    printed = io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            return main(["backtest", str(config), "--from-desk", "alpha", "--from", SPAN[0],
                         "--to", SPAN[1], "--out", str(out), *more])

    code = await anyio.to_thread.run_sync(run)
    return code, printed.getvalue()


@pytest.mark.parametrize(("case", "expected"), [
    ("unknown", "no desk named 'beta'; the desks are alpha"),
    ("empty", "desk 'alpha': nothing stored to replay"),
    ("before", "desk 'alpha': nothing stored from 2024-02-01 00:00 to 2024-02-02 00:00 UTC "
               "(feed time); its journal begins at 2024-03-01 00:10 UTC"),
    ("live", "desks.alpha.exchange.mode is \"live\": only a paper desk's day can be replayed"),
    ("continued", "desk 'alpha': its first stored run, from 2024-03-01 00:10 UTC (feed time), "
                  "went on from 7 messages an earlier run left in the store"),
])
def test_bad_input_is_one_clear_line(tmp_path: Path, case: str, expected: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, "http://127.0.0.1:9/v1", mode="live" if case == "live"
                     else "paper")
    span = ["--from", SPAN[0], "--to", SPAN[1]]
    desk = "beta" if case == "unknown" else "alpha"
    journal = journal_paths(load_settings(config).state_directory(), "alpha")[0]
    start = '{"v":1,"kind":"start","at":"2024-03-01T00:%s:00+00:00"}\n'
    if case in ("before", "continued"):
        journal.parent.mkdir(parents=True)
        journal.write_text(start % "10")
    if case == "before":
        span = ["--from", "2024-02-01", "--to", "2024-02-02"]
    elif case == "continued":
        journal.write_text(start % "10" + '{"v":1,"kind":"continued","messages":7}\n')

    code = main(["backtest", str(config), "--from-desk", desk, *span, "--out",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "out").exists()
