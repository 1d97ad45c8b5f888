"""The first hour: ``make run`` serves the web page on loopback, with a token made at start.

The demo config (``config/demo.toml``) listens on 127.0.0.1:8765, or the next free port, and
sets ``generate_token``: when ``$TRADING_AGENT_OPERATOR_TOKEN`` is unset the daemon makes a
token and shows it once, in the address its banner prints on a terminal (elsewhere it is
written to an owner-only file the banner names), never in a log line. These tests
run the API in-process for the rules and a real ``trading-agent run`` for what a newcomer
sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import tomllib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.operator.harness import build_control, running_api
from tests.scripted_server import ScriptedServer
from trading_agent.errors import ConfigError
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.server import serve_operator_api
from trading_agent.settings import load_settings, missing_secrets

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "config" / "demo.toml"
TOKEN = "correct-horse-battery-staple-42"
_BANNER_URL = re.compile(r"web page: (http://127\.0\.0\.1:(\d+)/)#token=(<[^>]+>|\S+)")


def _demo_operator() -> dict[str, Any]:
    """The demo's ``[operator]`` table, as the file has it."""
    with DEMO.open("rb") as file:
        table: dict[str, Any] = tomllib.load(file)["operator"]
    return table


@contextmanager
def _busy_ports(count: int) -> Iterator[int]:
    """``count`` consecutive loopback ports some other program listens on; yields the
    first."""
    with contextlib.ExitStack() as held:
        for _ in range(50):
            held.close()
            first = held.enter_context(socket.create_server(("127.0.0.1", 0)))
            port = int(first.getsockname()[1])
            try:
                for offset in range(1, count):
                    held.enter_context(socket.create_server(("127.0.0.1", port + offset)))
            except OSError:
                continue
            yield port
            return
    raise AssertionError(f"found no {count} consecutive free ports")


async def _api_answers(url: str, token: str) -> None:
    """The page loads without a token (it holds none); every /api call needs it."""
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        page = await client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        refused = await client.get("/api/desks")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthorized"
        desks = await client.get("/api/desks", headers={"Authorization": f"Bearer {token}"})
        assert desks.status_code == 200, desks.text
        assert desks.json()["desks"]


# ---------------------------------------------------------------- the rules, in-process


def test_the_demo_serves_the_page_on_loopback_with_a_token_made_at_start() -> None:
    operator = _demo_operator()
    assert operator["tcp_address"] == "127.0.0.1:8765"
    assert operator["generate_token"] is True
    assert operator["tcp_port_tries"] > 1
    settings = load_settings(DEMO)
    assert settings.operator.tcp_is_loopback
    # No variable to set before `make run`: check-config has nothing to warn about.
    assert missing_secrets(settings, DEMO, environ={}) == []


@pytest.mark.parametrize("address", ["0.0.0.0:8765", "192.168.1.20:8765", "[::]:8765", None])
def test_a_token_is_made_only_for_a_listener_this_machine_alone_reaches(
        address: str | None) -> None:
    with pytest.raises(ValueError, match="generate_token needs a loopback tcp_address"):
        OperatorConfig(tcp_address=address, generate_token=True)
    assert OperatorConfig(tcp_address="[::1]:8765", generate_token=True).tcp_is_loopback


async def test_a_token_made_at_start_opens_the_api_and_is_kept_out_of_repr(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0", generate_token=True)
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ={"TRADING_AGENT_OPERATOR_TOKEN": "  "}) as (endpoints, _):
        token = endpoints.generated_token
        assert token is not None and len(token) >= 40  # 32 random bytes, URL-safe
        assert endpoints.url is not None and endpoints.token_env == "TRADING_AGENT_OPERATOR_TOKEN"
        assert token not in repr(endpoints)
        await _api_answers(endpoints.url, token)
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ={}) as (again, _):
        assert again.generated_token not in (None, token)  # a new one each start


