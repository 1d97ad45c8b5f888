"""A desk whose model is ``provider = "anthropic"``: the daemon's wiring builds the native
backend, and a turn with a tool call runs through it to the scripted Anthropic server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.daemon_config import write_daemon_config
from tests.operator.harness import in_process_daemon, uds_client
from tests.scripted_anthropic_server import AnthropicScriptedServer, unauthorized
from tests.scripted_server import Reply, ToolCall
from trading_agent.backends.providers.anthropic import AnthropicModelSettings
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings


def _config(folder: Path, base_url: str, model_extra: dict[str, Any] | None = None) -> Path:
    model: dict[str, Any] = {
        "provider": "anthropic", "model": "claude-test", "context_window": 200000,
        "request_timeout": None, "api_key_env": "DESK_ANTHROPIC_KEY",
        "price_input_per_million": 3.0, "price_output_per_million": 15.0,
        "price_cache_read_per_million": 0.3, **(model_extra or {})}
    return write_daemon_config(folder, base_url, daemon={"restart_backoff_seconds": 0.05},
                               model=model)


async def test_a_desk_on_the_anthropic_api_answers_an_operator_with_a_tool_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DESK_ANTHROPIC_KEY", "sk-ant-test")
    with AnthropicScriptedServer() as server:
        server.add(Reply("Let me look.", tool_calls=[ToolCall("get_ticker",
                                                             {"symbol": "BTC/USDT"})]),
                   Reply("BTC/USDT is quiet; no trade."))
        config = _config(tmp_path, server.base_url)
        settings = load_settings(config)
        assert isinstance(settings.desks["alpha"].model, AnthropicModelSettings)

        async with in_process_daemon(config, environ={"DESK_ANTHROPIC_KEY": "sk-ant-test"}) \
                as running, uds_client(running.endpoints.socket_path) as client:
            response = await client.post("/api/desks/alpha/messages", json={
                "text": "How is BTC?", "source": "ann", "wait": True, "timeout": 10})

        assert response.status_code == 200, response.text
        assert response.json()["reply"]["text"] == "BTC/USDT is quiet; no trade."
        first, second = server.requests
        assert first.path == "/v1/messages"
        assert first.headers["x-api-key"] == "sk-ant-test"
        assert first.json["model"] == "claude-test"
        assert "How is BTC?" in first.json["messages"][-1]["content"][0]["text"]
        tool_result = second.json["messages"][-1]["content"][0]
        assert tool_result["type"] == "tool_result"
        assert "BTC/USDT" in tool_result["content"]  # one text: the short string form
        server.assert_complete()


async def test_a_refused_key_names_its_variable_and_never_the_key(
        tmp_path: Path) -> None:
    with AnthropicScriptedServer() as server:
        server.add(unauthorized())
        config = _config(tmp_path, server.base_url)
        async with in_process_daemon(config, environ={"DESK_ANTHROPIC_KEY": "sk-ant-wrong"}) \
                as running, uds_client(running.endpoints.socket_path) as client:
            response = await client.post("/api/desks/alpha/messages", json={
                "text": "How is BTC?", "source": "ann", "wait": True, "timeout": 10})

    reply = response.json()["reply"]
    assert not reply["ok"]
    assert "DESK_ANTHROPIC_KEY" in reply["error"] and "sk-ant-wrong" not in reply["error"]


def test_a_bad_anthropic_setting_names_the_file_the_key_and_what_is_allowed(
        tmp_path: Path) -> None:
    config = _config(tmp_path, "http://127.0.0.1:9", model_extra={"thinking_budget_tokens": 10})

    with pytest.raises(ConfigError) as caught:
        load_settings(config)

    message = str(caught.value)
    assert str(config) in message and "thinking_budget_tokens" in message
    assert "1024" in message
