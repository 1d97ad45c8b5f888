"""A stop that fires while the process holding the desk's venue is killed (``kill -9``) is
found when the venue opens again, and booked once as the trade's exit with its profit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import anyio
import pytest

from tests.trading.protection_child import LIMITS, live_config
from tests.waiting import wait_until
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.factory import open_exchange
from trading_agent.trading.protection_keeper import ProtectionEvent

from .binance_server import FakeBinance
from .conftest import ENVIRON

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a child process imports ccxt and opens the venue (about 5 s)
async def test_a_stop_that_fired_during_a_kill_9_is_booked_once_on_restart(
        tmp_path: Path, binance: FakeBinance) -> None:
    database, progress = tmp_path / "state.sqlite3", tmp_path / "progress"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    command = [sys.executable, "-m", "tests.trading.protection_child", binance.base_url,
               str(database), str(progress)]
    child = await anyio.open_process(command, env=env, cwd=ROOT, stderr=subprocess.PIPE)
    async with child:
        try:
            await wait_until(lambda: progress.exists() or child.returncode is not None,
                             "the child to hold its stop and target", within=30)
            if child.returncode is not None:
                assert child.stderr is not None
                raise AssertionError((await child.stderr.receive()).decode())
        finally:
            if child.returncode is None:
                child.send_signal(signal.SIGKILL)
            await child.wait()
    assert child.returncode == -signal.SIGKILL

    [stop_id] = binance.set_price("16450")  # the stop fills while nothing runs
    async with open_exchange(live_config(binance.base_url), state=TradingStateFile(database),
                             account="alpha", environ=ENVIRON, risk_limits=LIMITS) as venue:
        assert venue.protection is not None
        told: list[ProtectionEvent] = []
        venue.protection.on_event = told.append
        await venue.reconcile()
        await venue.reconcile()
        await venue.match_resting_orders()
        [event] = told
        assert event.while_down and event.order.kind == "stop_loss"
        [trade] = await venue.books.trades()
        assert (trade.exit_reason, trade.exit_price, trade.exited) == (
            "stop_loss", Decimal("16450"), Decimal("0.01"))
        assert event.profit == trade.profit < 0
        assert [f.order_id for f in await venue.books.fills()][1] == str(stop_id)
        target = next(o for o in binance.orders.values() if o["type"] == "TAKE_PROFIT_LIMIT")
        assert target["status"] == "CANCELED"
        assert await venue.protection.live() == []