async def test_a_token_in_the_environment_wins_and_is_never_shown(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0", generate_token=True)
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ={"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}) as (endpoints, _):
        assert endpoints.generated_token is None
        assert endpoints.url is not None
        await _api_answers(endpoints.url, TOKEN)


async def test_a_short_token_in_the_environment_is_refused_not_replaced(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0", generate_token=True)
    with pytest.raises(ConfigError, match="shorter than 16 characters"):
        await serve_operator_api(control, ApprovalBook(), config, state_dir=state_dir,
                                 environ={"TRADING_AGENT_OPERATOR_TOKEN": "short"})


async def test_a_taken_port_moves_the_listener_to_the_next_free_one(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    with _busy_ports(1) as port:
        config = OperatorConfig(tcp_address=f"127.0.0.1:{port}", tcp_port_tries=5)
        async with running_api(control, ApprovalBook(), config, state_dir,
                               environ={"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}) as (endpoints, _):
            assert endpoints.tcp is not None
            assert port < endpoints.tcp[1] < port + 5
            assert endpoints.url is not None
            await _api_answers(endpoints.url, TOKEN)


async def test_a_taken_port_without_tries_is_a_clear_error(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    environ = {"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}
    with _busy_ports(2) as port:
        config = OperatorConfig(tcp_address=f"127.0.0.1:{port}")
        with pytest.raises(ConfigError, match=f"cannot listen on operator.tcp_address "
                                              f"127.0.0.1:{port}: .*in use"):
            await serve_operator_api(control, ApprovalBook(), config, state_dir=state_dir,
                                     environ=environ)
        config = OperatorConfig(tcp_address=f"127.0.0.1:{port}", tcp_port_tries=2)
        with pytest.raises(ConfigError, match=r"tcp_port_tries\): all are in use"):
            await serve_operator_api(control, ApprovalBook(), config, state_dir=state_dir,
                                     environ=environ)
    assert not (state_dir / "operator.sock").exists()


# ---------------------------------------------------------------- a real daemon


_CONFIG = """\
[daemon]
state_dir = "state"
log_format = "json"
watchdog = false
shutdown_timeout_seconds = 5

[model]
provider = "openai"
base_url = "{model_url}"
model = "scripted-model"
context_window = 32000

[desks.alpha]
system_prompt = "You are alpha, a paper desk for BTC/USDT."
symbols = ["BTC/USDT"]

[desks.alpha.subagents]
enabled = false

[operator]
{operator}
"""


@asynccontextmanager
async def _demo_daemon(folder: Path, model_url: str,
                       environ: dict[str, str]) -> AsyncIterator[tuple[str, Path]]:
    """``trading-agent run`` with the demo's ``[operator]`` table and a scripted model;
    yields the banner and the output file (log lines and banner)."""
    operator = "\n".join(f"{key} = {json.dumps(value)}"
                         for key, value in _demo_operator().items())
    config = folder / "daemon.toml"
    config.write_text(_CONFIG.format(model_url=model_url, operator=operator))
    output = folder / "daemon.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRADING_AGENT_")}
    env.pop("STATE_DIRECTORY", None)
    env.update(environ, PYTHONPATH=str(ROOT / "src"))
    with output.open("wb") as sink:
        process = await anyio.open_process(
            [sys.executable, "-m", "trading_agent.cli", "run", "--config", str(config)],
            stdout=sink, stderr=sink, env=env, cwd=folder)
    try:
        with anyio.fail_after(30):
            while "stop: Ctrl-C" not in (text := output.read_text(errors="replace")):
                if process.returncode is not None:
                    raise AssertionError(f"the daemon exited with {process.returncode}:\n"
                                         f"{text[-4000:]}")
                await anyio.sleep(0.05)
        yield text, output
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(15):
            assert await process.wait() == 0, output.read_text(errors="replace")[-3000:]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.slow
async def test_the_daemon_prints_the_page_address_and_where_its_token_is_and_logs_it_nowhere(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _demo_daemon(state_dir, scripted_server.base_url, {}) as (banner, output):
        found = _BANNER_URL.search(banner)
        assert found is not None, banner[-3000:]
        url, port = found.group(1), int(found.group(2))
        assert 8765 <= port < 8765 + _demo_operator()["tcp_port_tries"]
        # Not a terminal (a file, as under systemd): the banner names the file, not the token.
        token_file = state_dir / "state" / "web-token"
        assert found.group(3) == f"<the token in {token_file}>"
        token = token_file.read_text().strip()
        await _api_answers(url, token)
    # The token file is the one place the token appears: not in the output, nor the store.
    assert token not in output.read_text(errors="replace")
    for stored in (state_dir / "state").rglob("*"):
        if stored.is_file() and stored != token_file:
            assert token.encode() not in stored.read_bytes(), stored


@pytest.mark.slow
async def test_with_a_token_in_the_environment_the_banner_names_the_variable(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    environ = {"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}
    async with _demo_daemon(state_dir, scripted_server.base_url, environ) as (banner, output):
        found = _BANNER_URL.search(banner)
        assert found is not None, banner[-3000:]
        assert found.group(3) == "$TRADING_AGENT_OPERATOR_TOKEN"
        await _api_answers(found.group(1), TOKEN)
    assert TOKEN not in output.read_text(errors="replace")
