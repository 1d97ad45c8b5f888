"""The protection settings in a config file, and what ``check-config`` says of a live
exchange that cannot hold stops itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from trading_agent import cli
from trading_agent.settings import load_settings
from trading_agent.trading.ccxt_exchange import protection_held_by
from trading_agent.trading.config import CcxtExchangeConfig

CONFIG = """
[model]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "small"
context_window = 32000

[desks.held]
system_prompt = "Trade."
symbols = ["BTC/USDT"]

[desks.held.risk]
require_stop_loss = true
max_loss_per_trade = "{loss}"

[desks.held.exchange]
mode = "live"
ccxt = {{ exchange_id = "binance", api_key_env = "K", secret_env = "S" }}

[desks.watched]
system_prompt = "Trade."
symbols = ["BTC/USDT"]

[desks.watched.exchange]
mode = "live"
ccxt = {{ exchange_id = "bitstamp", api_key_env = "K", secret_env = "S" }}
"""


def _write(tmp_path: Path, loss: str = "25") -> Path:
    path = tmp_path / "config.toml"
    path.write_text(CONFIG.format(loss=loss))
    return path


def test_the_risk_keys_are_read_and_a_bad_one_is_named(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    risk = load_settings(_write(tmp_path)).desks["held"].risk
    assert (risk.require_stop_loss, str(risk.max_loss_per_trade)) == (True, "25")
    path = _write(tmp_path, loss="-1")
    assert cli.main(["check-config", str(path)]) == cli.EXIT_CONFIG
    assert f"{path}: desks.held.risk.max_loss_per_trade" in capsys.readouterr().err


def test_check_config_names_the_exchange_whose_stops_the_daemon_watches(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", str(_write(tmp_path))]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines()
                if "cannot hold" in line]
    assert warnings == [
        "warning: desk watched: bitstamp cannot hold stop-loss and take-profit orders itself "
        "(by ccxt's has flags): the daemon watches the price and sends a market order when "
        "it is crossed, so this protection stops when the daemon does."]


def test_the_has_flags_can_be_narrowed_in_the_config() -> None:
    assert protection_held_by(CcxtExchangeConfig()) == ["stop_loss", "take_profit"]
    narrowed = CcxtExchangeConfig(client_settings={"has": {"createTakeProfitOrder": False,
                                                           "createTriggerOrder": False}})
    assert protection_held_by(narrowed) == ["stop_loss"]
