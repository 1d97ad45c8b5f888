"""How fast a backtest runs beyond the model: the engine's overhead per decision.

A desk that wakes on every 5-minute candle close (``ticks = { on_candle_close = ["5m"] }``)
is backtested by :func:`~trading_agent.backtest.engine.run_backtest` over the packaged
BTC/USDT candles, with an in-process scripted model that trades and answers from the request
alone (no I/O, no sleeping): on a candle it asks for the ticker; given the ticker it buys
0.01 BTC at market on the hour's close, sells it back on the half hour's, and otherwise holds;
then it says so in one sentence. It also writes the compressor's summaries and answers the
silent memory flush (one note, then ``NO_REPLY``), so compaction runs when the window fills.
Its usage is an estimate (characters / 4, as the compressor counts).

Measured, in this one process:

- **record**: a fresh response cache, every request asks the model. The model's own time
  (CPU and wall spent inside its ``complete``) is measured and taken out;
- **bare replay stepping**, the reference: the same candles through a ``ReplayFeed``, step by
  step, with the paper exchange synced, the risk day recorded and the account valued at each
  step (what the engine does per step without a desk);
- **cached re-run**: ``--cache strict`` on the record's cache (zero model calls); its
  figures must equal the record's;
- **off** (``--off``): no cache at all, the model asked every time.

Overhead per decision = (run CPU - model CPU - bare stepping CPU) / decisions: the loop,
the tools, the exchange, the risk checks, the store and the response cache. CPU is the
process's (every thread: SQLite work runs in worker threads); wall time is printed beside
it. Because the machine is shared, the overhead is also given as the median over chunks of
the run (each chunk's own bare stepping taken out). Memory is the process's RSS at the start
and after 10%, 50% and 100% of each run's steps; the record itself (equity point and
transcript per decision) is expected to grow, the rest should not.

Bars (issue 11): overhead at most 2 ms per decision (a year of 5-minute candles, 105,120
decisions, in under 4 minutes of CPU beyond the model); a cached re-run of the whole set in
under 60 s on two cores; memory flat. Timings are printed, never asserted (the re-runs'
decisions, trades, equity and tokens are checked to equal the record's).

**A sweep in parallel** (``--sweep``, issue 29): 20 windows (evenly spaced, ``--window-days``
each, half a day by default) with their baselines (buy and hold, the crossover,
``--random-traders`` random traders each, 5 by default) are recorded once, then re-run from
the cache (``strict``: no model call) with one worker and with two worker processes
(``--jobs 2``); both must give the same results. Bar: two jobs at least 1.7 times as fast
as one on two cores. Printed, not asserted: the machine may be shared.

Run: ``.venv/bin/python bench/backtest_speed.py [--quick | --full | --days N] [--off]
[--context-window TOKENS]`` or ``.venv/bin/python bench/backtest_speed.py --sweep
[--window-days D] [--random-traders N]``

- default: 5 days (1,440 decisions), about a minute on two cores; what ``make bench`` runs;
- ``--quick``: 1 day (288 decisions), a smoke run of about 15 seconds;
- ``--full``: the whole packaged data set (10,711 decisions, 2023-01-03 16:45 to
  2023-02-09 21:20 UTC after a day of warm-up), about 10 minutes (5 per run);
- ``--days N``: N days from the default start;
- ``--off``: also the run without a cache;
- ``--context-window``: the model's window (200,000 tokens by default: the window holds up
  to about 4,500 messages before it is compacted, a dozen times over the whole set; the
  output says how often and how many messages each request carried).

The engine keeps a run's throwaway store in ``/dev/shm`` where there is one (the output says
where), so its durable commits do not wait for the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import operator
import os
import platform
import re
import resource
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import structlog

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.context_budget import SUMMARY_SECTIONS
from trading_agent.agent.context_compressor import FLUSH_NO_OP, FLUSH_TRIGGER_PREFIX
from trading_agent.agent.conversation import (
    ContentBlock,
    Message,
    TextBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.backtest.cache import CacheMode
from trading_agent.backtest.engine import (
    BacktestSpec,
    Progress,
    desk_settings,
    load_history,
    run_backtest,
    scratch_folder,
)
from trading_agent.backtest.parallel import run_jobs
from trading_agent.backtest.record import BacktestRecord
from trading_agent.backtest.sweep import WindowJob
from trading_agent.backtest.windows import choose_windows
from trading_agent.settings import DeskSettings, Settings, load_settings
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.config import PACKAGED_CANDLES
from trading_agent.trading.factory import open_exchange
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed, load_candles_csv
from trading_agent.trading.valuation import value_account

DESK = "every_close"
YEAR_OF_5M = 365 * 288
BAR_OVERHEAD = 0.002
BAR_CACHED_SECONDS = 60.0
CHUNKS = 20
ORDER_AMOUNT = "0.01"

CONFIG = """
[daemon]
state_dir = "{state}"

