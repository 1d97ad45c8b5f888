"""The config file and the environment: what loads, and what each mistake is told as."""

from __future__ import annotations

import sys
import textwrap
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from trading_agent import cli
from trading_agent.agent.context_compressor import compressor_for
from trading_agent.backends.providers.local import LocalModelSettings
from trading_agent.backends.providers.openai import OpenAIModelSettings
from trading_agent.errors import ConfigError
from trading_agent.settings import (
    DESK_TOOL_NAMES,
    Settings,
    load_settings,
    missing_secrets,
)
from trading_agent.trading.config import PACKAGED_CANDLES

ROOT = Path(__file__).resolve().parent.parent

VALID = """
[daemon]
state_dir = "state"
log_level = "debug"

[model]
provider = "openai"
base_url = "http://127.0.0.1:8080/v1"
model = "small"
api_key_env = "TEST_MODEL_KEY"
context_window = 32000

[exchange.paper]
starting_balances = { USDT = "5000" }

[desks.alpha]
system_prompt = "You trade."
symbols = ["BTC/USDT"]
timezone = "Europe/Paris"

[desks.alpha.triggers]
ticks = { move_percent = 0.5, on_candle_close = ["1h"] }
schedules = [
    { every = "15m" },
    { cron = "*/30 * * * *", name = "half-hourly", message = "Check." },
]

[desks.beta]
system_prompt = "You trade too."
symbols = ["BTC/USDT"]
maximum_rounds = 3

[desks.beta.model]
model = "bigger"
context_window = 128000

[desks.beta.exchange.paper]
taker_fee = "0.002"
"""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TRADING_AGENT_* variable of the machine leaks into a test."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("TRADING_AGENT_") or name in ("STATE_DIRECTORY",
                                                                 "CACHE_DIRECTORY"):
            monkeypatch.delenv(name)


