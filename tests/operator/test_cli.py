"""``trading-agent desks`` and ``events`` as a user runs them, and their errors."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import anyio
import pytest

from tests.operator.harness import build_control, running_api
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.client import OperatorClient, OperatorClientError
from trading_agent.operator.config import OperatorConfig

CLI = [sys.executable, "-m", "trading_agent.cli"]


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("TRADING_AGENT_SOCKET", "STATE_DIRECTORY")}
    environment.update({"NO_COLOR": "1", **(env or {})})
    with anyio.fail_after(20):
        result = await anyio.run_process([*CLI, *args], check=False, env=environment)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_desks_prints_a_table(scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Done."))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _):
        await control.send_message("alpha", "hello")
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        code, out, err = await _cli("desks", "--socket", str(endpoints.socket_path))
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split()[:4] == ["DESK", "STATE", "MODE", "MODEL"]
        alpha = next(line for line in lines if line.startswith("alpha"))
        assert "idle" in alpha and "paper" in alpha and "10,000.00" in alpha
        assert "ago" in alpha and "never" in next(x for x in lines if x.startswith("beta"))
        code, out, _ = await _cli("desks", "--json", env={
            "TRADING_AGENT_SOCKET": str(endpoints.socket_path)})
        assert code == 0 and [d["name"] for d in json.loads(out)] == ["alpha", "beta"]


async def test_events_prints_readable_lines_and_json(scripted_server: ScriptedServer,
                                                     state_dir: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("get_price", {"symbol": "ETH/USDT"})]),
                        Reply("ETH is quiet.", text_chunks=3))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _):
        await control.send_message("beta", "ETH?")
        with anyio.fail_after(5):
            await control.wait_turns("beta", 1)
        socket = str(endpoints.socket_path)
        code, out, err = await _cli("events", "--socket", socket, "--desk", "beta")
        assert code == 0, err
        assert "beta ▶ turn (operator): ETH?" in out
        assert "→ get_price symbol=\"ETH/USDT\"" in out
        assert "← get_price" in out and "ETH/USDT last 64000" in out
        assert "beta › ETH is quiet.\n" in out
        assert "■ turn end: 2 round(s)" in out
        code, out, _ = await _cli("events", "--socket", socket, "--json", "--after", "0")
        rows = [json.loads(line) for line in out.splitlines()]
        assert rows[0]["type"] == "turn_start" and rows[-1]["type"] == "turn_end"
        assert [r["id"] for r in rows] == sorted({r["id"] for r in rows})
        code, out, err = await _cli("events", "--socket", socket, "--desk", "gamma")
        assert code == 1 and "no desk named 'gamma'" in err and "HTTP 404" in err


async def test_events_follow_streams_until_interrupted(scripted_server: ScriptedServer,
                                                       state_dir: Path) -> None:
    scripted_server.add(Reply("live text", text_chunks=2))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _):
        process = await anyio.open_process(
            [*CLI, "events", "--follow", "--json", "--socket", str(endpoints.socket_path)],
            env={**os.environ, "NO_COLOR": "1"})
        try:
            assert process.stdout is not None and process.stderr is not None
            # It starts "from now": the turn begins once it says it follows.
            said = b""
            with anyio.fail_after(15):
                async for chunk in process.stderr:
                    said += chunk
                    if b"following the event stream (Ctrl-C stops)\n" in said:
                        break
            await control.send_message("alpha", "go")
            seen = b""
            with anyio.fail_after(10):
                async for chunk in process.stdout:
                    seen += chunk
                    if b'"type":"turn_end"' in seen:
                        break
        finally:
            process.terminate()
            await process.wait()
    types = [json.loads(line)["type"] for line in seen.decode().splitlines()]
    assert types[0] == "turn_start" and "text_delta" in types and types[-1] == "turn_end"


async def test_a_daemon_that_is_not_running_is_named(state_dir: Path) -> None:
    socket = state_dir / "operator.sock"
    code, out, err = await _cli("desks", "--socket", str(socket))
    assert code == 1 and out == ""
    assert f"No daemon is listening on {socket}" in err
    assert "trading-agent run --config" in err
    socket.touch()  # a leftover file nobody listens on
    code, _, err = await _cli("chat", "alpha", "--socket", str(socket))
    assert code == 1 and f"No daemon is listening on {socket}" in err


async def test_the_default_socket_is_in_the_state_directory(state_dir: Path) -> None:
    code, _, err = await _cli("desks", env={"STATE_DIRECTORY": str(state_dir)})
    assert code == 1 and str(state_dir / "operator.sock") in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root opens any socket: no permission error")
async def test_a_socket_of_another_user_says_permission_denied(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _):
        os.chmod(endpoints.socket_path, 0o000)
        code, _, err = await _cli("desks", "--socket", str(endpoints.socket_path))
    assert code == 1 and "Permission denied" in err


async def test_url_without_a_token_is_refused() -> None:
    code, _, err = await _cli("desks", "--url", "http://127.0.0.1:9", env={
        "TRADING_AGENT_OPERATOR_TOKEN": ""})
    assert code == 2 and "TRADING_AGENT_OPERATOR_TOKEN" in err


async def test_an_inaccessible_socket_is_named_as_such(state_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Root opens any socket, so the test stands in the access check the client makes when
    # a connection fails; as another user the real check gives the same message.
    socket_path = state_dir / "operator.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(socket_path))
    stale.close()
    monkeypatch.setattr("trading_agent.operator.client.os.access", lambda path, mode: False)
    with pytest.raises(OperatorClientError, match=r"Permission denied on .*run this command as "
                                                  r"that user"):
        async with OperatorClient(socket_path=socket_path) as client:
            await client.health()