[model]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "bench-trader"
context_window = {window}

[desks.{desk}]
system_prompt = \"\"\"You trade BTC/USDT on 5-minute candles. On each candle, read the ticker,
then decide: buy, sell or hold. Keep positions small.\"\"\"
symbols = ["BTC/USDT"]
maximum_rounds = 6

[desks.{desk}.triggers]
ticks = {{ on_candle_close = ["5m"] }}
"""

_CLOSED_AT = re.compile(r"closed at (\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d)")
_LAST = re.compile(r"last ([\d,.]+)")


# --------------------------------------------------------------------------- the model


@dataclass
class ScriptedTrader:
    """An in-process ModelBackend that trades from the request alone, and times itself.

    Its answer is a function of the request only (the tool call ids too), so a run without
    a cache asks it the same things and gets the same answers as a recorded one.
    """

    model: str
    context_window: int
    cpu: float = 0.0
    """CPU seconds of the event loop's thread spent inside :meth:`complete`."""
    wall: float = 0.0
    calls: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    sent_messages: int = 0
    """Messages sent, summed over the requests (the window the loop works over)."""
    largest: int = 0
    _last: tuple[Sequence[Message], list[int]] | None = None
    _tools: tuple[Sequence[dict[str, Any]], int] | None = None

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        cpu, wall = time.thread_time(), time.perf_counter()
        kind, content = self._answer(request)
        text = "".join(b.text for b in content if isinstance(b, TextBlock))
        if on_text is not None and text:
            on_text(text)
        calls = [b for b in content if isinstance(b, ToolUseBlock)]
        written = len(text) + sum(len(call.arguments) for call in calls)
        reply = ModelReply(content, Usage(self._prompt_tokens(request), written // 4 + 1,
                                          estimated=True),
                           "tool_calls" if calls else "stop")
        self.calls += 1
        self.sent_messages += len(request.messages)
        self.largest = max(self.largest, len(request.messages))
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.cpu += time.thread_time() - cpu
        self.wall += time.perf_counter() - wall
        return reply

    def _prompt_tokens(self, request: ModelRequestSpec) -> int:
        """``request_tokens(request)``, but counting only the messages added since the last
        request when the window merely grew (the same objects, more at the end): the model's
        own time is taken out of the figures, yet it should not dominate the run. Checked by
        identity, in C, so a window whose older messages were replaced (a compaction, cleared
        tool results) is counted afresh."""
        tools = self._tools
        if tools is None or tools[0] is not request.tools:
            chars = len(json.dumps(list(request.tools), separators=(",", ":")))
            tools = (request.tools, chars if request.tools else 0)
            self._tools = tools
        messages = request.messages
        sums: list[int] = []
        if self._last is not None:
            previous, counted = self._last
            size = len(counted)
            if (size and len(messages) >= size
                    and all(map(operator.is_, messages[:size], previous[:size]))):
                sums = counted
        total = sums[-1] if sums else 0
        for message in messages[len(sums):]:
            total += estimate_tokens(message)
            sums.append(total)
        self._last = (messages, sums)
        # As overhead_tokens() counts the fixed part: 4 + characters / 4.
        return 4 + (len(request.system_prompt) + tools[1]) // 4 + total

    def _answer(self, request: ModelRequestSpec) -> tuple[str, tuple[ContentBlock, ...]]:
        messages = request.messages
        if not request.tools:
            return "summary", (TextBlock("\n".join(
                f"## {name}\n- {_SUMMARY_LINES.get(name, 'nothing to add')}"
                for name in SUMMARY_SECTIONS)),)
        opening = _opening(messages)
        last = messages[-1]
        if opening.id.startswith(FLUSH_TRIGGER_PREFIX):
            if last.kind == "tool_results":
                return "flush", (TextBlock(FLUSH_NO_OP),)
            return "flush", (_call(opening, "remember", {
                "key": "plan", "text": "Buy 0.01 BTC on the hour's close, sell it on the half "
                                       "hour's; hold otherwise."}),)
        stamp = _CLOSED_AT.search(opening.text)
        if last.kind != "tool_results":
            return "desk", (_call(opening, "get_ticker", {"symbol": "BTC/USDT"}),)
        called = _called(messages)
        result = last.tool_results[0].text if last.tool_results else ""
        if called == "get_ticker":
            minute = int(stamp.group(5)) if stamp else -1
            if minute in (0, 30):
                side = "buy" if minute == 0 else "sell"
                return "desk", (TextBlock(f"The {'hour' if minute == 0 else 'half hour'} "
                                          f"closed: I {side} {ORDER_AMOUNT} BTC at market."),
                                _call(opening, "place_order", {
                                    "symbol": "BTC/USDT", "side": side, "type": "market",
                                    "amount": ORDER_AMOUNT}))
            price = _LAST.search(result)
            return "desk", (TextBlock(
                f"Holding: BTC/USDT at {price.group(1) if price else 'an unknown price'}, "
                "no signal on this candle."),)
        return "desk", (TextBlock(f"Order placed as planned; the exchange said: "
                                  f"{result[:120]}"),)


