"""A desk whose model is ``provider = "anthropic"``: the daemon's wiring builds the native
backend, and a turn with a tool call runs through it to the scripted Anthropic server; its
thinking, kept in the store, goes back to the API when a restarted daemon resumes the tool
loop."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon.process import DaemonProcess, short_dir
from tests.daemon_config import write_daemon_config
from tests.operator.harness import in_process_daemon, uds_client
from tests.scripted_anthropic_server import Answer, AnthropicScriptedServer, unauthorized
from tests.scripted_server import Reply, ToolCall
from trading_agent.backends.providers.anthropic import AnthropicModelSettings
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings
from trading_agent.store.store import Store, database_path


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


async def test_a_tool_loop_cut_by_kill_9_resumes_with_its_signed_thinking() -> None:
    environ = {"DESK_ANTHROPIC_KEY": "sk-ant-test"}
    thought = "BTC barely moved; read the ticker before deciding."
    never = threading.Event()
    with AnthropicScriptedServer() as server, short_dir() as folder:
        server.add(
            Answer("Let me look.", thinking=thought, thinking_chunks=3, signature="sig-r1",
                   tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"}, id="toolu_r1")]),
            # The tool loop's next request: held, and the daemon killed while it waits.
            Reply("never sent", hold_until=never),
            Reply("BTC/USDT is quiet; no trade."))
        config = _config(folder, server.base_url,
                         {"max_output_tokens": 4096, "thinking_budget_tokens": 1024})
        daemon = DaemonProcess(config, environ)
        try:
            await daemon.wait_ready()
            async with daemon.client() as client:
                await client.send_message("alpha", "How is BTC?", "ann")
            await server.wait_for_requests(2)  # the tool ran; its result is stored
            daemon.kill()
        finally:
            daemon.close()
            never.set()

        # The thinking is in the state file, with the answer that called the tool.
        async with await Store.open(database_path(folder / "state")) as store:
            page = await store.transcripts.transcript("alpha")
            restored = await store.transcripts.restore_conversation("alpha", "x")
        call = next(m for m in restored.messages if m.tool_uses)
        assert [(b.text, b.signature) for b in call.content if b.type == "thinking"] == [
            (thought, "sig-r1")]
        assert all(b["type"] != "thinking" for row in page for b in row["content"])

        daemon = DaemonProcess(config, environ)
        try:
            await daemon.wait_ready()
            [*_, resumed] = await server.wait_for_requests(3)
            with anyio.fail_after(20):
                while True:
                    async with daemon.client() as client:
                        rows = await client.transcript("alpha")
                    if rows[-1]["text"] == "BTC/USDT is quiet; no trade.":
                        break
                    await anyio.sleep(0.05)
        finally:
            daemon.close()

    # The resumed loop sends the answer that called the tool with its thinking, signed,
    # first: the API would refuse a tool loop whose thinking went missing.
    assert resumed.json["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    answer = resumed.json["messages"][1]
    assert answer["role"] == "assistant"
    assert answer["content"][0] == {"type": "thinking", "thinking": thought,
                                    "signature": "sig-r1"}
    assert [block["type"] for block in answer["content"]] == ["thinking", "text", "tool_use"]
    tool_result = resumed.json["messages"][2]["content"][0]
    assert tool_result["type"] == "tool_result" and tool_result["tool_use_id"] == "toolu_r1"


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