def _write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _errors(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    return str(caught.value).splitlines()


def _one_error(path: Path) -> str:
    errors = _errors(path)
    assert len(errors) == 1, errors
    return errors[0]


# --- what a valid file gives -----------------------------------------------------------------


def test_a_valid_file_loads_with_desks_inheriting_the_defaults(tmp_path: Path) -> None:
    settings = load_settings(_write(tmp_path, VALID))
    assert list(settings.desks) == ["alpha", "beta"]
    assert settings.daemon.log_level == "debug"
    assert settings.daemon.state_dir == tmp_path / "state"  # relative to the file

    alpha, beta = settings.desks["alpha"], settings.desks["beta"]
    assert isinstance(alpha.model, OpenAIModelSettings)
    assert isinstance(beta.model, OpenAIModelSettings)
    assert (alpha.model.model, alpha.model.context_window) == ("small", 32000)
    # beta overrides two keys and keeps the others.
    assert (beta.model.model, beta.model.context_window) == ("bigger", 128000)
    assert beta.model.base_url == "http://127.0.0.1:8080/v1"
    assert beta.model.api_key_env == "TEST_MODEL_KEY"
    assert beta.model.backend_config().model == "bigger"
    # The exchange: top-level keys, a desk's override, the trading layer's defaults.
    assert str(alpha.exchange.paper.starting_balances["USDT"]) == "5000"
    assert str(beta.exchange.paper.starting_balances["USDT"]) == "5000"
    assert str(beta.exchange.paper.taker_fee) == "0.002"
    assert str(alpha.exchange.paper.taker_fee) == "0.001"
    assert alpha.exchange.replay.files == {"BTC/USDT": PACKAGED_CANDLES}
    assert alpha.risk.allowed_symbols == ["BTC/USDT"]

    every, cron = alpha.triggers.schedules
    assert (every.key, every.interval) == ("every 15m", timedelta(minutes=15))
    assert (cron.key, cron.interval, cron.cron) == ("half-hourly", None, "*/30 * * * *")
    assert alpha.triggers.ticks.on_candle_close == ["1h"]
    assert alpha.zone.key == "Europe/Paris"
    assert beta.maximum_rounds == 3 and alpha.maximum_rounds == 20
    assert beta.tools is None  # every tool
    assert alpha.images.keep == 4
    assert settings.daemon.shutdown_timeout_seconds == 8  # the daemon exits within 10 s
    assert (alpha.context.tool_result_max_tokens, alpha.context.flush_max_rounds) == (None, 3)
    assert settings.secret_env_vars() == {
        "TRADING_AGENT_OPERATOR_TOKEN": "operator.token_env",
        "TEST_MODEL_KEY": "desks.alpha.model.api_key_env"}


def test_a_desk_naming_another_provider_replaces_the_model_whole(tmp_path: Path) -> None:
    text = VALID.replace('[desks.beta.model]\nmodel = "bigger"\ncontext_window = 128000',
                         '[desks.beta.model]\nprovider = "local"')
    settings = load_settings(_write(tmp_path, text))
    local = settings.desks["beta"].model
    assert isinstance(local, LocalModelSettings)
    assert local.server_config().context_window == 8192
    assert isinstance(settings.desks["alpha"].model, OpenAIModelSettings)


def test_the_local_models_cache_is_systemds_cache_directory_or_relative_to_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = VALID.replace('[desks.beta.model]\nmodel = "bigger"\ncontext_window = 128000',
                         '[desks.beta.model]\nprovider = "local"')
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/trading-agent")
    local = load_settings(_write(tmp_path, text)).desks["beta"].model
    assert isinstance(local, LocalModelSettings)
    assert local.cache_dir == Path("/var/cache/trading-agent/models")
    text = text.replace('provider = "local"', 'provider = "local"\ncache_dir = "models"')
    local = load_settings(_write(tmp_path, text)).desks["beta"].model
    assert isinstance(local, LocalModelSettings)
    assert local.cache_dir == tmp_path / "models"


@pytest.mark.parametrize("name", ["demo.toml", "example-live.toml"])
def test_the_shipped_config_files_are_valid(name: str) -> None:
    settings = load_settings(ROOT / "config" / name)
    assert settings.desks


def test_the_demo_has_a_tick_desk_and_a_scheduled_desk_on_paper_with_the_local_model() -> None:
    settings = load_settings(ROOT / "config" / "demo.toml")
    assert len(settings.desks) == 2
    modes = {(d.exchange.mode, d.exchange.feed) for d in settings.desks.values()}
    assert modes == {("paper", "replay")}
    assert all(d.model.provider == "local" for d in settings.desks.values())
    assert any(d.triggers.ticks.move_percent for d in settings.desks.values())
    assert any(d.triggers.schedules for d in settings.desks.values())
    assert settings.daemon.state_dir == ROOT / "state"


def test_environment_variables_win_and_nest_with_double_underscores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRADING_AGENT_MODEL__BASE_URL", "http://10.0.0.5:8000/v1")
    monkeypatch.setenv("TRADING_AGENT_DESKS__BETA__MAXIMUM_ROUNDS", "9")
    monkeypatch.setenv("TRADING_AGENT_DAEMON__LOG_FORMAT", "json")
    settings = load_settings(_write(tmp_path, VALID))
    assert settings.desks["alpha"].model.base_url == "http://10.0.0.5:8000/v1"  # type: ignore[union-attr]
    assert settings.desks["beta"].model.base_url == "http://10.0.0.5:8000/v1"  # type: ignore[union-attr]
    assert settings.desks["beta"].maximum_rounds == 9
    assert settings.daemon.log_format == "json"


def test_systemds_state_directory_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(_write(tmp_path, VALID))
    assert settings.state_directory({}) == tmp_path / "state"
    assert settings.state_directory({"STATE_DIRECTORY": "/var/lib/ta:/var/lib/other"}) == Path(
        "/var/lib/ta")


def test_missing_secrets_name_the_key_and_the_variable(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, VALID)
    settings = load_settings(path)
    [line] = missing_secrets(settings, path, environ={})
    assert line.startswith(f"{path}: desks.alpha.model.api_key_env: ")
    assert "TEST_MODEL_KEY is not set" in line
    assert missing_secrets(settings, path, environ={"TEST_MODEL_KEY": "sk-1"}) == []
    with pytest.raises(ConfigError, match="TEST_MODEL_KEY is not set"):
        load_settings(path, check_environment=True)
    monkeypatch.setenv("TEST_MODEL_KEY", "sk-1")
    load_settings(path, check_environment=True)


# --- what each mistake is told as ------------------------------------------------------------


def test_a_missing_key_names_the_file_the_key_and_what_is_allowed(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID.replace('system_prompt = "You trade too."\n', ""))
    assert _one_error(path) == (
        f"{path}: desks.beta.system_prompt: required key is missing "
        "(allowed: a non-empty string)")


def test_a_wrong_type_names_the_value_and_the_type(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID.replace("maximum_rounds = 3", 'maximum_rounds = "three"'))
    assert _one_error(path) == (
        f"{path}: desks.beta.maximum_rounds: a string where an integer is expected; write the "
        "number without quotes (got 'three'; allowed: an integer >= 1, <= 1000)")


def test_an_unknown_key_is_an_error_with_a_suggestion(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID.replace("maximum_rounds = 3", "maximum_round = 3"))
    error = _one_error(path)
    assert error.startswith(f"{path}: desks.beta.maximum_round: unknown key (got 3; did you "
                            "mean maximum_rounds? allowed keys: ")
    assert "system_prompt" in error and "triggers" in error


def test_a_bad_cron_expression_is_caught_at_load_time(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID.replace("*/30 * * * *", "61 * * * *"))
    error = _one_error(path)
    assert error.startswith(f"{path}: desks.alpha.triggers.schedules[1].cron: '61 * * * *' is "
                            "not a valid cron expression (five fields: minute hour")


def test_a_toml_syntax_error_names_the_line_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path, '[daemon]\nlog_level = "info"\nwatchdog = \n')
    assert _one_error(path) == (
        f"{path}: line 3, column 12: invalid TOML: Invalid value (the line: 'watchdog =')")