_SUMMARY_LINES = {
    "Goal": "trade BTC/USDT on 5-minute closes, small size",
    "Positions and open orders": "flat or 0.01 BTC long between the hour and the half hour",
    "Decisions and why": "buy on the hour's close, sell on the half hour's",
    "Risks": "fees on every round trip",
    "Next steps": "keep the rhythm",
}


def _opening(messages: Sequence[Message]) -> Message:
    """The message that opened the turn: the last user message that is not tool results."""
    for message in reversed(messages):
        if message.role == "user" and message.kind != "tool_results":
            return message
    raise AssertionError("a request without a user message")


def _called(messages: Sequence[Message]) -> str:
    """The name of the tool whose result is the last message."""
    for message in reversed(messages):
        if message.role == "assistant" and message.tool_uses:
            return message.tool_uses[-1].name
    return ""


def _call(opening: Message, name: str, arguments: dict[str, str]) -> ToolUseBlock:
    """A tool call whose id depends only on the turn's opening message and the tool."""
    digest = hashlib.blake2s(f"{opening.text}|{name}".encode(), digest_size=6).hexdigest()
    return ToolUseBlock(f"call_{digest}", name, json.dumps(arguments))


# --------------------------------------------------------------------------- measuring


def rss_bytes() -> int:
    """The process's resident set size (VmRSS)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Mark:
    """Counters at one step of a run."""

    step: int
    wall: float
    cpu: float
    model_cpu: float
    model_wall: float
    decisions: int


@dataclass
class Run:
    """One backtest run as measured."""

    mode: str
    record: BacktestRecord
    wall: float
    cpu: float
    model: ScriptedTrader
    marks: list[Mark]
    rss: dict[str, int]
    cache_bytes: int

    @property
    def decisions(self) -> int:
        return len(self.record.decisions)


@dataclass
class Bare:
    """The reference: bare replay stepping."""

    steps: int
    wall: float
    cpu: float
    marks: list[Mark]


def _chunk_ends(steps: int) -> list[int]:
    """The last step of each of CHUNKS even chunks of a run."""
    return sorted({max(1, round(steps * i / CHUNKS)) for i in range(1, CHUNKS + 1)})


def _chunk_steps(steps: int) -> set[int]:
    """The steps at which counters are taken: each chunk's end, and 10%, 50%, 100%."""
    return set(_chunk_ends(steps)) | {max(1, round(steps * share)) for share in (0.1, 0.5, 1.0)}


async def bench_backend(config: DeskSettings, stack: AsyncExitStack) -> ModelBackend:
    """The scripted trader, by import path (``backtest_speed:bench_backend``): what a sweep's
    worker processes build their desks' model with."""
    return ScriptedTrader("bench-trader", config.model.context_window)


