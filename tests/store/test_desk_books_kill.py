"""A desk's books survive ``kill -9``: a process observing an order's fills is killed at
several moments (between two observations, or wherever it is), and once the order's final
state is observed again the books hold exactly its fills, each counted once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import anyio
import pytest

from tests.store.desk_books_child import CLIENT_ORDER_ID, report
from tests.waiting import wait_until
from trading_agent.store import database_path
from trading_agent.store.desk_books import SqliteDeskBooks

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5


def _progress(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize(("after", "pause"), [
    *[(n, True) for n in range(STEPS + 1)], (1, False), (3, False)])
async def test_books_after_a_kill_hold_each_fill_once(tmp_path: Path, after: int,
                                                      pause: bool) -> None:
    path, progress = database_path(tmp_path / "state"), tmp_path / "progress"
    command = [sys.executable, "-m", "tests.store.desk_books_child", str(path),
               str(progress), str(STEPS), *(["--pause", str(after)] if pause else [])]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    child = await anyio.open_process(command, env=env, cwd=ROOT, stdin=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
    async with child:
        try:
            await wait_until(
                lambda: len(_progress(progress)) > after or child.returncode is not None,
                f"the child to make {after} observations", within=30)
            if child.returncode is not None:
                assert child.stderr is not None
                raise AssertionError((await child.stderr.receive()).decode())
        finally:
            if child.returncode is None:
                child.send_signal(signal.SIGKILL)
            await child.wait()
    assert child.returncode == -signal.SIGKILL
    made = max(_progress(progress))
    assert made >= after and (made == after or not pause)

    books = await SqliteDeskBooks.open(path, "alpha")
    try:
        # What the books held when it was killed: every observation that returned.
        counted = sum((f.amount for f in await books.fills()), Decimal(0))
        assert counted >= Decimal("0.1") * made
        final = report(STEPS, STEPS)
        assert final.average is not None
        await books.observe(final, final.created_at)
        await books.observe(final, final.created_at)  # once more: nothing new
        fills = await books.fills()
        assert len({f.fill_id for f in fills}) == len(fills)
        assert sum((f.amount for f in fills), Decimal(0)) == final.filled == Decimal("0.5")
        # 0.1 each at 100, 101, 102, 103 and 104: 51 paid, and 0.05 USDT of fees.
        assert sum((f.amount * f.price for f in fills), Decimal(0)) == (
            final.filled * final.average) == Decimal(51)
        assert sum((f.fee for f in fills), Decimal(0)) == final.fee == Decimal("0.05")
        (order,) = await books.orders()
        assert (order.client_order_id, order.status, order.filled, order.cost, order.fee) == (
            CLIENT_ORDER_ID, "closed", Decimal("0.5"), Decimal(51), Decimal("0.05"))
        position = (await books.positions())["BTC/USDT"]
        assert position.amount == Decimal("0.5") and position.entry_price == Decimal(102)
        assert position.fees == Decimal("0.05") and position.realized == Decimal("-0.05")
        (trade,) = await books.trades()
        assert trade.amount == Decimal("0.5") and trade.fees == Decimal("0.05")
    finally:
        await books.close()
