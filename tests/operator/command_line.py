"""``trading-agent`` run as a user runs it, against a daemon's Unix socket."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio

__all__ = ["CLI", "cli_environment", "run_cli"]

CLI = [sys.executable, "-m", "trading_agent.cli"]


def cli_environment() -> dict[str, str]:
    """The test process's environment without what would point the CLI elsewhere, and
    without colours."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("TRADING_AGENT_SOCKET", "STATE_DIRECTORY")}
    environment["NO_COLOR"] = "1"
    return environment


async def run_cli(socket: Path, *args: str, within: float = 30.0) -> tuple[int, str, str]:
    """Runs ``trading-agent ARGS --socket SOCKET``; returns the exit code, stdout, stderr."""
    with anyio.fail_after(within):
        result = await anyio.run_process([*CLI, *args, "--socket", str(socket)], check=False,
                                         env=cli_environment())
    return result.returncode, result.stdout.decode(), result.stderr.decode()