BAR_SWEEP_SPEEDUP = 1.7
SWEEP_WINDOWS = 20


def sweep(args: argparse.Namespace) -> None:
    """Records 20 windows once, then times their cached sweep with one and two jobs."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    candles = load_candles_csv(PACKAGED_CANDLES, "BTC/USDT")
    first = candles[0].opened_at + timedelta(minutes=5 * 288)
    windows = choose_windows(first, candles[-1].closes_at, timedelta(days=args.window_days),
                             count=SWEEP_WINDOWS, spacing="even")
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"backtest_speed --sweep: {len(windows)} windows of {args.window_days:g} days, "
          f"each with buy and hold, the crossover and {args.random_traders} random traders")
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {_processor()}; "
          f"load average {load}")
    with tempfile.TemporaryDirectory(prefix="backtest-sweep-") as name:
        folder = Path(name)
        config_path = folder / "config.toml"
        config_path.write_text(CONFIG.format(state=folder / "state", window=args.context_window,
                                             desk=DESK))
        spec = BacktestSpec(load_settings(config_path), DESK, first, candles[-1].closes_at,
                            cache_dir=folder / "cache", source=str(config_path))

        async def record() -> None:
            for window in windows:
                await run_backtest(replace(spec, start=window.start, end=window.end),
                                   backend_factory=bench_backend)

        started = time.perf_counter()
        anyio.run(record)
        print(f"  recorded the windows' answers in {time.perf_counter() - started:.1f} s")
        jobs = [WindowJob(replace(spec, cache_mode="strict"), window, args.random_traders,
                          backend=f"{Path(__file__).stem}:bench_backend")
                for window in windows]
        timings: dict[int, float] = {}
        results = {}
        for workers in (1, 2):
            cpu = _cpu_seconds()
            started = time.perf_counter()
            results[workers] = run_jobs(jobs, workers=workers)
            timings[workers] = time.perf_counter() - started
            load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
            print(f"  --jobs {workers}: {timings[workers]:.1f} s wall, "
                  f"{_cpu_seconds() - cpu:.1f} s CPU (this process and its workers); load "
                  f"average now {load}", flush=True)
    same = [replace(r, model_seconds=0.0) for r in results[1]] == [
        replace(r, model_seconds=0.0) for r in results[2]]
    assert same, "two jobs gave other results than one"
    speedup = timings[1] / timings[2]
    decisions = sum(r.decisions for r in results[1])
    print(f"  the same {len(windows)} window results with one job and two "
          f"({decisions:,} decisions, {sum(len(r.random_returns) for r in results[1])} random "
          "traders)")
    print(f"speedup with two jobs: {speedup:.2f}x (bar >= {BAR_SWEEP_SPEEDUP}x): "
          f"{_verdict(speedup >= BAR_SWEEP_SPEEDUP)}")


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


async def run_once(spec: BacktestSpec, mode: CacheMode, window: int) -> Run:
    """One backtest in ``mode``, with counters at each chunk's end and RSS at 10/50/100%."""
    model = ScriptedTrader("bench-trader", window)

    async def factory(config: DeskSettings, stack: AsyncExitStack) -> ModelBackend:
        return model

    marks: list[Mark] = []
    rss: dict[str, int] = {"start": rss_bytes()}
    wanted: set[int] = set()
    shares: dict[int, str] = {}
    cpu0 = time.process_time()
    wall0 = time.perf_counter()

    def on_progress(progress: Progress) -> None:
        if not wanted:
            wanted.update(_chunk_steps(progress.steps))
            shares.update({max(1, round(progress.steps * s)): f"{s:.0%}"
                           for s in (0.1, 0.5, 1.0)})
        if progress.step in wanted:
            marks.append(Mark(progress.step, time.perf_counter() - wall0,
                              time.process_time() - cpu0, model.cpu, model.wall,
                              progress.decisions))
            if progress.step in shares:
                rss[shares[progress.step]] = rss_bytes()

    record = await run_backtest(
        BacktestSpec(spec.settings, spec.desk, spec.start, spec.end, cache_mode=mode,
                     cache_dir=spec.cache_dir, source=spec.source),
        backend_factory=factory, on_progress=on_progress)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    rss["after"] = rss_bytes()
    cache = spec.cache_dir / f"{DESK}.jsonl" if spec.cache_dir is not None else None
    size = cache.stat().st_size if cache is not None and cache.exists() else 0
    return Run(mode, record, wall, cpu, model, marks, rss, size)


