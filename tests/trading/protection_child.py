"""A process that holds a live desk's venue on the FakeBinance stand-in, for
tests/trading/test_protection_kill.py: it buys with a stop and a target, writes ``ready`` to
its progress file once both are held by the exchange, then waits to be killed.

Usage: python -m tests.trading.protection_child BASE_URL DATABASE PROGRESS
"""

from __future__ import annotations

import sys
from decimal import Decimal
from pathlib import Path

import anyio

from tests.trading.conftest import ENVIRON
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.config import CcxtExchangeConfig, ExchangeConfig, RiskLimits
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.factory import open_exchange


def live_config(base_url: str) -> ExchangeConfig:
    """A live desk on the stand-in at ``base_url``, as the trading tests configure it."""
    return ExchangeConfig(mode="live", ccxt=CcxtExchangeConfig(
        exchange_id="binance", api_key_env="FAKE_BINANCE_KEY",
        secret_env="FAKE_BINANCE_SECRET",
        options={"fetchMarkets": {"types": ["spot"]}, "fetchCurrencies": False,
                 "fetchMargins": False},
        api_urls={"public": f"{base_url}/api/v3", "private": f"{base_url}/api/v3"},
        client_settings={"timeout_on_exit": 0}, timeout_seconds=2, enable_rate_limit=False))


LIMITS = RiskLimits(max_order_notional=Decimal("1000"))


async def main(base_url: str, database: Path, progress: Path) -> None:
    async with open_exchange(live_config(base_url), state=TradingStateFile(database),
                             account="alpha", environ=ENVIRON, risk_limits=LIMITS) as venue:
        assert venue.risk is not None and venue.protection is not None
        request = OrderRequest("BTC/USDT", "buy", "market", Decimal("0.01"), turn="t1")
        await venue.protection.attach(request, Decimal("16500"), Decimal("16900"))
        await venue.risk.place_order(request)
        await venue.protection.step()
        assert all(o.order_id for o in await venue.protection.live())
        await anyio.Path(progress).write_text("ready\n")
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
