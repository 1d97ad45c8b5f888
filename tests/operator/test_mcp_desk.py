"""A desk with an MCP server in its config: the daemon lists the server's tools into the desk's
registry, runs the connection beside the desk, and the model's call reaches the server."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process

from tests.daemon_config import write_daemon_config
from tests.operator.harness import in_process_daemon, uds_client
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings

MCP_SERVER = Path(__file__).resolve().parents[1] / "mcp_server.py"


def _config(folder: Path, base_url: str, command: list[str]) -> Path:
    return write_daemon_config(folder, base_url, desks={"alpha": {"mcp_servers": [
        {"name": "calc", "command": command, "tools": ["add", "fail"]}]}})


async def test_a_desks_mcp_tools_are_offered_and_answer_the_model(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("calc__add", {"a": 2, "b": 40}),
                          ToolCall("calc__add", {"a": "two", "b": 1}),
                          ToolCall("calc__fail", {"reason": "no quotes today"})]),
        Reply("2 + 40 is 42."))
    config = _config(tmp_path, scripted_server.base_url,
                     [sys.executable, str(MCP_SERVER), "stdio"])

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        response = await client.post("/api/desks/alpha/messages", json={
            "text": "Add 2 and 40.", "source": "ann", "wait": True, "timeout": 20})

    assert response.status_code == 200, response.text
    assert response.json()["reply"]["text"] == "2 + 40 is 42."
    first, second = scripted_server.requests
    offered = {tool["function"]["name"] for tool in first.tools}
    assert {"calc__add", "calc__fail"} <= offered and "calc__echo" not in offered
    results = [m["content"] for m in second.messages if m["role"] == "tool"]
    assert results[0] == "42"
    assert "invalid arguments for calc__add" in results[1] and "two" in results[1]
    assert "no quotes today" in results[2]


async def test_a_server_that_cannot_start_names_the_desk_and_the_server(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    config = _config(tmp_path, scripted_server.base_url,
                     [str(tmp_path / "no-such-program"), "stdio"])

    with pytest.raises(ConfigError, match=r"desks\.alpha\.mcp_servers\[0\] \(calc\)"):
        async with in_process_daemon(config):
            pass


def test_two_servers_with_one_name_are_refused(tmp_path: Path) -> None:
    config = write_daemon_config(tmp_path, "http://127.0.0.1:9/v1", desks={"alpha": {
        "mcp_servers": [{"name": "calc", "command": ["x"], "tools": ["add", "fail"]},
                        {"name": "calc", "url": "http://127.0.0.1:9/mcp"}]}})

    with pytest.raises(ConfigError, match="two servers are named 'calc'"):
        load_settings(config)


async def _start_http_server(port: int, log: Path) -> Process:
    """The test MCP server over HTTP on ``port``; returns once it listens."""
    with log.open("wb") as errors:
        process = await anyio.open_process(
            [sys.executable, str(MCP_SERVER), "http", "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
    assert process.stdout is not None
    with anyio.fail_after(20):
        received = b""
        while not received.endswith(b"\n"):
            received += await process.stdout.receive()
    return process


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_server_down_at_start_stops_nothing_and_its_tools_come_when_it_does(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    port = _free_port()  # nothing listens there yet
    scripted_server.add(
        Reply("beta is here."),
        Reply(tool_calls=[ToolCall("calc__add", {"a": 2, "b": 40})]),
        Reply("The calculator is not there yet."),
        Reply(tool_calls=[ToolCall("calc__add", {"a": 2, "b": 40})]),
        Reply("2 + 40 is 42."))
    config = write_daemon_config(tmp_path, scripted_server.base_url, desks={
        "alpha": {"mcp_servers": [{"name": "calc", "url": f"http://127.0.0.1:{port}/mcp",
                                   "tools": ["add"], "connect_timeout": 5}]},
        "beta": {}})

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        # The desk without MCP answers; the one whose server is down starts too.
        beta = await client.post("/api/desks/beta/messages", json={
            "text": "Hello.", "source": "ann", "wait": True, "timeout": 20})
        assert beta.json()["reply"]["text"] == "beta is here.", beta.text
        early = await client.post("/api/desks/alpha/messages", json={
            "text": "Add 2 and 40.", "source": "ann", "wait": True, "timeout": 20})
        assert early.json()["reply"]["text"] == "The calculator is not there yet.", early.text
        [not_yet] = [m["content"] for m in scripted_server.requests[2].messages
                     if m["role"] == "tool"]
        assert "calc__add was not run: the MCP server 'calc' is not reachable yet" in not_yet
        assert "registered as soon as it answers" in not_yet

        server = await _start_http_server(port, tmp_path / "mcp-http.log")
        try:
            late = await client.post("/api/desks/alpha/messages", json={
                "text": "Add 2 and 40 again.", "source": "ann", "wait": True, "timeout": 20})
            assert late.json()["reply"]["text"] == "2 + 40 is 42.", late.text
            last = scripted_server.requests[-1]
            assert [m["content"] for m in last.messages if m["role"] == "tool"][-1] == "42"
            # The real tool is offered now, with the server's schema.
            [add] = [tool["function"] for tool in last.tools
                     if tool["function"]["name"] == "calc__add"]
            assert set(add["parameters"]["properties"]) == {"a", "b"}
        finally:
            server.terminate()
            await server.wait()
            await server.aclose()