async def bare_stepping(spec: BacktestSpec, folder: Path, steps_at: set[int]) -> Bare:
    """The engine's per-step work without the desk: advance the replay, match resting
    orders, record the risk day, value the account."""
    config = desk_settings(spec)
    series, timeframe = load_history(spec, config)
    feed = ReplayFeed(series, timeframe=timeframe, speed=0, start=spec.start)
    paper = config.exchange.paper.model_copy(update={"market_fill": "next_open"})
    exchange_config = config.exchange.model_copy(update={"paper": paper, "feed": "replay"})
    quote = config.risk.quote_currency
    marks: list[Mark] = []
    async with open_exchange(exchange_config, state=TradingStateFile(folder / "bare.sqlite3"),
                             account=DESK, symbols=config.symbols, risk_limits=config.risk,
                             feed=feed) as venue:
        exchange = venue.exchange
        assert isinstance(exchange.inner, PaperExchange) and venue.risk is not None
        await value_account(exchange, quote)
        steps = feed.steps - 1 - feed.cursor
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for step in range(1, steps + 1):
            feed.advance()
            await venue.match_resting_orders()  # the paper matcher, then the desk's books
            await venue.risk.observe()
            await value_account(exchange, quote)
            if step in steps_at:
                marks.append(Mark(step, time.perf_counter() - wall0,
                                  time.process_time() - cpu0, 0.0, 0.0, 0))
        return Bare(steps, time.perf_counter() - wall0, time.process_time() - cpu0, marks)


def chunk_overheads(run: Run, bare: Bare) -> list[float]:
    """Per chunk: (run CPU - model CPU - bare CPU over the same steps) / decisions."""
    bare_at = {mark.step: mark.cpu for mark in bare.marks}
    figures = []
    previous = Mark(0, 0.0, 0.0, 0.0, 0.0, 0)
    previous_bare = 0.0
    ends = {mark.step: mark for mark in run.marks}
    for step in _chunk_ends(bare.steps):
        mark = ends.get(step)
        if mark is None or step not in bare_at:
            continue
        decisions = mark.decisions - previous.decisions
        if decisions > 0:
            spent = ((mark.cpu - previous.cpu) - (mark.model_cpu - previous.model_cpu)
                     - (bare_at[step] - previous_bare))
            figures.append(spent / decisions)
        previous, previous_bare = mark, bare_at[step]
    return figures


def same_figures(first: BacktestRecord, second: BacktestRecord) -> list[str]:
    """What differs between two runs' records (empty when they agree)."""
    differences = []
    if len(first.decisions) != len(second.decisions):
        differences.append(f"decisions {len(first.decisions)} != {len(second.decisions)}")
    if [d.final_text for d in first.decisions] != [d.final_text for d in second.decisions]:
        differences.append("the decisions' texts")

    def fills(record: BacktestRecord) -> list[tuple[Any, ...]]:
        return [(t.decided_at, t.filled_at, t.side, t.amount, t.price, t.fee,
                 t.client_order_id) for t in record.fills]

    if fills(first) != fills(second):
        differences.append(f"fills ({len(first.fills)} vs {len(second.fills)})")
    if [(p.at, p.equity) for p in first.equity] != [(p.at, p.equity) for p in second.equity]:
        differences.append("the equity curve")
    one, two = first.usage, second.usage
    if (one.input_tokens, one.output_tokens) != (two.input_tokens, two.output_tokens):
        differences.append(f"tokens {one.input_tokens}/{one.output_tokens} != "
                           f"{two.input_tokens}/{two.output_tokens}")
    return differences


# --------------------------------------------------------------------------- output


