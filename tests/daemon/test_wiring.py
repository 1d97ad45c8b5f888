"""Building the daemon from a config file: desks, their tools, services and shared parts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon_config import write_daemon_config
from tests.scripted_server import ScriptedServer
from trading_agent.agent.events import ErrorEvent
from trading_agent.app.services import _STORE_BUFFER, open_daemon
from trading_agent.backtest.cache import ResponseCache
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings


def _config(folder: Path, base_url: str) -> Path:
    return write_daemon_config(folder, base_url, model={"request_timeout": None}, desks={
        "alpha": {"system_prompt": "You are alpha.", "timezone": "Europe/Paris",
                  "triggers": {"ticks": {"move_percent": 0.5, "on_candle_close": ["1h"]},
                               "schedules": [{"cron": "0 9 * * mon-fri",
                                              "message": "Morning review."}]}},
        "beta": {"system_prompt": "You are beta.",
                 "tools": ["get_ticker", "remember", "delegate"], "maximum_rounds": 4}})


async def test_each_desk_gets_its_parts_and_desks_on_one_model_share_its_backend(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, scripted_server.base_url))

    async with open_daemon(settings) as daemon:
        supervisor = daemon.supervisor
        alpha, beta = supervisor.runtimes

        assert list(supervisor.desk_names()) == ["alpha", "beta"]
        assert [name for name, _ in alpha.services] == ["market", "schedules"]
        assert [name for name, _ in beta.services] == ["market"]
        assert [name for name, _ in supervisor.services] == ["replay 1 (BTC/USDT)", "spend caps"]
        # Each paper desk keeps its own answers for a replay (backtest --from-desk), through
        # the one model client they share.
        alpha_model = alpha.desk.loop.backend.inner  # type: ignore[attr-defined]
        beta_model = beta.desk.loop.backend.inner  # type: ignore[attr-defined]
        assert isinstance(alpha_model, ResponseCache) and isinstance(beta_model, ResponseCache)
        assert alpha_model.path != beta_model.path
        assert alpha_model.backend is beta_model.backend
        # The desk's checks still read the client's extras (its tokenizer) through them.
        counts = alpha.desk.loop.backend.count_tokens  # type: ignore[attr-defined]
        assert counts == alpha_model.backend.count_tokens
        assert [d["function"]["name"] for d in beta.desk.loop.tool_definitions()] == [
            "get_ticker", "remember", "delegate"]
        alpha_tools = {d["function"]["name"] for d in alpha.desk.loop.tool_definitions()}
        assert {"place_order", "get_candles", "recall", "delegate"} <= alpha_tools
        assert alpha.desk.system_prompt == "You are alpha."
        status = await supervisor.desk_status("alpha")
        assert (status.mode, status.model, status.state) == ("paper", "scripted-model", "idle")
        assert status.equity is not None and status.open_orders == 0
    assert (tmp_path / "state" / "trading-agent.sqlite3").exists()


async def test_an_unknown_tool_name_is_a_config_error(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, scripted_server.base_url))
    # Past the check at load time (tests/test_settings.py): the wiring refuses it too.
    settings.desks["beta"].tools = ["teleport"]

    with pytest.raises(ConfigError, match=r"desks\.beta\.tools: unknown tool\(s\) teleport"):
        async with open_daemon(settings):
            pass


async def test_event_ids_after_a_kill_never_repeat_ids_a_stream_may_have_sent(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, scripted_server.base_url))
    async with open_daemon(settings) as daemon:
        # The API streams every event as it is published; the store writes in batches and
        # is behind. Killed now: the store holds 10 of the 60 events an operator has seen.
        sent = [daemon.event_bus.publish(
            ErrorEvent(desk="alpha", message=str(n), error_type="E")) for n in range(60)]
        await daemon.store.events.append_events(sent[:10])
    async with open_daemon(settings) as daemon:
        assert await daemon.store.events.last_event_id() == sent[9].id
        first = daemon.event_bus.publish(ErrorEvent(desk="alpha", message="new", error_type="E"))
    assert first.id > sent[-1].id
    # Past whatever the store's subscription could hold and a batch being written.
    assert first.id > sent[9].id + _STORE_BUFFER + 500
