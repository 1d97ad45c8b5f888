"""MCP tools in a backtest: recorded answers replayed, any other call refused with its
reason, and no server ever started (the configured servers would leave a mark if run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.backtest.test_backtest_cli import backtest, write_config
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall


def news_reader(request: RecordedRequest) -> Step:
    """Reads the recorded headlines, then asks for unrecorded ones, then answers."""
    if not request.tools:
        return Reply("Summary: the desk read the news.")
    turn_start = max((i for i, m in enumerate(request.messages) if m.get("role") == "user"),
                     default=0)
    asked = sum(1 for m in request.messages[turn_start:] if m.get("role") == "assistant")
    if asked == 0:
        return Reply(tool_calls=[ToolCall("news__headlines", {"topic": "btc", "limit": 2})])
    if asked == 1:
        return Reply(tool_calls=[ToolCall("news__headlines", {"topic": "eth"})])
    return Reply("Read the news.")


def test_recorded_answers_are_replayed_others_refused_and_no_server_starts(
        tmp_path: Path) -> None:
    marker = tmp_path / "STARTED"
    started = f"open({str(marker)!r}, 'w')"
    servers = "".join(
        f'\n[[desks.hourly.mcp_servers]]\nname = "{name}"\n'
        f"command = {json.dumps([sys.executable, '-c', started])}\n"
        for name in ("news", "quotes"))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "hourly.mcp.jsonl").write_text("\n".join(json.dumps(line) for line in [
        {"server": "news", "tool": "headlines", "description": "Latest headlines on a topic",
         "parameters": {"type": "object", "properties": {"topic": {"type": "string"},
                                                         "limit": {"type": "integer"}},
                        "required": ["topic"]}},
        {"server": "news", "tool": "headlines", "arguments": {"limit": 2, "topic": "btc"},
         "result": "Bitcoin steady as markets wait for the Fed.", "is_error": False},
    ]) + "\n")
    with ScriptedServer(responder=news_reader) as server:
        config = write_config(tmp_path / "desk.toml", server, more=servers)
        assert backtest(config, tmp_path / "out", cache) == 0
        bodies = [json.loads(request.body) for request in server.requests]
    assert not marker.exists(), "an MCP server was started"
    offered = {tool["function"]["name"] for tool in bodies[0]["tools"]}
    assert "news__headlines" in offered and not any(n.startswith("quotes__") for n in offered)
    definition = next(t["function"] for t in bodies[0]["tools"]
                      if t["function"]["name"] == "news__headlines")
    assert definition["description"] == "Latest headlines on a topic (MCP server news)"
    assert definition["parameters"]["required"] == ["topic"]
    results = [m["content"] for body in bodies for m in body["messages"]
               if m.get("role") == "tool"]
    assert "Bitcoin steady as markets wait for the Fed." in results
    refused = [r for r in results if "was not run" in r]
    assert refused and "never starts or contacts the MCP server 'news'" in refused[0]
    assert "no answer to this call is recorded" in refused[0]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any("MCP server quotes" in notice for notice in report["notices"])