def _processor() -> str:
    """The CPU's model name (``platform.processor()`` is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mib(value: int) -> str:
    return f"{value / 2**20:.0f} MiB"


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(runs: list[Run], bare: Bare, window: int) -> None:
    record = runs[0]
    decisions = record.decisions
    bare_ms = bare.cpu / bare.steps * 1000
    print(f"\nbare replay stepping: {bare.steps:,} steps in {bare.cpu:.2f} s CPU "
          f"({bare.wall:.2f} s wall), {bare_ms:.3f} ms per step")
    print(f"\n{'run':<14}{'decisions':>10}{'model calls':>12}{'wall s':>9}{'CPU s':>9}"
          f"{'model CPU s':>12}{'decisions/s':>12}{'overhead ms/decision':>22}"
          f"{'chunk median':>14}")
    overheads: dict[str, tuple[float, float]] = {}
    for run in runs:
        beyond = run.cpu - run.model.cpu - bare.cpu
        per = beyond / run.decisions * 1000 if run.decisions else float("nan")
        chunks = chunk_overheads(run, bare)
        median = statistics.median(chunks) * 1000 if chunks else float("nan")
        overheads[run.mode] = (per, median)
        calls = run.record.usage.model_calls
        print(f"{run.mode:<14}{run.decisions:>10,}{calls:>12,}{run.wall:>9.1f}{run.cpu:>9.1f}"
              f"{run.model.cpu:>12.2f}{run.decisions / run.wall:>12.1f}{per:>22.3f}"
              f"{median:>14.3f}")
    print(f"  (overhead = (run CPU - model CPU - bare stepping CPU) / decisions; the chunk "
          f"median takes {CHUNKS} chunks of the run, each with its own bare stepping)")
    chunks = chunk_overheads(record, bare)
    if chunks:
        print("  record run, overhead per chunk in ms/decision, oldest first: "
              + " ".join(f"{value * 1000:.1f}" for value in chunks))

    kinds = record.model.kinds
    print(f"\nmodel requests in the record run: {record.model.calls:,} "
          f"({', '.join(f'{k} {v:,}' for k, v in sorted(kinds.items()))}); "
          f"model wall {record.model.wall:.2f} s; messages per request: mean "
          f"{record.model.sent_messages / max(1, record.model.calls):,.0f}, largest "
          f"{record.model.largest:,}")
    summaries = kinds.get("summary", 0)
    flushes = kinds.get("flush", 0)
    if summaries:
        print(f"compaction: yes, occasionally: {summaries} summary request(s) and {flushes} "
              f"memory-flush request(s) over {decisions:,} decisions (window {window:,} "
              "tokens)")
    else:
        print(f"compaction: none over {decisions:,} decisions (window {window:,} tokens)")
    print(f"round trips: {len(record.record.trades):,}, fills: {len(record.record.fills):,}; "
          "response cache file: "
          f"{record.cache_bytes / 2**20:.1f} MiB; record: {len(record.record.equity):,} "
          f"equity points, {sum(len(d.transcript) for d in record.record.decisions):,} "
          "transcript entries")

    print("\nmemory (RSS)")
    print(f"{'run':<14}{'start':>10}{'10%':>10}{'50%':>10}{'100%':>10}{'after':>10}"
          f"{'50%->100%':>11}")
    for run in runs:
        r = run.rss
        print(f"{run.mode:<14}" + "".join(f"{_mib(r.get(k, 0)):>10}" for k in
                                          ("start", "10%", "50%", "100%", "after"))
              + f"{(r.get('100%', 0) - r.get('50%', 0)) / 2**20:>+9.0f} MiB")

    per, median = overheads["record"]
    best = min(per, median)
    print("\nbars")
    print(f"  overhead per decision (record run): {per:.3f} ms, chunk median {median:.3f} ms "
          f"(bar 2 ms) -> {_verdict(best <= BAR_OVERHEAD * 1000)}")
    year = best / 1000 * YEAR_OF_5M
    print(f"  a year of 5-minute candles ({YEAR_OF_5M:,} decisions): {year:.0f} s of CPU "
          f"beyond the model at {best:.3f} ms/decision, plus {bare_ms / 1000 * YEAR_OF_5M:.0f}"
          f" s of bare stepping (bar 240 s) -> {_verdict(year <= 240)}")
    cached = next((run for run in runs if run.mode == "strict"), None)
    if cached is not None:
        whole = 10_711
        scaled = cached.wall / cached.decisions * whole if cached.decisions else float("nan")
        label = ("the whole set" if cached.decisions >= whole
                 else f"scaled to the whole set ({whole:,} decisions) from {cached.decisions:,}")
        print(f"  cached re-run: {cached.wall:.1f} s wall, {cached.cpu:.1f} s CPU, "
              f"{cached.record.usage.model_calls} model calls; {label}: {scaled:.1f} s "
              f"(bar 60 s) -> {_verdict(scaled <= BAR_CACHED_SECONDS)}")
    growth = max((run.rss.get("100%", 0) - run.rss.get("50%", 0)) / 2**20 for run in runs)
    print(f"  memory: largest growth from 50% to 100% of a run: {growth:+.0f} MiB")


# --------------------------------------------------------------------------- main


def _span(args: argparse.Namespace, first: datetime, last: datetime) -> tuple[datetime,
                                                                                datetime]:
    start = first + timedelta(minutes=5 * 288)
    if args.full:
        return start, last
    days = 1 if args.quick else args.days
    return start, min(last, start + timedelta(days=days))


async def main(args: argparse.Namespace) -> None:
    # The figures only: a backtest's info lines (a fill per order) would drown them.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    rss_start = rss_bytes()
    candles = load_candles_csv(PACKAGED_CANDLES, "BTC/USDT")
    start, end = _span(args, candles[0].opened_at, candles[-1].closes_at)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print("backtest_speed: a desk waking on every 5m close, an in-process scripted trader")
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {_processor()}; "
          f"load average {load}")
    print(f"python {platform.python_version()} ({platform.python_implementation()}), "
          f"sqlite {sqlite3.sqlite_version}, anyio on asyncio")
    print(f"data: {len(candles):,} packaged BTC/USDT 5m candles; span {start:%Y-%m-%d %H:%M}"
          f" to {end:%Y-%m-%d %H:%M} UTC; context window {args.context_window:,} tokens; "
          f"RSS at start {_mib(rss_start)}")
    print(f"the engine's scratch SQLite files in {scratch_folder() or tempfile.gettempdir()}")
    with tempfile.TemporaryDirectory(prefix="backtest-speed-") as name:
        folder = Path(name)
        config_path = folder / "config.toml"
        config_path.write_text(CONFIG.format(state=folder / "state", window=args.context_window,
                                             desk=DESK))
        settings: Settings = load_settings(config_path)
        spec = BacktestSpec(settings, DESK, start, end, cache_dir=folder / "cache",
                            source=str(config_path))
        modes: list[CacheMode] = ["record", "strict"]
        if args.off:
            modes.append("off")
        runs: list[Run] = []
        for mode in modes:
            run = await run_once(spec, mode, args.context_window)
            runs.append(run)
            print(f"  {mode}: {run.decisions:,} decisions in {run.wall:.1f} s", flush=True)
        steps = len(runs[0].record.equity)
        bare = await bare_stepping(spec, folder, _chunk_steps(steps))
    for run in runs[1:]:
        differences = same_figures(runs[0].record, run.record)
        assert not differences, f"the {run.mode} run differs from the record: {differences}"
        print(f"  {run.mode} run: the same decisions, trades, equity and tokens as the record")
    assert runs[1].record.usage.model_calls == 0 and runs[1].model.calls == 0
    report(runs, bare, args.context_window)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"\nRSS at the end: {_mib(rss_bytes())} (at start {_mib(rss_start)}); load average "
          f"now {load}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="1 day (288 decisions)")
    size.add_argument("--full", action="store_true", help="the whole packaged data set")
    size.add_argument("--days", type=float, default=5.0, help="days from the start (5)")
    parser.add_argument("--off", action="store_true", help="also run without a cache")
    parser.add_argument("--context-window", type=int, default=200_000,
                        help="the model's window in tokens (200,000)")
    parser.add_argument("--sweep", action="store_true",
                        help="time a 20-window cached sweep with one and two jobs")
    parser.add_argument("--window-days", type=float, default=0.5,
                        help="each sweep window's length in days (0.5)")
    parser.add_argument("--random-traders", type=int, default=5,
                        help="random traders per sweep window (5)")
    options = parser.parse_args()
    if options.sweep:
        sweep(options)
    else:
        anyio.run(main, options)