@pytest.mark.parametrize(
    ("text", "line", "shown", "reason"),
    [
        ('[daemon]\nlog_level = "info"\n\n[desks.alpha]\nsystem_prompt = """You trade.\n'
         'symbols = ["BTC/USDT"]\n\n', 5, 'system_prompt = """You trade.', "Unterminated string"),
        ('[daemon]\nlog_level = "info"\n[desks.alpha]\nsymbols = ["BTC/USDT",\n  "ETH/USDT",'
         '\n\n# the end\n', 4, 'symbols = ["BTC/USDT",', "Invalid value"),
        ('[daemon]\nlog_level = "info"\n\n[desks.alpha', 4, "[desks.alpha",
         "Expected ']' at the end of a table declaration"),
        ("[desks.alpha]\nsystem_prompt = '''You trade.\n", 2, "system_prompt = '''You trade.",
         "Expected \"'''\""),
    ],
    ids=["string", "array", "table", "literal string"],
)
def test_a_value_left_open_at_the_end_of_the_file_is_named_where_it_opens(
        tmp_path: Path, text: str, line: int, shown: str, reason: str) -> None:
    path = _write(tmp_path, text)
    assert _one_error(path) == (
        f"{path}: line {line}: invalid TOML: the string, array or table opened on this line is "
        f"never closed (at the end of the file: {reason}; the line: {shown!r})")


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("maximum_rounds = 3", "maximum_rounds = true",
         "desks.beta.maximum_rounds: a boolean where an integer is expected (got true; allowed: "
         "an integer >= 1, <= 1000)"),
        ("maximum_rounds = 3", "maximum_rounds = 3.0",
         "desks.beta.maximum_rounds: a number with a fraction or an exponent where an integer "
         "is expected (got 3.0; allowed: an integer >= 1, <= 1000)"),
        ('log_level = "debug"', 'log_level = "debug"\nwatchdog = "no"',
         "daemon.watchdog: a string where true or false is expected; write true or false "
         "without quotes (got 'no'; allowed: true or false)"),
        ('log_level = "debug"', 'log_level = "debug"\nwatchdog = 0',
         "daemon.watchdog: an integer where true or false is expected (got 0; allowed: true or "
         "false)"),
        ("context_window = 32000", "context_window = 1e27",
         "model.context_window: a number with a fraction or an exponent where an integer is "
         "expected (got 1e+27; allowed: an integer > 0, <= 10000000)"),
        ("context_window = 32000", "context_window = 100_000_000",
         "model.context_window: Input should be less than or equal to 10000000 (got 100000000; "
         "allowed: an integer > 0, <= 10000000)"),
        ("context_window = 32000", "context_window = 32000\nrequest_timeout = inf",
         "model.request_timeout: inf or nan where a finite number is expected (got inf; "
         "allowed: a number > 0, <= 3600)"),
        ("context_window = 32000", 'context_window = 32000\nrequest_timeout = "30"',
         "model.request_timeout: a string where a number is expected; write the number without "
         "quotes (got '30'; allowed: a number > 0, <= 3600)"),
        ('taker_fee = "0.002"', "taker_fee = true",
         "desks.beta.exchange.paper.taker_fee: a boolean where a number is expected (got true; "
         "allowed: a number"),
        ("ticks = { move_percent = 0.5,", "ticks = { move_percent = false,",
         "desks.alpha.triggers.ticks.move_percent: a boolean where a number is expected (got "
         "false; allowed: a number > 0, <= 100, or leave the key out)"),
        ("[exchange.paper]", "[exchange.replay]\nspeed = 1e300\n[exchange.paper]",
         "exchange.replay.speed: Input should be less than or equal to 1000000"),
        ("[exchange.paper]", "[exchange.replay]\nstart = 1700000000\n[exchange.paper]",
         "exchange.replay.start: an integer where a date and time is expected (got 1700000000; "
         "allowed: a date and time such as 2024-05-01T00:00:00Z, or leave the key out)"),
        ("[exchange.paper]", "[operator]\nmax_message_chars = true\n[exchange.paper]",
         "operator.max_message_chars: a boolean where an integer is expected (got true;"),
        ("maximum_rounds = 3", "maximum_rounds = 3\n[desks.beta.subagents]\nenabled = 1",
         "desks.beta.subagents.enabled: an integer where true or false is expected (got 1;"),
        ("maximum_rounds = 3", "maximum_rounds = 3\n[desks.beta.controls]\n"
         "max_tokens_per_day = 1e6",
         "desks.beta.controls.max_tokens_per_day: a number with a fraction or an exponent where "
         "an integer is expected (got 1000000.0;"),
    ],
    ids=["bool for int", "float for int", "string for bool", "int for bool", "1e27 window",
         "huge window", "inf timeout", "quoted number", "bool for decimal", "bool for float",
         "huge replay speed", "number for date", "operator table", "subagent table",
         "spend cap"],
)
def test_the_file_is_held_to_its_types(tmp_path: Path, old: str, new: str,
                                       expected: str) -> None:
    """pydantic alone reads true as 1, "no" as false and 1e27 as an integer."""
    assert old in VALID
    path = _write(tmp_path, VALID.replace(old, new))
    errors = _errors(path)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}: {expected}"), errors


