"""``[telegram]``: absent means no bot; a mistake names the file, the key and what is allowed;
``check-config`` says who can use the bot."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon_config import write_daemon_config
from trading_agent import cli
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings

OPERATORS = [{"name": "ann", "role": "trader", "token_env": "ANN_TOKEN",
              "telegram_user_id": 1001}]


def _config(tmp_path: Path, **telegram: object) -> Path:
    return write_daemon_config(
        tmp_path, "http://127.0.0.1:9/v1", operator={"operators": OPERATORS},
        tables={"telegram": {"token_env": "TELEGRAM_BOT_TOKEN", "default_desk": "alpha",
                             **telegram}})


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    return str(caught.value)


def test_no_telegram_table_means_no_bot(tmp_path: Path) -> None:
    settings = load_settings(write_daemon_config(tmp_path, "http://127.0.0.1:9/v1"))
    assert settings.telegram is None


def test_a_default_desk_that_is_no_desk_is_named_with_the_desks_there_are(
        tmp_path: Path) -> None:
    path = _config(tmp_path, default_desk="gamma")
    message = _error(path)
    assert str(path) in message
    assert "telegram.default_desk 'gamma' is not a desk; allowed: alpha" in message


def test_telegram_in_a_fleet_is_refused_saying_why(tmp_path: Path) -> None:
    path = write_daemon_config(
        tmp_path, "http://127.0.0.1:9/v1", operator={"operators": OPERATORS},
        tables={"telegram": {"token_env": "TELEGRAM_BOT_TOKEN", "default_desk": "alpha"},
                "store": {"url": "postgresql://fleet@127.0.0.1:5432/fleet"},
                "fleet": {"nats_url": "nats://127.0.0.1:4222", "key_env": "FLEET_KEY",
                          "trusted_network": True}})
    message = _error(path)
    assert str(path) in message
    assert "telegram: not yet in a fleet" in message and "one poller per token" in message


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("daily_summary_at", "25:00", "HH:MM in UTC"),
    ("base_url", "ftp://example", "http:// or https:// URL"),
    ("notifications", {"fills": "loud"}, "'on', 'silent' or 'off'"),
    ("notifications", {"trades": "on"}, "trades"),
])
def test_a_bad_value_names_the_key_and_what_is_allowed(tmp_path: Path, key: str, value: object,
                                                       allowed: str) -> None:
    message = _error(_config(tmp_path, **{key: value}))
    assert "telegram" in message and key.split(".")[0] in message
    assert allowed in message


def test_the_token_variable_is_required_to_run_and_check_config_names_the_bot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = _config(tmp_path, daily_summary_at="18:00")
    monkeypatch.setenv("ANN_TOKEN", "ann-token-0123456789abcdef")
    monkeypatch.delenv("TELEGRAM_BOT_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="TELEGRAM_BOT_TOKEN"):
        load_settings(path, check_environment=True)
    assert cli.main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert ("telegram: token from TELEGRAM_BOT_TOKEN, chats start on desk alpha; daily "
            "summary at 18:00 UTC; operators ann") in out
