"""No tool of a backtest ever sees the future: proved on what the model is sent.

The desk runs through the real engine against a scripted OpenAI-compatible server on
loopback, whose model calls a random but deterministic mix of every desk tool (its choices
come from a hash of the request, so the same request always gets the same answer). Every
request is recorded with the simulated time at which it was made, then checked
(``tests/backtest/recording.py``):

- **Times**: every date and time in a tool result, trigger or operator message is at or
  before the clock; candle tables show candles closed by the clock (a longer timeframe's
  last candle may be forming, built from the closed candles of its bucket alone); tools
  that stamp their answer stamp the clock.
- **Candles and charts**: every candle a table shows is the one built from the candles
  closed by the clock, and every chart is, byte for byte, the chart drawn from them.
- **Prices**: the data is the packaged candles up to a cut time T, and after T the same
  candles at 10,000 times the price, a range no honest number of the run reaches (prices,
  volumes and balances stay below 2 million); nothing sent at or before T names a number
  in it.
- **Truncation** (freqtrade's lookahead-analysis): the same desk re-run on the data cut at
  T, with an operator message making T a decision time. Replayed from the response cache
  recorded by the full run in ``strict`` mode, it must never miss; run against the model
  again, every request made at or before T must be byte for byte the full run's, images
  included.
- **Fills**: an order decided at a close reaches the book at the next open. A market order
  fills there, slipped, with the taker fee, and so does a limit order that open beats; any
  other limit order fills at its own price, with the maker fee, on the first candle from
  then on that trades through it.

Random spans, symbols (BTC/USDT alone or with an ``ETH/USDT`` made from the packaged data)
and desks (schedules, candle closes, tick moves, slippage) come from hypothesis; a fixed busy
day proves every check has something to check; a feed that peeks one candle ahead proves
the checks catch it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.backtest.recording import (
    LookAheadError,
    RequestClock,
    SentRequest,
    check_candle_tables,
    check_charts,
    check_fills,
    check_prices,
    check_same_requests,
    check_times,
    first_sent,
    price_range,
    write_candles,
)
from tests.scripted_server import (
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
)
from trading_agent.backtest.cache import CacheMissError, CacheMode
from trading_agent.backtest.engine import BacktestSpec, ScriptedMessage, run_backtest
from trading_agent.backtest.mask import Mask, MaskedExchange, choose_mask
from trading_agent.backtest.record import BacktestRecord, Decision, FillRecord, TranscriptEntry
from trading_agent.settings import Settings, load_settings
from trading_agent.trading.booked_exchange import STARTING_TURN
from trading_agent.trading.config import PACKAGED_CANDLES, PaperExchangeConfig
from trading_agent.trading.exchange import Candle, Ticker
from trading_agent.trading.replay import ReplayFeed, load_candles_csv

DESK = "probe"
STEP = timedelta(minutes=5)
WARMUP = 288
"""Candles before the start the desk sees at once (the replay's default ``start_offset``)."""
FUTURE_FACTOR = Decimal(10000)
"""After the cut, prices are multiplied by this: BTC near 200 million, the made-up ETH near
14 million, where no honest figure of a run (at most about 1.4 million, a day's volume)
ever goes."""
ETH_FACTOR = Decimal("0.07")
MOST_TOOL_ROUNDS = 3
"""The scripted model ends every turn after at most this many tool rounds, well within the
desk's ``maximum_rounds``: every tool result goes out in the request right after its call,
at the clock of the step that produced it."""
OPERATOR_TEXT = "Operator: review the desk now and act if needed."


# --------------------------------------------------------------------------- the model


_TOOL_WEIGHTS = {
    "get_ticker": 3, "get_candles": 4, "render_chart": 1, "get_order_book": 1,
    "get_balance": 1, "get_positions": 1, "list_open_orders": 1, "get_order": 1,
    "place_order": 5, "cancel_order": 2, "remember": 1, "recall": 1,
}
_AMOUNTS = {"BTC/USDT": ("0.001", "0.002", "0.004"), "ETH/USDT": ("0.01", "0.02", "0.05")}
_HELD = {"BTC/USDT": "0.05", "ETH/USDT": "0.5"}
"""What the desk holds of each base currency at the start, so it can sell too."""
_SYMBOLS = re.compile(r"Desk symbols: (.+)\.$")
_RESTING = re.compile(r"Order (P\d+) placed and resting: \w+ limit [\d.]+ \w+ on (\S+) @")


def _this_turn(messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """The messages since the desk's last final answer (an answer without tool calls)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.get("role") == "assistant" and not message.get("tool_calls"):
            return messages[index + 1:]
    return messages


def _rounds(messages: Sequence[Mapping[str, Any]]) -> int:
    """Tool rounds so far in this turn."""
    return sum(1 for m in _this_turn(messages) if m.get("role") == "assistant")


def _tool_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(m["content"]) for m in messages
            if m.get("role") == "tool" and isinstance(m.get("content"), str)]


def _last_price(messages: Sequence[Mapping[str, Any]], symbol: str) -> Decimal | None:
    pattern = re.compile(rf"^{re.escape(symbol)} last ([\d,]+\.\d+)")
    for text in reversed(_tool_texts(messages)):
        match = pattern.match(text)
        if match:
            return Decimal(match.group(1).replace(",", ""))
    return None


def _pick(rng: random.Random, offered: Sequence[str], symbols: Sequence[str],
          messages: Sequence[Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """One of the ``offered`` tools, with arguments, chosen by ``rng`` from what the
    conversation holds."""
    names = [name for name in _TOOL_WEIGHTS if name in offered]
    name = rng.choices(names, weights=[_TOOL_WEIGHTS[n] for n in names])[0]
    symbol = rng.choice(symbols)
    turn = _this_turn(messages)
    read = [s for s in symbols if _last_price(turn, s) is not None]
    placed = any(call["function"]["name"] == "place_order" for m in turn
                 for call in m.get("tool_calls") or ())
    if read and not placed and "place_order" in offered and rng.random() < 0.5:
        name, symbol = "place_order", rng.choice(read)  # act on the price just read
    resting = [m for text in _tool_texts(messages) for m in _RESTING.finditer(text)]
    if name == "get_candles":
        return name, {"symbol": symbol, "timeframe": rng.choice(("5m", "15m", "1h", "4h", "1d")),
                      "limit": rng.randint(1, 60)}
    if name == "render_chart":
        return name, {"symbol": symbol, "timeframe": rng.choice(("5m", "15m", "1h")),
                      "limit": rng.randint(20, 60)}
    if name == "get_order_book":
        return name, {"symbol": symbol, "depth": rng.randint(1, 5)}
    if name in ("get_balance", "get_positions"):
        return name, {}
    if name == "list_open_orders":
        return name, rng.choice(({}, {"symbol": symbol}))
    if name in ("cancel_order", "get_order"):
        if not resting:
            return "list_open_orders", {}
        chosen = rng.choice(resting)
        return name, {"order_id": chosen.group(1), "symbol": chosen.group(2)}
    if name == "remember":
        return name, {"key": rng.choice(("plan", "levels", "lessons")),
                      "text": "Keep orders small and wait for the trend."}
    if name == "recall":
        return name, rng.choice(({}, {"key": "plan"}, {"search": "orders"}))
    if name == "place_order":
        side = rng.choice(("buy", "sell"))
        # A masked run's symbols (ASSET/USD) take the first symbol's amounts.
        order: dict[str, Any] = {"symbol": symbol, "side": side,
                                 "amount": rng.choice(_AMOUNTS.get(symbol,
                                                                   _AMOUNTS["BTC/USDT"]))}
        # A limit price is the price read this turn (this step: the clock stands still while
        # the desk thinks), mostly moved away on the passive side, so the order rests until
        # a later candle trades through it; sometimes through the market, so the next open
        # beats it.
        last = _last_price(_this_turn(messages), symbol)
        if rng.random() < 0.3:
            return name, {**order, "type": "market"}
        if last is None:
            return "get_ticker", {"symbol": symbol}
        away = Decimal(rng.choice(("-0.002", "0.0005", "0.001", "0.002")))
        price = last * (1 - away) if side == "buy" else last * (1 + away)
        return name, {**order, "type": "limit", "price": str(price.quantize(Decimal("0.01")))}
    return "get_ticker", {"symbol": symbol}


class Model:
    """A run's scripted model: ``answer`` computes each reply from the request and the
    prefix of its tool call ids.

    The ids number the run's requests, so they are the same in every run that asks the same
    things, and distinct even for the same request asked twice (after a compaction whose
    summary swallowed the trigger, two turns may send identical requests): each tool result
    is then told apart, with the clock it was produced at.
    """

    def __init__(self, answer: Callable[[RecordedRequest, str], Step]) -> None:
        self._answer = answer
        self.asked = 0

    def __call__(self, request: RecordedRequest) -> Step:
        """The reply to ``request``."""
        self.asked += 1
        return self._answer(request, f"call_{self.asked:05d}")


def desk_model(request: RecordedRequest, ids: str) -> Step:
    """A model that calls one to three desk tools a round, for up to three rounds a turn.

    Every choice comes from the SHA-256 of the request's body: the same request always gets
    the same answer, in any run.
    """
    if not request.tools:  # the compressor asks for a summary
        return Reply("Summary: the desk read the market and traded small amounts.")
    digest = hashlib.sha256(request.body).hexdigest()
    rng = random.Random(digest)
    messages = request.messages
    rounds = _rounds(messages)
    if rounds >= MOST_TOOL_ROUNDS or (rounds and rng.random() < 0.3):
        return Reply("Done for this turn.")
    offered = {str(t["function"]["name"]): str(t["function"].get("description", ""))
               for t in request.tools}
    listed = _SYMBOLS.search(offered.get("get_ticker", ""))
    symbols = listed.group(1).split(", ") if listed else ["BTC/USDT"]
    calls = [ToolCall(*_pick(rng, list(offered), symbols, messages), id=f"{ids}_{index}")
             for index in range(rng.choice((1, 1, 2, 3)))]
    return Reply(tool_calls=calls)


# --------------------------------------------------------------------------- the data


@functools.cache
def _packaged() -> tuple[Candle, ...]:
    return tuple(load_candles_csv(PACKAGED_CANDLES, "BTC/USDT"))


def _scaled(candle: Candle, symbol: str, factor: Decimal) -> Candle:
    return replace(candle, symbol=symbol, open=candle.open * factor,
                   high=candle.high * factor, low=candle.low * factor,
                   close=candle.close * factor)


@dataclass(frozen=True)
class Scenario:
    """One desk over one span, and where the data is cut.

    Attributes:
        first: The index, in the packaged data, of the span's first candle.
        length: Candles in the span.
        cut_after: Candles of the span before the cut.
        symbols: The desk's symbols.
        schedules: ``every`` intervals of its schedules.
        candle_closes: Timeframes whose closes wake it.
        move_percent: The move that wakes it, if any.
        slippage_bps: The paper exchange's slippage.
    """

    first: int
    length: int
    cut_after: int
    symbols: tuple[str, ...] = ("BTC/USDT",)
    schedules: tuple[str, ...] = ("1h",)
    candle_closes: tuple[str, ...] = ()
    move_percent: float | None = None
    slippage_bps: str = "5"

    @property
    def start(self) -> datetime:
        return _packaged()[self.first].opened_at

    @property
    def end(self) -> datetime:
        return self.start + self.length * STEP

    @property
    def cut(self) -> datetime:
        return self.start + self.cut_after * STEP

    def data(self, *, cut: bool) -> dict[str, list[Candle]]:
        """Each symbol's candles from the warm-up to the end: past the cut at
        :data:`FUTURE_FACTOR` times the price, or (``cut``) none past it."""
        base = _packaged()[self.first - WARMUP:self.first + self.length]
        series: dict[str, list[Candle]] = {}
        for symbol in self.symbols:
            factor = ETH_FACTOR if symbol == "ETH/USDT" else Decimal(1)
            series[symbol] = [
                _scaled(c, symbol, factor * (FUTURE_FACTOR if c.opened_at >= self.cut else 1))
                for c in base if not (cut and c.opened_at >= self.cut)]
        return series

    def future(self) -> dict[str, tuple[Decimal, Decimal]]:
        """Each symbol's price range after the cut."""
        return {symbol: price_range([c for c in series if c.opened_at >= self.cut])
                for symbol, series in self.data(cut=False).items()}

    def config(self, url: str) -> str:
        """The desk's config file."""
        def toml_list(values: Sequence[str]) -> str:
            return "[" + ", ".join(json.dumps(v) for v in values) + "]"

        schedules = ", ".join(f'{{ every = "{every}", name = "every-{every}", message = '
                              '"Scheduled check: review the market." }'
                              for every in self.schedules)
        ticks = [f"on_candle_close = {toml_list(self.candle_closes)}"]
        if self.move_percent is not None:
            ticks.append(f"move_percent = {self.move_percent}")
        files = ", ".join(f'"{symbol}" = "{PACKAGED_CANDLES}"' for symbol in self.symbols)
        # Only currencies the desk can price: the risk policy refuses every order otherwise.
        balances = ", ".join([f'{symbol.partition("/")[0]} = "{_HELD[symbol]}"'
                              for symbol in self.symbols] + ['USDT = "10000"'])
        return f"""
[daemon]
state_dir = "state"
[model]
provider = "openai"
base_url = "{url}"
model = "scripted-desk"
context_window = 32000
[desks.{DESK}]
system_prompt = "You trade {', '.join(self.symbols)} on a paper account."
symbols = {toml_list(self.symbols)}
maximum_rounds = {MOST_TOOL_ROUNDS + 5}
[desks.{DESK}.exchange.paper]
starting_balances = {{ {balances} }}
slippage_bps = "{self.slippage_bps}"
taker_fee = "0.001"
maker_fee = "0.0008"
[desks.{DESK}.exchange.replay]
files = {{ {files} }}
[desks.{DESK}.risk]
allowed_symbols = {toml_list(self.symbols)}
max_open_orders = 20
[desks.{DESK}.triggers]
schedules = [{schedules}]
ticks = {{ {", ".join(ticks)} }}
"""


# --------------------------------------------------------------------------- the runs


@dataclass
class Runs:
    """One scenario's runs: on the full data, replayed from the cache on the cut data, and
    run against the model on the cut data.

    Attributes:
        settings: The desk's settings.
        full: The record of the run on the full data.
        full_requests: Its requests.
        cut_requests: The requests of the run on the cut data, asking the model.
        strict_miss: What the strict replay on the cut data missed, if anything.
    """

    settings: Settings
    full: BacktestRecord
    full_requests: list[SentRequest]
    cut_requests: list[SentRequest]
    strict_miss: CacheMissError | None


@dataclass
class Findings:
    """How much each check found to check in a scenario."""

    requests: int = 0
    before_cut: int = 0
    times: int = 0
    rows: int = 0
    forming_rows: int = 0
    charts: int = 0
    numbers: int = 0
    market_fills: int = 0
    limit_fills: int = 0


def _write_data(scenario: Scenario, folder: Path, cut: bool) -> dict[str, Path]:
    folder.mkdir()
    return {symbol: write_candles(folder / f"{symbol.replace('/', '_')}-5m.csv", candles)
            for symbol, candles in scenario.data(cut=cut).items()}


Answer = Callable[[RecordedRequest, str], Step]
"""A scripted model's replies: from the request and the prefix of its tool call ids."""


async def _backtest(server: ScriptedServer, settings: Settings, scenario: Scenario,
                    folder: Path, *, cut: bool, mode: CacheMode, cache: Path, answer: Answer,
                    mask: Mask | None = None) -> tuple[BacktestRecord, list[SentRequest]]:
    """One run on its own data files and its own model, its requests recorded with their
    clocks."""
    data = await anyio.to_thread.run_sync(_write_data, scenario, folder, cut)
    server.responder = Model(answer)
    clock = RequestClock(server)
    spec = BacktestSpec(
        settings, DESK, scenario.start, scenario.cut if cut else scenario.end,
        cache_mode=mode, cache_dir=cache, data=data,
        messages=(ScriptedMessage(scenario.cut, OPERATOR_TEXT),), source="the test's config",
        mask=mask)
    record = await run_backtest(spec, on_progress=clock)
    return record, clock.requests


async def _runs(scenario: Scenario, root: Path, answer: Answer) -> Runs:
    with ScriptedServer() as server:
        path = root / "config.toml"
        path.write_text(scenario.config(server.base_url), encoding="utf-8")
        settings = load_settings(path)
        cache = root / "cache"
        full, full_requests = await _backtest(server, settings, scenario, root / "full",
                                              cut=False, mode="record", cache=cache,
                                              answer=answer)
        miss: CacheMissError | None = None
        try:
            _, replayed = await _backtest(server, settings, scenario, root / "replayed",
                                          cut=True, mode="strict", cache=cache,
                                          answer=answer)
            assert replayed == [], "a strict replay reached the model"
        except CacheMissError as exc:
            miss = exc
        _, cut_requests = await _backtest(server, settings, scenario, root / "cut", cut=True,
                                          mode="off", cache=root / "unused", answer=answer)
        assert not server.errors, server.errors
    return Runs(settings, full, full_requests, cut_requests, miss)


def run_scenario(scenario: Scenario, root: Path, answer: Answer = desk_model) -> Runs:
    """Runs the scenario's desk on the full data, replays it on the data cut at the cut from
    the cache the first run recorded, and runs it on the cut data against the model."""
    return anyio.run(_runs, scenario, root, answer)


def examine(scenario: Scenario, root: Path) -> Findings:
    """Runs a scenario and checks everything its desk was sent, and its fills.

    Raises:
        LookAheadError: What a check found.
    """
    runs = run_scenario(scenario, root)
    if runs.strict_miss is not None:
        raise LookAheadError(
            f"on the data cut at {scenario.cut:%Y-%m-%d %H:%M} UTC the desk asked what the "
            f"full run never asked: {runs.strict_miss}") from runs.strict_miss
    data = scenario.data(cut=False)
    items = first_sent(runs.full_requests)
    findings = Findings(requests=len(runs.full_requests))
    findings.times = check_times(items)
    findings.rows, findings.forming_rows = check_candle_tables(items, data)
    findings.charts = check_charts(items, data)
    findings.numbers = check_prices(items, scenario.cut, scenario.future())
    findings.before_cut = check_same_requests(runs.full_requests, runs.cut_requests,
                                              scenario.cut)
    fills = check_fills(runs.full, data, runs.settings.desks[DESK].exchange.paper)
    # A market order fills at the open of the candle opening at its decision; a limit order
    # at the close of a candle after it.
    findings.market_fills = sum(1 for f in runs.full.fills
                                if f.filled_at == f.decided_at and f.turn != STARTING_TURN)
    findings.limit_fills = fills - findings.market_fills
    return findings


# --------------------------------------------------------------------------- the tests


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """A span of two to eight hours within the packaged data, a cut inside it, and a desk."""
    length = draw(st.integers(min_value=24, max_value=96))
    first = draw(st.integers(min_value=WARMUP, max_value=len(_packaged()) - length))
    return Scenario(
        first=first, length=length, cut_after=draw(st.integers(1, length - 1)),
        symbols=draw(st.sampled_from((("BTC/USDT",), ("BTC/USDT", "ETH/USDT")))),
        schedules=tuple(draw(st.lists(st.sampled_from(("30m", "1h")), unique=True,
                                      max_size=2))),
        candle_closes=tuple(draw(st.lists(st.sampled_from(("15m", "1h")), unique=True,
                                          max_size=2))),
        move_percent=draw(st.sampled_from((None, 0.3))),
        slippage_bps=draw(st.sampled_from(("0", "5", "12.5"))))


@pytest.mark.slow
@pytest.mark.timeout(150)
# An example is three backtests (a few seconds), so few of them, and a failure is not
# shrunk: shrinking would rerun dozens within the timeout, and the checks' messages already
# name the request, the tool result, the time and the value. Not derandomized: each run
# tries other spans and desks, and hypothesis's database replays a failure found once.
@settings(max_examples=8, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios())
def test_no_tool_result_or_chart_ever_comes_from_after_its_clock(scenario: Scenario) -> None:
    """Any span, symbols and desk: every check holds, and the run on the cut data asks the
    model exactly what the full run asked up to the cut."""
    with tempfile.TemporaryDirectory(prefix="no-lookahead-") as folder:
        findings = examine(scenario, Path(folder))
    # The operator message at the cut makes it a decision time in both runs.
    assert findings.before_cut > 0, findings


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_busy_day_gives_every_check_something_to_check() -> None:
    """A desk on two symbols waking on 15-minute and hourly closes, on moves and every half
    hour, for twelve hours: every check has hundreds of items to check, market and limit
    fills and forming candles among them."""
    scenario = Scenario(first=1500, length=144, cut_after=96,
                        symbols=("BTC/USDT", "ETH/USDT"), schedules=("30m",),
                        candle_closes=("15m", "1h"), move_percent=0.3, slippage_bps="5")
    with tempfile.TemporaryDirectory(prefix="no-lookahead-") as folder:
        findings = examine(scenario, Path(folder))
    assert findings.requests > 300, findings
    assert findings.before_cut > 200, findings
    assert findings.times > 1000, findings
    assert findings.rows > 500 and findings.forming_rows > 10, findings
    assert findings.charts > 5, findings
    assert findings.numbers > 5000, findings
    assert findings.market_fills > 5 and findings.limit_fills > 3, findings


def test_a_feed_that_peeks_one_candle_ahead_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The look-ahead bug every backtester fears, an off-by-one that shows the candle after
    the clock: the strict replay on the cut data misses, and the candle, price and
    truncation checks catch it. (The times check cannot: the candle shown too early opens
    at the clock, a time the desk may name.)"""
    real = ReplayFeed._visible_count

    def peeking(self: ReplayFeed, symbol: str) -> int:
        return min(real(self, symbol) + 1, len(self._series[symbol]))

    monkeypatch.setattr(ReplayFeed, "_visible_count", peeking)
    scenario = Scenario(first=2000, length=36, cut_after=24, candle_closes=("15m",))
    with tempfile.TemporaryDirectory(prefix="no-lookahead-") as folder:
        runs = run_scenario(scenario, Path(folder))
        again = Path(folder) / "again"
        again.mkdir()
        with pytest.raises(LookAheadError, match=r"asked what the full run never asked: no "
                           r"recorded answer for request \d+ \(strict cache\): message \d+ "
                           r"of \d+ \(.*\) differs from the recording"):
            examine(scenario, again)

    items = first_sent(runs.full_requests)
    data = scenario.data(cut=False)
    cut = f"{scenario.cut:%Y-%m-%d %H:%M} UTC"
    # The clock itself is right (the tools stamp it); read on a clock one step late, as a
    # tool on a clock of its own would be, the stamps give it away.
    assert check_times(items) > 0
    late = [replace(item, request=replace(item.request, clock=item.clock + STEP))
            for item in items]
    with pytest.raises(LookAheadError, match=r"request \d+ \(clock .*\), tool result of "
                       r"get_\w+ \(call .*\) says it holds at .* UTC, not at its clock"):
        check_times(late)
    # A 5m table ends with a candle not closed by the clock; a longer timeframe's forming
    # candle takes in the figures of a candle not closed by it.
    with pytest.raises(LookAheadError, match=r"request \d+ \(clock .*\), tool result of "
                       r"get_candles .*: row \d+ of the BTC/USDT \w+ table"):
        check_candle_tables(items, data)
    with pytest.raises(LookAheadError, match=rf"request \d+ \(clock {cut}\), .* names "
                       r"[\d,.]+, a BTC/USDT price of after"):
        check_prices(items, scenario.cut, scenario.future())
    with pytest.raises(LookAheadError, match=rf"differs between the full run and the run on "
                       rf"data cut at {cut}: message \d+ of \d+ \(tool, tool call "):
        check_same_requests(runs.full_requests, runs.cut_requests, scenario.cut)


def _place_order(arguments: Mapping[str, str]) -> TranscriptEntry:
    return TranscriptEntry("tool_call", f"place_order({json.dumps(arguments)})")


def _trade(decided: datetime, filled: datetime, price: Decimal, fee_rate: str,
           cid: str) -> FillRecord:
    amount = Decimal("0.01")
    return FillRecord(decided, filled, "BTC/USDT", "buy", amount, price,
                      amount * price * Decimal(fee_rate), cid, "")


def test_fills_at_the_decision_or_through_no_later_candle_are_caught() -> None:
    """The fill check on made-up records: right fills pass; a market fill at the close the
    desk decided on (what ai-hedge-fund does), a limit fill on the candle that closed at the
    decision, a limit fill no candle traded through, and a limit the next open beat filled
    at its own price instead of that open, are refused, each with the rule and the fill it
    expected."""
    candles = list(_packaged()[3001:3011])
    decided = candles[3].opened_at  # the close of candles[2]
    paper = PaperExchangeConfig(slippage_bps=Decimal(10))
    below = min(c.low for c in candles[3:]) + Decimal("0.1")
    never = min(c.low for c in candles) - 1
    above = (candles[3].open * Decimal("1.01")).quantize(Decimal("0.01"))
    orders = {"m1": {"type": "market"}, "l1": {"type": "limit", "price": str(below)},
              "l2": {"type": "limit", "price": str(never)},
              "l3": {"type": "limit", "price": str(above)}}
    record = BacktestRecord(
        desk=DESK, model="m", start=candles[0].opened_at, end=candles[-1].closes_at,
        timeframe="5m", quote_currency="USDT", candles={"BTC/USDT": candles},
        starting_equity=Decimal(10000), decisions=[Decision(
            1, decided, "schedule", "bought", orders=tuple(orders), transcript=tuple(
                _place_order({"symbol": "BTC/USDT", "side": "buy", "amount": "0.01", **o})
                for o in orders.values()))])
    data = {"BTC/USDT": candles}
    at_open = candles[3].open * Decimal("1.001")
    through = next(c for c in candles[3:] if c.low < below)
    market = _trade(decided, decided, at_open, "0.001", "m1")
    record.fills = [market, _trade(decided, through.closes_at, below, "0.0008", "l1"),
                     _trade(decided, decided, at_open, "0.001", "l3")]
    assert check_fills(record, data, paper) == 3

    at_close = candles[2].close * Decimal("1.001")
    assert at_close != at_open  # the data: this close is not the next open
    record.fills = [_trade(decided, decided, at_close, "0.001", "m1")]
    with pytest.raises(LookAheadError, match=r"the fill of buy 0.01 BTC/USDT .* a market order "
                       r"decided at .* fills at the open of the candle opening then, "
                       rf"{candles[3].open}, \+10 bps.*expected at .*, price {at_open}"):
        check_fills(record, data, paper)
    record.fills = [market, _trade(decided, decided, below, "0.0008", "l1")]
    with pytest.raises(LookAheadError, match=r"a limit buy at .* rests from the next open and "
                       r"fills at its price when a candle trades through it"):
        check_fills(record, data, paper)
    record.fills = [market, _trade(decided, candles[5].closes_at, never, "0.0008", "l2")]
    with pytest.raises(LookAheadError, match=rf"no candle from the decision at .* trades "
                       rf"through {never}"):
        check_fills(record, data, paper)
    record.fills = [market, _trade(decided, candles[3].closes_at, above, "0.0008", "l3")]
    with pytest.raises(LookAheadError, match=rf"a limit buy at {above} .* reaches the book "
                       r"already beaten by the open of the candle opening then"):
        check_fills(record, data, paper)


def marketable_buyer(request: RecordedRequest, call: str) -> Step:
    """Reads the ticker, then buys 0.002 BTC with a limit 1% above the last price."""
    if not request.tools:
        return Reply("Summary: the desk bought above the market.")
    last = _last_price(_this_turn(request.messages), "BTC/USDT")
    if _rounds(request.messages) == 0:
        return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"}, id=call)])
    if _rounds(request.messages) == 1 and last is not None:
        price = (last * Decimal("1.01")).quantize(Decimal("0.01"))
        return Reply(tool_calls=[ToolCall("place_order", {
            "symbol": "BTC/USDT", "side": "buy", "type": "limit", "amount": "0.002",
            "price": str(price)}, id=call)])
    return Reply("Bought with a limit above the market.")


def test_a_marketable_limit_order_fills_at_the_next_open() -> None:
    """A limit buy above the market, decided at a close, never fills at that close: it
    reaches the book at the next open, which beats its price, and fills there as a taker."""
    scenario = Scenario(first=3000, length=24, cut_after=23, schedules=("30m",))
    with tempfile.TemporaryDirectory(prefix="no-lookahead-") as folder:
        runs = run_scenario(scenario, Path(folder), marketable_buyer)
    # The account's starting coins are the books' first fill, at the start; then the orders.
    start, *fills = runs.full.fills
    assert (start.turn, start.client_order_id, start.filled_at) == (
        STARTING_TURN, "start-BTC/USDT", runs.full.start), start
    assert len(fills) >= 3, fills
    # The books' first round trip opens with them, at the start.
    assert (runs.full.trades[0].opened_turn, runs.full.trades[0].opened_at) == (
        STARTING_TURN, runs.full.start)
    assert check_fills(runs.full, scenario.data(cut=False),
                       runs.settings.desks[DESK].exchange.paper) == len(fills)
    taker = runs.settings.desks[DESK].exchange.paper.taker_fee
    assert all(f.filled_at == f.decided_at and f.fee == f.amount * f.price * taker
               for f in fills), fills


# --------------------------------------------------------------------------- the mask


MASK_FACTOR = Decimal("6.4")
"""The masked runs' price factor: BTC's 16,000-18,000 read as 100,000-120,000, the made-up
ETH's 1,100-1,300 as 7,000-8,500, apart from every real price."""
_REAL_NAMES = re.compile(r"(?<![A-Za-z])(BTC|ETH|USDT)(?![A-Za-z])")
_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})")
_FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?")


