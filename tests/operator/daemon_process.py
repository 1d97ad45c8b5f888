"""A real daemon in a subprocess (``trading-agent run --config``), for end-to-end tests.

It runs two paper desks on the packaged replay, whose model is the test's scripted server;
the operator API listens on the state directory's socket and, when asked, on TCP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio

from tests.daemon_config import write_daemon_config
from trading_agent.operator.client import OperatorClient, OperatorClientError

__all__ = ["DaemonProcess", "running_daemon"]

_DESKS = {
    "alpha": {"system_prompt": "You are alpha, a paper desk for BTC/USDT.", "maximum_rounds": 6,
              "context": {"keep_recent_tokens": 40}, "subagents": {"enabled": False}},
    "beta": {"system_prompt": "You are beta, a paper desk for BTC/USDT.",
             "subagents": {"enabled": False}},
}


@dataclass(frozen=True)
class DaemonProcess:
    """A running daemon.

    Attributes:
        config: Its config file.
        socket_path: The operator socket.
        url: The TCP base URL, when it listens on TCP.
        log: Its log file (JSON lines).
    """

    config: Path
    socket_path: Path
    url: str | None
    log: Path


def _tcp_url(log: Path) -> str | None:
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("event") == "operator_api_listening":
                return str(record.get("tcp") or "") or None
    return None


@contextlib.asynccontextmanager
async def running_daemon(directory: Path, model_url: str, *,
                         token: str | None = None) -> AsyncIterator[DaemonProcess]:
    """Starts ``trading-agent run`` in ``directory`` and stops it (SIGTERM) on exit.

    Args:
        directory: Where the config, the state and the log go.
        model_url: The scripted server's base URL.
        token: Also listen on TCP (127.0.0.1, a free port) with this bearer token.
    """
    operator: dict[str, object] = {"approval_timeout_seconds": 60}
    if token:
        operator["tcp_address"] = "127.0.0.1:0"
    config = write_daemon_config(
        directory, model_url, desks=_DESKS, exchange={"mode": "paper", "feed": "replay"},
        operator=operator,
        daemon={"state_dir": "state", "log_level": "info", "log_format": "json",
                "watchdog": False, "shutdown_timeout_seconds": 5})
    log = directory / "daemon.log"
    socket_path = directory / "state" / "operator.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRADING_AGENT_")}
    env.pop("STATE_DIRECTORY", None)
    if token:
        env["TRADING_AGENT_OPERATOR_TOKEN"] = token
    with log.open("wb") as output:
        process = await anyio.open_process(
            [sys.executable, "-m", "trading_agent.cli", "run", "--config", str(config)],
            stdout=output, stderr=output, env=env, cwd=directory)
    try:
        with anyio.fail_after(30):
            while True:
                if process.returncode is not None:
                    raise AssertionError(f"the daemon exited with {process.returncode}:\n"
                                         f"{log.read_text(errors='replace')[-4000:]}")
                if socket_path.exists():
                    try:
                        async with OperatorClient(socket_path=socket_path, timeout=2) as client:
                            await client.health()
                        url = _tcp_url(log) if token else None
                        if not token or url:
                            break
                    except OperatorClientError:
                        pass
                await anyio.sleep(0.05)
        yield DaemonProcess(config, socket_path, url, log)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with anyio.move_on_after(15):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