def test_the_environment_still_spells_numbers_and_booleans_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment variable is text: "5" is an integer there, "false" a boolean."""
    monkeypatch.setenv("TRADING_AGENT_DAEMON__WATCHDOG", "false")
    monkeypatch.setenv("TRADING_AGENT_DAEMON__RESTART_BACKOFF_SECONDS", "2.5")
    monkeypatch.setenv("TRADING_AGENT_DAEMON__SPEND__MAX_TOKENS_PER_DAY", "50000")
    monkeypatch.setenv("TRADING_AGENT_DESKS__ALPHA__MAXIMUM_ROUNDS", "5")
    monkeypatch.setenv("TRADING_AGENT_DESKS__ALPHA__CONTROLS__HALT_AFTER_FAILED_TURNS", "2")
    monkeypatch.setenv("TRADING_AGENT_MODEL__CONTEXT_WINDOW", "64000")
    # The environment wins over a value of the wrong type in the file.
    path = _write(tmp_path, VALID.replace("maximum_rounds = 3", "maximum_rounds = true"))
    monkeypatch.setenv("TRADING_AGENT_DESKS__BETA__MAXIMUM_ROUNDS", "7")
    settings = load_settings(path)
    assert settings.daemon.watchdog is False
    assert settings.daemon.restart_backoff_seconds == 2.5
    assert settings.daemon.spend.max_tokens_per_day == 50000
    assert settings.desks["alpha"].maximum_rounds == 5
    assert settings.desks["beta"].maximum_rounds == 7
    assert settings.desks["alpha"].controls.halt_after_failed_turns == 2
    assert settings.desks["alpha"].model.context_window == 64000
    # Still refused there: what is not an integer, and what is out of bounds.
    monkeypatch.setenv("TRADING_AGENT_DESKS__ALPHA__MAXIMUM_ROUNDS", "true")
    monkeypatch.setenv("TRADING_AGENT_MODEL__CONTEXT_WINDOW", "100000000")
    errors = _errors(path)
    assert [line.split(": ")[:2] for line in errors] == [
        ["environment variable TRADING_AGENT_MODEL__CONTEXT_WINDOW", "model.context_window"],
        ["environment variable TRADING_AGENT_DESKS__ALPHA__MAXIMUM_ROUNDS",
         "desks.alpha.maximum_rounds"]], errors


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('timezone = "Europe/Paris"', 'timezone = "Mars/Olympus"',
         "desks.alpha.timezone: 'Mars/Olympus' is not an IANA time zone name"),
        ('{ every = "15m" }', '{ every = "15 minutes" }',
         "desks.alpha.triggers.schedules[0].every: '15 minutes' is not an interval"),
        ('{ every = "15m" }', '{ message = "nothing" }',
         "desks.alpha.triggers.schedules[0]: a schedule needs exactly one of every"),
        ('{ every = "15m" }', '{ every = "15m", name = "half-hourly" }',
         "desks.alpha.triggers: two schedules are named 'half-hourly'"),
        ('on_candle_close = ["1h"]', 'on_candle_close = ["1y"]',
         "desks.alpha.triggers.ticks.on_candle_close: unknown timeframe '1y'"),
        ("[desks.beta", "[desks.Beta", "desks.Beta: bad desk name 'Beta'"),
        ('provider = "openai"', 'provider = "mistral"',
         "model.provider: unknown kind (got 'mistral'; allowed: 'openai', 'anthropic', "
         "'local')"),
        ('log_level = "debug"', 'log_level = "loud"',
         "daemon.log_level: Input should be 'debug', 'info', 'warning' or 'error' (got 'loud'"),
        ('symbols = ["BTC/USDT"]\ntimezone', 'symbols = ["ETH/USDT"]\ntimezone',
         "desks.alpha: no replayed candles for ETH/USDT"),
        ('[exchange.paper]', '[exchange]\nmode = "live"\n[exchange.paper]',
         "exchange: live mode needs an [exchange.ccxt] section"),
    ],
)
def test_each_mistake_is_reported_at_its_place(tmp_path: Path, old: str, new: str,
                                               expected: str) -> None:
    assert old in VALID
    path = _write(tmp_path, VALID.replace(old, new))
    errors = _errors(path)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{path}: {expected}"), errors


def test_the_shutdown_timeout_leaves_the_daemon_time_to_exit_within_10_s(
        tmp_path: Path) -> None:
    path = _write(tmp_path, VALID.replace('log_level = "debug"',
                                          'log_level = "debug"\nshutdown_timeout_seconds = 30'))
    assert _one_error(path).startswith(
        f"{path}: daemon.shutdown_timeout_seconds: at most 8 seconds: on SIGTERM the daemon "
        "must exit within 10 s")
    path = _write(tmp_path, VALID.replace('log_level = "debug"',
                                          'log_level = "debug"\nshutdown_timeout_seconds = 8'))
    assert load_settings(path).daemon.shutdown_timeout_seconds == 8


def test_the_queue_has_no_size_to_set(tmp_path: Path) -> None:
    """Schedules and operator messages are never dropped, so no queue limit is offered."""
    path = _write(tmp_path, VALID.replace('ticks = { move_percent',
                                          'maximum_queued = 10\nticks = { move_percent'))
    assert _one_error(path).startswith(
        f"{path}: desks.alpha.triggers.maximum_queued: unknown key")


def test_images_kept_per_request_are_between_1_and_16(tmp_path: Path) -> None:
    def images(keep: int) -> str:
        return VALID + f"\n[desks.alpha.images]\nkeep = {keep}\n"

    assert load_settings(_write(tmp_path, images(2))).desks["alpha"].images.keep == 2
    for keep in (0, 17):
        path = _write(tmp_path, images(keep))
        assert _one_error(path).startswith(f"{path}: desks.alpha.images.keep: ")


def test_context_settings_reach_the_compressor(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID + """
[desks.alpha.context]
keep_recent_tokens = 6000
summary_max_tokens = 1000
tool_result_max_tokens = 2000
flush_max_rounds = 5
""")
    compressor = compressor_for(load_settings(path).desks["alpha"].context, 32000)
    assert (compressor.keep_recent_tokens, compressor.summary_max_tokens,
            compressor.tool_result_max_tokens, compressor.flush_max_rounds) == (
        6000, 1000, 2000, 5)


def test_context_settings_that_do_not_fit_the_window_are_caught_at_load_time(
        tmp_path: Path) -> None:
    path = _write(tmp_path, VALID + "\n[desks.beta.context]\nkeep_recent_tokens = 64000\n")
    assert _one_error(path) == (
        f"{path}: desks.beta.context: keep_recent_tokens (64000) plus a summary of at least "
        "64 tokens must be at most half the context window (128000 tokens), or a compaction "
        "could leave the conversation as full as it found it; lower "
        "context.keep_recent_tokens (now 64000), or use a model with a larger context_window "
        "(now 128000)")
    # A small window shrinks the summary instead of refusing the desk.
    path = _write(tmp_path, VALID.replace("context_window = 32000", "context_window = 3000"))
    settings = load_settings(path)
    compressor = compressor_for(settings.desks["alpha"].context, 3000)
    assert (compressor.keep_recent_tokens, compressor.summary_max_tokens) == (600, 900)
    # Too small for even the recent messages and a short summary: refused, saying why.
    path = _write(tmp_path, VALID.replace("context_window = 32000", "context_window = 3000")
                  + "\n[desks.alpha.context]\nkeep_recent_tokens = 1480\n")
    error = _one_error(path)
    assert error.startswith(f"{path}: desks.alpha.context: keep_recent_tokens (1480) plus a "
                            "summary of at least 64 tokens must be at most half")


def test_an_unknown_tool_is_refused_with_the_tools_a_desk_can_have(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID.replace("maximum_rounds = 3",
                                          'maximum_rounds = 3\ntools = ["get_ticker", "teleport"]'))
    assert _one_error(path) == (
        f"{path}: desks.beta.tools: unknown tool(s) teleport; allowed: "
        f"{', '.join(DESK_TOOL_NAMES)} (got ['get_ticker', 'teleport'])")
    assert {"place_order", "remember", "recall", "delegate"} <= set(DESK_TOOL_NAMES)
    path = _write(tmp_path, VALID.replace("maximum_rounds = 3",
                                          'maximum_rounds = 3\ntools = ["get_ticker", "recall"]'))
    assert load_settings(path).desks["beta"].tools == ["get_ticker", "recall"]


def test_a_secret_written_in_the_file_is_refused_and_not_repeated(tmp_path: Path) -> None:
    path = _write(tmp_path, VALID.replace('api_key_env = "TEST_MODEL_KEY"',
                                          'api_key = "sk-live-0123456789"'))
    error = _one_error(path)
    assert "sk-live" not in error
    assert error.startswith(f"{path}: model.api_key: unknown key (got <hidden>; did you mean "
                            "api_key_env? secrets never go in the file")


def test_every_problem_is_listed_once(tmp_path: Path) -> None:
    text = (VALID.replace("context_window = 32000", 'context_window = "big"')
            .replace("maximum_rounds = 3", "maximum_rounds = 0")
            .replace('timezone = "Europe/Paris"', 'timezone = "Nowhere"'))
    errors = _errors(_write(tmp_path, text))
    # The bad default model is reported once, at [model], not again for each desk.
    assert [line.split(": ")[1] for line in errors] == [
        "model.context_window", "desks.alpha.timezone", "desks.beta.maximum_rounds"]


def test_a_bad_environment_variable_is_named(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRADING_AGENT_DESKS__ALPHA__MAXIMUM_ROUNDS", "many")
    monkeypatch.setenv("TRADING_AGENT_DAEMON__LOG_LEVL", "debug")
    errors = _errors(_write(tmp_path, VALID))
    assert errors[0].startswith("environment variable TRADING_AGENT_DAEMON__LOG_LEVL: "
                                "daemon.log_levl: unknown key (got 'debug'; did you mean "
                                "log_level?")
    assert errors[1].startswith("environment variable TRADING_AGENT_DESKS__ALPHA__MAXIMUM_ROUNDS:"
                                " desks.alpha.maximum_rounds: Input should be a valid integer")


def test_no_desk_and_no_model_are_errors(tmp_path: Path) -> None:
    path = _write(tmp_path, "[daemon]\n")
    assert _one_error(path).startswith(f"{path}: desks: required key is missing")
    path = _write(tmp_path, '[desks.a]\nsystem_prompt = "p"\nsymbols = ["BTC/USDT"]\n')
    assert _one_error(path).startswith(
        f"{path}: desks.a.model: no model: add a top-level [model] table or a [desks.a.model]")


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_settings(tmp_path / "missing.toml")


# --- the command line ------------------------------------------------------------------------


def test_check_config_prints_ok_and_exits_0(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, VALID)
    assert cli.main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 2 desks (alpha, beta)")
    assert "alpha: paper on replay, BTC/USDT; model openai:small" in out
    assert "warning: " in out and "TEST_MODEL_KEY is not set" in out


def test_check_config_lists_the_errors_and_exits_2(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, VALID.replace("maximum_rounds = 3", "maximum_round = 3"))
    assert cli.main(["check-config", str(path)]) == cli.EXIT_CONFIG
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{path}: desks.beta.maximum_round: unknown key" in captured.err


class _Started(list[Settings]):
    """The settings ``run`` started the daemon with, and the config files it named."""

    paths: list[Path | None]


@pytest.fixture
def fake_daemon(monkeypatch: pytest.MonkeyPatch) -> _Started:
    """Stands in for the daemon's process module: records what ``run`` would start."""
    started = _Started()
    started.paths = []

    async def run_daemon(settings: Settings, *, config_path: Path | None = None) -> None:
        started.append(settings)
        started.paths.append(config_path)

    module: Any = types.ModuleType("trading_agent.app.running")
    module.run_daemon = run_daemon
    monkeypatch.setitem(sys.modules, "trading_agent.app.running", module)
    monkeypatch.setattr(cli, "configure_logging", lambda *args, **kwargs: None)
    return started


def test_run_refuses_a_bad_config_and_starts_nothing(
        tmp_path: Path, fake_daemon: list[Settings], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_MODEL_KEY", "sk-1")
    bad = _write(tmp_path, VALID.replace('cron = "*/30 * * * *"', 'cron = "every day"'))
    assert cli.main(["run", "--config", str(bad)]) == cli.EXIT_CONFIG
    assert "refusing to start" in capsys.readouterr().err
    assert fake_daemon == []


def test_run_refuses_a_missing_secret(tmp_path: Path, fake_daemon: list[Settings],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--config", str(_write(tmp_path, VALID))]) == cli.EXIT_CONFIG
    assert "TEST_MODEL_KEY is not set" in capsys.readouterr().err
    assert fake_daemon == []


def test_run_starts_the_daemon_with_the_settings(tmp_path: Path, fake_daemon: _Started,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_MODEL_KEY", "sk-1")
    config = _write(tmp_path, VALID)
    assert cli.main(["run", "--config", str(config)]) == 0
    [settings] = fake_daemon
    assert list(settings.desks) == ["alpha", "beta"]
    # The file is read again on reload (SIGHUP).
    assert fake_daemon.paths == [config]