def _read_text(body: bytes) -> str:
    """Every string a request holds (messages, tool definitions), its images left out."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if value.get("type") == "image_url":
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str):
            found.append(value)

    walk(json.loads(body))
    return "\n".join(found)


@dataclass
class MaskFindings:
    """How much the masked run's checks found to check."""

    requests: int = 0
    dates: int = 0
    numbers: int = 0
    fills: int = 0


def _bucket_volumes(series: Sequence[Candle]) -> set[Decimal]:
    """Every volume a candle of 5 minutes to a day could show, a forming one's included: the
    running sums of the 5-minute volumes within each bucket."""
    volumes: set[Decimal] = set()
    for minutes in (5, 15, 30, 60, 240, 1440):
        bucket, total = None, Decimal(0)
        for candle in series:
            opened = int(candle.opened_at.timestamp()) // (minutes * 60)
            total = (total if opened == bucket else Decimal(0)) + candle.volume
            bucket = opened
            volumes.add(total)
    return volumes


def _as_shown(figure: Decimal) -> set[Decimal]:
    """A figure as a tool may write it: whole, or rounded to up to four decimals."""
    return {figure.normalize()} | {figure.quantize(Decimal(1).scaleb(-places)).normalize()
                                   for places in range(5)}


def examine_masked(scenario: Scenario, root: Path) -> MaskFindings:
    """Runs the scenario's desk through the mask and checks every request it sent: no real
    symbol or currency name, no date of the real data, no real candle price; and the fills
    are real.

    Raises:
        LookAheadError: What leaked.
    """
    # The scripted model's choices hash the whole request, tool definitions included: seed
    # 11 is a world in which its four hours hold six fills to check (seed 7 held more
    # than two until masked desks got set_protection, then two).
    mask = choose_mask(scenario.symbols, scenario.start, seed=11, factor=MASK_FACTOR)

    async def run() -> tuple[Settings, BacktestRecord, list[SentRequest]]:
        with ScriptedServer() as server:
            path = root / "config.toml"
            path.write_text(scenario.config(server.base_url), encoding="utf-8")
            settings = load_settings(path)
            record, requests = await _backtest(
                server, settings, scenario, root / "masked", cut=False, mode="off",
                cache=root / "cache", answer=desk_model, mask=mask)
            assert not server.errors, server.errors
        return settings, record, requests

    settings, record, requests = anyio.run(run)
    data = scenario.data(cut=False)
    real_days = {c.opened_at.date() for series in data.values() for c in series}
    real_prices = {value.normalize() for series in data.values() for c in series
                   for value in (c.open, c.high, c.low, c.close)}
    # What the mask made of the data: a masked figure that happens to equal a real price (a
    # masked hourly volume equal to another symbol's real low was seen) names no real price.
    masked_figures = {mask.price(value).normalize() for series in data.values()
                      for c in series for value in (c.open, c.high, c.low, c.close)}
    masked_figures |= {shown for series in data.values() for volume in _bucket_volumes(series)
                       for shown in _as_shown(mask.amount(volume))}
    findings = MaskFindings(requests=len(requests))
    named: dict[Decimal, str] = {}
    for request in requests:
        text = _read_text(request.body)
        name = _REAL_NAMES.search(text)
        if name:
            raise LookAheadError(f"{request.where()} names the real {name.group(0)}: "
                                 f"{text[max(0, name.start() - 80):name.end() + 80]!r}")
        for match in _DATE.finditer(text):
            findings.dates += 1
            day = datetime(*(int(part) for part in match.groups())).date()
            if day in real_days or day.year < 2030:
                raise LookAheadError(f"{request.where()} names the real date "
                                     f"{match.group(0)}")
        for match in _FIGURE.finditer(text):
            findings.numbers += 1
            figure = Decimal(match.group(0).replace(",", "")).normalize()
            if figure in real_prices and figure not in masked_figures:
                around = text[max(0, match.start() - 80):match.end() + 80]
                named.setdefault(figure, f"{request.where()} names {match.group(0)}, a real "
                                         f"price: {around!r}")
    # One real price alone is taken for chance, two are a leak: the masked world's money (a
    # holding's worth in USD, which the mask leaves as it is) lies in the range of the real
    # ETH/USDT prices, and of some 300,000 figures one equalled a price by chance (1,165.92
    # USD). A view that lets real prices through names a new one at every look.
    if len(named) >= 2:
        raise LookAheadError("\n".join(list(named.values())[:3]))
    # The books and the report stay real: real symbols, fills at real prices, as the plain
    # checks of fills prove them.
    def unmask(arguments: dict[str, Any]) -> dict[str, Any]:
        real = {**arguments, "symbol": mask.real_symbol(arguments["symbol"]),
                "amount": str(mask.real_amount(Decimal(arguments["amount"])))}
        if "price" in arguments:
            real["price"] = str(mask.real_price(Decimal(arguments["price"])))
        return real

    findings.fills = check_fills(record, data, settings.desks[DESK].exchange.paper,
                                 unmask=unmask)
    assert {fill.symbol for fill in record.fills} <= set(scenario.symbols)
    assert record.masked
    return findings


