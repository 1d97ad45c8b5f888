"""A process that keeps a desk's books on a SQLite file and is killed with SIGKILL by
tests/store/test_desk_books_kill.py.

It notes one order and observes its cumulative fills one step at a time (step ``i`` has
filled ``0.1 x i``, the ``i``-th tenth at ``100 + i - 1``, and paid ``0.01 x i`` USDT),
appending ``i`` to the progress file once each observation has returned. With ``--pause``
it stops after that many observations and waits for its end; without, it goes on to the
last step, so the kill lands wherever it is.

Usage: python -m tests.store.desk_books_child FILE PROGRESS STEPS [--pause N]
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import anyio

from trading_agent.store.desk_books import SqliteDeskBooks
from trading_agent.trading.books import BookOrder
from trading_agent.trading.exchange import Order

AT = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
ORDER_ID = "X-1"
CLIENT_ORDER_ID = "cid-1"


def report(step: int, steps: int) -> Order:
    """The order as the exchange reports it after ``step`` of ``steps`` tenths filled."""
    filled = Decimal("0.1") * step
    average = None if step == 0 else Decimal(100) + Decimal(step - 1) / 2
    return Order(id=ORDER_ID, client_order_id=CLIENT_ORDER_ID, symbol="BTC/USDT",
                 side="buy", type="limit", amount=Decimal("0.1") * steps, price=Decimal(200),
                 status="closed" if step == steps else "open", filled=filled,
                 average=average, fee=Decimal("0.01") * step, fee_currency="USDT",
                 created_at=AT)


def noted(steps: int) -> BookOrder:
    """The order as noted before it is sent."""
    return BookOrder(CLIENT_ORDER_ID, "BTC/USDT", "buy", "limit", Decimal("0.1") * steps,
                     Decimal(200), "t1", AT)


async def main(path: Path, progress: Path, steps: int, pause: int | None) -> None:
    books = await SqliteDeskBooks.open(path, "alpha")
    await books.note_order(noted(steps))
    with progress.open("a") as out:
        out.write("0\n")
        out.flush()
        for step in range(1, steps + 1):
            if pause is not None and step > pause:
                break
            await books.observe(report(step, steps), AT + timedelta(seconds=step))
            out.write(f"{step}\n")
            out.flush()
    await anyio.to_thread.run_sync(sys.stdin.read)  # until killed


if __name__ == "__main__":
    arguments = sys.argv[1:]
    paused = int(arguments[4]) if arguments[3:4] == ["--pause"] else None
    anyio.run(main, Path(arguments[0]), Path(arguments[1]), int(arguments[2]), paused)
