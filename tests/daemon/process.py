"""The daemon as a real process, for the few end-to-end tests: kill -9, SIGTERM, systemd.

:class:`DaemonProcess` writes a config pointing at the test's scripted server, starts
``python -m trading_agent.cli run --config ...`` and waits until its operator API answers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio

from tests.daemon_config import write_daemon_config
from trading_agent.operator.client import OperatorClient, OperatorClientError
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.trading.config import PaperExchangeConfig, ReplayConfig
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def short_dir() -> Iterator[Path]:
    """A scratch folder with a short path (a Unix socket path holds at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ta-d-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_config(folder: Path, base_url: str, *, shutdown_timeout: float = 5.0,
                 desks: Mapping[str, Mapping[str, Any]] | None = None,
                 operator: Mapping[str, Any] | None = None) -> Path:
    """A config of one paper desk, ``alpha``, on the scripted server, logging JSON.

    Args:
        folder: Where the config and the state go.
        base_url: The scripted server's base URL.
        shutdown_timeout: ``[daemon] shutdown_timeout_seconds``.
        desks: Overrides of alpha's table (and further desks), as in
            :func:`~tests.daemon_config.write_daemon_config`.
        operator: The ``[operator]`` table, when the test sets one.
    """
    named = dict(desks or {})
    named["alpha"] = {"subagents": {"timeout_seconds": 60}, **named.get("alpha", {})}
    return write_daemon_config(
        folder, base_url,
        daemon={"log_format": "json", "shutdown_timeout_seconds": shutdown_timeout,
                "restart_backoff_seconds": 0.1},
        model={"request_timeout": 30}, exchange={"replay": {"speed": 60}},
        desks=named, operator=operator)


class DaemonProcess:
    """One run of the daemon.

    Args:
        config: The config file.
        environ: Extra environment variables.
        wrapper: A command the daemon is run under (``setpriv ...``).
    """

    def __init__(self, config: Path, environ: Mapping[str, str] | None = None, *,
                 wrapper: Sequence[str] = ()) -> None:
        self.config = config
        # Daemons of a fleet share one config: each gets its own $STATE_DIRECTORY.
        self.state_dir = Path((environ or {}).get("STATE_DIRECTORY") or config.parent / "state")
        self.log_path = config.parent / f"daemon-{time.monotonic_ns()}.log"
        env = {key: value for key, value in os.environ.items()
               if key not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        env.update(environ or {})
        env["PYTHONPATH"] = str(ROOT / "src")
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "trading_agent.cli", "run", "--config",
             str(config)],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "operator.sock"

    def client(self) -> OperatorClient:
        return OperatorClient(socket_path=self.socket_path, timeout=10)

    async def wait_ready(self, within: float = 20) -> None:
        """Waits until the operator API answers (the desks have started)."""
        with anyio.fail_after(within):
            while True:
                if self.process.poll() is not None:
                    raise AssertionError(f"the daemon exited early:\n{self.log()}")
                if self.socket_path.exists():
                    try:
                        async with self.client() as client:
                            await client.health()
                        return
                    except OperatorClientError:
                        pass
                await anyio.sleep(0.05)

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def kill(self) -> None:
        """``kill -9``."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    async def wait_exit(self, within: float) -> int:
        """Waits for the process to end; returns its exit code."""
        with anyio.fail_after(within):
            while self.process.poll() is None:  # noqa: ASYNC110 (another process)
                await anyio.sleep(0.02)
        return int(self.process.returncode)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


async def place_resting_order(state_dir: Path, account: str = "alpha") -> str:
    """Opens the desk's paper account as the daemon would and rests a buy far below the
    market (it never fills); returns the order's id."""
    await anyio.Path(state_dir).mkdir(parents=True, exist_ok=True)
    feed = ReplayFeed.from_config(ReplayConfig())
    books = await SqlitePaperBooks.open(state_dir / "trading-agent.sqlite3", account)
    exchange = await PaperExchange.open(PaperExchangeConfig(), feed, books)
    try:
        order = await exchange.create_order(OrderRequest(
            "BTC/USDT", "buy", "limit", Decimal("0.01"), Decimal("1")))
    finally:
        await exchange.close()
        await feed.close()
    return order.id


async def paper_books(state_dir: Path, account: str = "alpha") -> dict[str, Any]:
    """The paper account's balances and open orders, read from the file."""
    ledger = await SqlitePaperBooks.open(state_dir / "trading-agent.sqlite3", account)
    try:
        snapshot = await ledger.load()
    finally:
        await ledger.close()
    return {"balances": dict(snapshot.balances),
            "open_orders": sorted(paper.order.id for paper in snapshot.open_orders)}