def test_a_masked_run_sends_no_real_name_date_or_price_and_fills_really() -> None:
    """Four hours on BTC/USDT, a desk waking every half hour and on moves: the model is sent
    hundreds of dates and numbers, none real; its orders fill at real prices."""
    scenario = Scenario(first=900, length=48, cut_after=48, schedules=("30m",),
                        move_percent=0.3)
    with tempfile.TemporaryDirectory(prefix="masked-") as folder:
        findings = examine_masked(scenario, Path(folder))
    assert findings.requests > 20 and findings.dates > 50 and findings.numbers > 1000, findings
    assert findings.fills > 2, findings


def test_a_view_that_lets_one_real_price_through_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is not blind: a masked exchange whose ticker is real is caught."""
    async def real_ticker(self: MaskedExchange, symbol: str) -> Ticker:
        ticker = await self.inner.fetch_ticker(self.mask.real_symbol(symbol))
        return replace(self.mask.ticker(ticker), last=ticker.last)

    monkeypatch.setattr(MaskedExchange, "fetch_ticker", real_ticker)
    scenario = Scenario(first=900, length=24, cut_after=24, schedules=("30m",))
    with (tempfile.TemporaryDirectory(prefix="masked-") as folder,
          pytest.raises(LookAheadError, match="a real price")):
        examine_masked(scenario, Path(folder))


@pytest.mark.slow
@pytest.mark.timeout(150)
@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=scenarios())
# A masked hourly volume, rounded as the candle table writes it, once equalled an ETH/USDT
# low of the real data: a figure the mask made is no real price.
@example(scenario=Scenario(first=1115, length=96, cut_after=27,
                           symbols=("BTC/USDT", "ETH/USDT"), schedules=("1h",),
                           candle_closes=("1h", "15m"), move_percent=0.3))
# And a holding's worth in USD equalled an ETH/USDT price.
@example(scenario=Scenario(first=415, length=70, cut_after=36,
                           symbols=("BTC/USDT", "ETH/USDT"), schedules=("1h", "30m"),
                           slippage_bps="12.5"))
def test_no_masked_request_ever_names_a_real_symbol_time_or_price(scenario: Scenario) -> None:
    """Any span, symbols and desk, masked: nothing real reaches the model."""
    scenario = replace(scenario, cut_after=scenario.length)  # the real prices throughout
    with tempfile.TemporaryDirectory(prefix="masked-") as folder:
        findings = examine_masked(scenario, Path(folder))
    assert findings.requests > 0, findings
