"""Hooks named in a desk's config: made when the desk is built, in the daemon and in a
backtest alike, run before the approval gate; a bad name is a readable config error."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import anyio
import pytest

from tests.backtest.trader import trading_responder
from tests.desks.refusing_hooks import REFUSAL
from tests.operator.harness import in_process_daemon, uds_client
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent import cli
from trading_agent.backtest.engine import BacktestSpec, parse_time, run_backtest
from trading_agent.desks.hooks import load_hooks
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings
from trading_agent.trading.config import PACKAGED_CANDLES

NO_ORDERS = "tests.desks.refusing_hooks:NoOrders"

DAEMON = """
[daemon]
state_dir = "{state}"

[model]
provider = "openai"
base_url = "{url}"
model = "scripted-model"
context_window = 32000

[operator]
approval_notional_threshold = 0  # every order waits for a person, unless a hook refused it

[desks.alpha]
system_prompt = "You are alpha."
symbols = ["BTC/USDT"]
hooks = {hooks}

[desks.alpha.exchange.paper]
starting_balances = {{ USDT = "100000" }}
"""

BACKTEST = """
[daemon]
state_dir = "state"

[model]
provider = "openai"
base_url = "{url}"
model = "scripted-trader"
context_window = 32000

[desks.solo]
system_prompt = "You trade BTC/USDT."
symbols = ["BTC/USDT"]
hooks = {hooks}

[desks.solo.triggers]
schedules = [{{ every = "2h", name = "check", message = "Check." }}]

[desks.solo.exchange.replay.files]
"BTC/USDT" = "{btc}"
"""


def _daemon_config(folder: Path, url: str, hooks: str) -> Path:
    path = folder / "daemon.toml"
    path.write_text(DAEMON.format(state=folder / "state", url=url, hooks=hooks))
    return path


def _tool_results(server: ScriptedServer) -> list[str]:
    return [str(message["content"]) for request in server.requests
            for message in request.messages if message.get("role") == "tool"]


async def test_a_configured_hook_refuses_an_order_in_the_daemon_before_the_approval_gate(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    order = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.5"}
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", order)]),
                        Reply("No order today, then."))
    config = _daemon_config(tmp_path, scripted_server.base_url, f'["{NO_ORDERS}"]')
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        response = await client.post("/api/desks/alpha/messages",
                                     json={"text": "Buy half a bitcoin.", "wait": True})
        assert response.status_code == 200
        assert response.json()["reply"]["text"] == "No order today, then."
        exchange = running.daemon.venues["alpha"].exchange
        assert await exchange.fetch_open_orders() == []
        balances = await exchange.fetch_balances()
        assert balances["USDT"].total == Decimal("100000")
        assert "BTC" not in balances or balances["BTC"].total == 0
        events = running.daemon.store.events
        with anyio.fail_after(10):
            while not any(event["type"] == "turn_end" for event in  # noqa: ASYNC110
                          await events.events_since(0, "alpha")):
                await anyio.sleep(0.01)
        kinds = [event["type"] for event in await events.events_since(0, "alpha")]
    # The model read the hook's refusal as the call's result; the gate never asked anyone.
    assert _tool_results(scripted_server) == [REFUSAL]
    assert "approval_requested" not in kinds
    scripted_server.assert_complete()


async def test_a_backtest_builds_the_desk_with_the_same_hook(tmp_path: Path) -> None:
    with ScriptedServer(responder=trading_responder) as server:
        config = tmp_path / "solo.toml"
        config.write_text(BACKTEST.format(url=server.base_url, btc=PACKAGED_CANDLES,
                                          hooks=f'["{NO_ORDERS}"]'))
        spec = BacktestSpec(load_settings(config), "solo", parse_time("2023-01-06"),
                            parse_time("2023-01-06T04:00"), cache_dir=tmp_path / "cache",
                            source=str(config))
        record = await run_backtest(spec)
        results = _tool_results(server)
    assert len(record.decisions) == 2  # 02:00 and 04:00: the desk asked to trade each time
    assert REFUSAL in results
    assert record.trades == [] and record.fills == []


@pytest.mark.parametrize(("hooks", "wrong"), [
    ('["tests.desks.no_such_module:NoOrders"]',
     "desks.alpha.hooks: [0] 'tests.desks.no_such_module:NoOrders': module "
     "'tests.desks.no_such_module' cannot be imported (ModuleNotFoundError: "),
    ('["tests.desks.refusing_hooks:NoSuchHook"]',
     "desks.alpha.hooks: [0] 'tests.desks.refusing_hooks:NoSuchHook': module "
     "'tests.desks.refusing_hooks' has no 'NoSuchHook'"),
    (f'["{NO_ORDERS}", "tests.desks.refusing_hooks:NOT_A_FACTORY"]',
     "desks.alpha.hooks: [1] 'tests.desks.refusing_hooks:NOT_A_FACTORY': "
     "'tests.desks.refusing_hooks:NOT_A_FACTORY' is a int, not a factory to call"),
    ('["no-such-hook"]',
     "desks.alpha.hooks: [0] 'no-such-hook': no entry point 'no-such-hook' in group "
     "'trading_agent.hooks', and it is not an import path (package.module:factory)"),
])
def test_check_config_says_which_hook_is_wrong_and_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], hooks: str, wrong: str) -> None:
    config = _daemon_config(tmp_path, "http://127.0.0.1:9/v1", hooks)
    assert cli.main(["check-config", str(config)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "the configuration is not valid" in err
    assert wrong in err


def test_a_hook_is_found_by_its_entry_point_name(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # An installed package announcing a hook, as its metadata on the path says.
    info = tmp_path / "desk_hooks-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: desk-hooks\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[trading_agent.hooks]\nno-orders = {NO_ORDERS}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = _daemon_config(tmp_path, "http://127.0.0.1:9/v1", '["no-orders"]')
    settings = load_settings(config)
    [hook] = load_hooks("alpha", settings.desks["alpha"].hooks)
    assert type(hook).__name__ == "NoOrders"


def test_a_factory_that_fails_names_the_desk_and_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        load_hooks("alpha", [NO_ORDERS, "tests.desks.refusing_hooks:broken"])
    assert str(caught.value) == (
        "desks.alpha.hooks[1] ('tests.desks.refusing_hooks:broken'): its factory failed "
        "(RuntimeError: the hook's database is down)")
