"""How fast the paper trading path runs: orders per second and replayed candles per second.

Measured, each as the median of several repetitions in this one process:

- orders/s through the whole path a tool call takes: risk policy (under its lock), paper
  exchange, one SQLite transaction per order (WAL, file on disk);
- the same orders straight into the paper exchange, without the risk checks;
- a reference: one bare SQLite insert + commit per order through ``anyio.to_thread``, the
  floor any durable order path pays;
- replay speed: candles per second published by the replay with a subscriber reading them
  and the paper exchange matching a resting order on each (what a desk's tick loop does),
  and the bare replay stepping alone.

Run: ``python bench/paper_fills.py [--orders 2000] [--repeat 5]``. Figures are printed, never
asserted; compare runs on the same machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path

import anyio

from trading_agent.store.database import Database
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.trading.config import PACKAGED_CANDLES, PaperExchangeConfig, RiskLimits
from trading_agent.trading.exchange import Candle, OrderRequest
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed, load_candles_csv
from trading_agent.trading.risk import RiskPolicy

D = Decimal
PAPER = PaperExchangeConfig(starting_balances={"USDT": D("10000000")})
# Generous limits: every check runs, none refuses.
LIMITS = RiskLimits(allowed_symbols=["BTC/USDT"], max_order_notional=D("1000000"),
                    max_position_notional=D("100000000"), max_open_orders=1000,
                    max_orders_per_hour=1_000_000, max_daily_loss=D("100000000"))


def _orders(count: int) -> list[OrderRequest]:
    """Alternating small market buys and sells, so balances stay put."""
    return [OrderRequest("BTC/USDT", "buy" if i % 2 == 0 else "sell", "market", D("0.01"))
            for i in range(count)]


def _feed(candles: list[Candle], start_offset: int = 300) -> ReplayFeed:
    return ReplayFeed({"BTC/USDT": candles}, speed=0, start_offset=start_offset)


async def _paper_orders(candles: list[Candle], count: int, directory: Path,
                        with_risk: bool) -> float:
    exchange = await PaperExchange.open(PAPER, _feed(candles),
                                        await SqlitePaperBooks.open(directory / "bench.sqlite3"))
    policy = RiskPolicy(LIMITS, exchange)
    place: Callable[[OrderRequest], Awaitable[object]] = (
        policy.place_order if with_risk else exchange.create_order)
    requests = _orders(count)
    try:
        started = time.perf_counter()
        for request in requests:
            await place(request)
        elapsed = time.perf_counter() - started
    finally:
        await exchange.close()
    return count / elapsed


async def _raw_inserts(count: int, directory: Path) -> float:
    database = await Database.open(directory / "raw.sqlite3", ((1, (
        "CREATE TABLE fills (seq INTEGER PRIMARY KEY, symbol TEXT, amount TEXT, price TEXT)",
    )),), "bench")

    def insert(connection: sqlite3.Connection) -> None:
        connection.execute("INSERT INTO fills (symbol, amount, price) VALUES (?, ?, ?)",
                           ("BTC/USDT", "0.01", "16612.0"))

    try:
        started = time.perf_counter()
        for _ in range(count):
            await database.write(insert)
        elapsed = time.perf_counter() - started
    finally:
        await database.close()
    return count / elapsed


async def _replay_with_desk(candles: list[Candle], directory: Path) -> float:
    """Candles/s: the replay at speed 0, one subscriber, the paper exchange syncing a resting
    order on every candle."""
    feed = _feed(candles, start_offset=1)
    exchange = await PaperExchange.open(PAPER, feed,
                                        await SqlitePaperBooks.open(directory / "replay.sqlite3"))
    # A buy far below the market: it rests through the whole replay and is checked each time.
    await exchange.create_order(OrderRequest("BTC/USDT", "buy", "limit", D("0.01"), D("1000")))
    seen = 0
    try:
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            with feed.subscribe() as subscription:
                await group.start(feed.run)
                async for _candle in subscription:
                    await exchange.sync()
                    seen += 1
        elapsed = time.perf_counter() - started
    finally:
        await exchange.close()
    return seen / elapsed


def _replay_alone(candles: list[Candle]) -> float:
    feed = _feed(candles, start_offset=1)
    started = time.perf_counter()
    published = 0
    while not feed.finished:
        published += len(feed.advance())
    return published / (time.perf_counter() - started)


def _median(samples: list[float]) -> str:
    low, high = min(samples), max(samples)
    return f"{statistics.median(samples):>10,.0f}  (min {low:,.0f}, max {high:,.0f})"


async def main(orders: int, repeat: int) -> None:
    started = time.perf_counter()
    candles = load_candles_csv(PACKAGED_CANDLES, "BTC/USDT")
    load_rate = len(candles) / (time.perf_counter() - started)
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, {_processor()}")
    print(f"python {platform.python_version()} ({platform.python_implementation()}), "
          f"sqlite {sqlite3.sqlite_version}, anyio on asyncio")
    print(f"data: {len(candles):,} BTC/USDT 5m candles (CSV parsed at {load_rate:,.0f}/s)")
    print(f"runs: {repeat} repetitions of {orders:,} orders; medians\n")

    with tempfile.TemporaryDirectory() as name:  # warm-up: imports, caches, thread pool
        await _paper_orders(candles, min(orders, 200), Path(name), with_risk=True)
    full: list[float] = []
    bare: list[float] = []
    raw: list[float] = []
    desk_replay: list[float] = []
    alone: list[float] = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as name:
            directory = Path(name)
            full.append(await _paper_orders(candles, orders, directory, with_risk=True))
            bare.append(await _paper_orders(candles, orders, _fresh(directory, "bare"),
                                            with_risk=False))
            raw.append(await _raw_inserts(orders, directory))
            desk_replay.append(await _replay_with_desk(candles, directory))
        alone.append(_replay_alone(candles))

    print("orders per second")
    print(f"  risk + paper exchange + SQLite  {_median(full)}")
    print(f"  paper exchange + SQLite         {_median(bare)}")
    print(f"  bare SQLite insert + commit     {_median(raw)}")
    print(f"  risk checks cost {1 - statistics.median(full) / statistics.median(bare):.0%} "
          f"of the path; full path / bare insert = "
          f"{statistics.median(full) / statistics.median(raw):.2f}")
    print("\nreplayed candles per second")
    print(f"  replay + subscriber + paper sync {_median(desk_replay)}")
    print(f"  replay stepping alone            {_median(alone)}")
    print(f"  a desk's tick path / bare replay = "
          f"{statistics.median(desk_replay) / statistics.median(alone):.3f}")


def _processor() -> str:
    """The CPU's model name (``platform.processor()`` is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _fresh(directory: Path, name: str) -> Path:
    path = directory / name
    path.mkdir(exist_ok=True)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--orders", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args()
    anyio.run(main, options.orders, options.repeat)
