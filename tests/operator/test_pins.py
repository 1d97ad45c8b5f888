"""Standing instructions: an operator pins an instruction to a desk, and every request of
that desk sends it verbatim, through a compaction and a restart, until it is unpinned.
Against the real daemon (its API on a Unix socket) and the scripted model server."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.harness import (
    build_control,
    collect_events,
    in_process_daemon,
    running_api,
    uds_client,
)
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.cli import main
from trading_agent.daemon.pins import PIN_BLOCK_END, PIN_BLOCK_START
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.cli import _Chat
from trading_agent.operator.client import OperatorClient
from trading_agent.operator.config import OperatorConfig

_RULE = "Never hold more than 0.1 BTC; say 'rule noted' when you open a position."

_DESK = {"tools": ["get_ticker"],  # no memory tool: a compaction is one summary request
         "context": {"keep_recent_tokens": 40}}


def _system(server: ScriptedServer, request: int) -> str:
    first = server.requests[request].messages[0]
    assert first["role"] == "system"
    return str(first["content"])


async def _ask(client: Any, text: str) -> str:
    response = await client.post("/api/desks/alpha/messages",
                                 json={"text": text, "wait": True,
                                       "timeout": 10})
    assert response.status_code == 200, response.text
    return str(response.json()["reply"]["text"])


async def test_a_pin_is_in_every_request_through_a_compaction_and_a_restart_until_unpinned(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(
        Reply("First answer, with enough words in it to be worth summarizing later on."),
        Reply("Second answer, again with words that the summary is going to replace."),
        Reply("## Goal\n- hold BTC small"),  # the summary
        Reply("Third answer."),
        Reply("Fourth answer."),
        Reply("Fifth answer."))
    config = write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks={"alpha": _DESK})

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        response = await client.post("/api/desks/alpha/pins",
                                     json={"text": f"  {_RULE}\n"})
        assert response.status_code == 201, response.text
        pin = response.json()["pin"]
        assert (pin["text"], pin["by"], pin["desk"]) == (_RULE, OS_USER, "alpha")
        await _ask(client, "Message one")
        assert f"{PIN_BLOCK_START}\n[1] {_RULE}\n" in _system(scripted_server, 0)
        assert _system(scripted_server, 0).startswith("You are the trading desk alpha.")
        await _ask(client, "Message two")
        compacted = await client.post("/api/desks/alpha/compact")
        assert compacted.json()["compacted"] is True, compacted.text
        assert await _ask(client, "Message three") == "Third answer."
        after = scripted_server.requests[3].messages
        assert str(after[1]["content"]).startswith("[Summary of the earlier conversation")
        assert not any("Message one" in str(m.get("content")) for m in after)
        assert _RULE in _system(scripted_server, 3)  # the summary did not take it
        events = await collect_events(client, params={"desk": "alpha", "after": 0},
                                      until=lambda es: any(e.type == "pins_changed"
                                                           for e in es))
        changed = next(e for e in events if e.type == "pins_changed")
        assert changed.data["action"] == "pinned" and changed.data["by"] == OS_USER
        assert _RULE in changed.data["text"]

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        listed = (await client.get("/api/desks/alpha/pins")).json()
        assert [(p["id"], p["by"], p["text"]) for p in listed["pins"]] == [
            (pin["id"], OS_USER, _RULE)]
        assert listed["pins"][0]["at"] == pin["at"]
        await _ask(client, "Message four")
        assert _RULE in _system(scripted_server, 4)
        removed = await client.request("DELETE", f"/api/desks/alpha/pins/{pin['id']}",
                                       json={})
        assert removed.status_code == 200, removed.text
        assert removed.json()["pins"] == []
        await _ask(client, "Message five")
        assert _RULE not in _system(scripted_server, 5)
        assert PIN_BLOCK_START not in _system(scripted_server, 5)
        assert _system(scripted_server, 5) == "You are the trading desk alpha."
    scripted_server.assert_complete()


async def test_bad_pins_are_refused_with_what_is_wrong(scripted_server: ScriptedServer,
                                                       tmp_path: Path) -> None:
    config = write_daemon_config(
        tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS,
        model={"context_window": 2048, "max_output_tokens": 512},
        desks={"alpha": {**_DESK, "context": {"keep_recent_tokens": 200,
                                              "summary_max_tokens": 200}}})

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        async def refused(method: str, path: str, body: Any, status: int, code: str) -> str:
            response = await client.request(method, path, json=body)
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["code"] == code, error
            return str(error["message"])

        assert "empty" in await refused("POST", "/api/desks/alpha/pins", {"text": " \n"},
                                        400, "invalid_pin")
        assert "at most 4,000" in await refused("POST", "/api/desks/alpha/pins",
                                                {"text": "x" * 4001}, 400, "invalid_pin")
        assert "desks: alpha" in await refused("POST", "/api/desks/gamma/pins",
                                               {"text": "Hold."}, 404, "unknown_desk")
        assert "desks: alpha" in await refused("GET", "/api/desks/gamma/pins", None, 404,
                                               "unknown_desk")
        first = await client.post("/api/desks/alpha/pins", json={"text": "y " * 1900})
        assert first.status_code == 201, first.text
        pin_id = first.json()["pin"]["id"]
        message = await refused("POST", "/api/desks/alpha/pins", {"text": "z " * 1900}, 400,
                                "pin_too_large")
        assert "the instruction is 1,268 tokens" in message, message
        assert "more than the model's context window (2,048)" in message, message
        assert "512 for the answer need 3,275 tokens" in message
        assert f"its pins: {pin_id}" in await refused(
            "DELETE", f"/api/desks/alpha/pins/{pin_id + 7}", {}, 404, "unknown_pin")
        await refused("DELETE", "/api/desks/alpha/pins/first", {}, 400, "invalid_parameter")
        listed = (await client.get("/api/desks/alpha/pins")).json()["pins"]
        assert [p["id"] for p in listed] == [pin_id]  # nothing refused was kept


async def test_pin_pins_and_unpin_from_the_chat_and_the_command_line(
        scripted_server: ScriptedServer, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks={"alpha": {**_DESK, "pinned": ["Trade only BTC."]},
                                        "beta": _DESK})

    async with in_process_daemon(config) as running, \
            OperatorClient(socket_path=running.endpoints.socket_path) as client, \
            anyio.create_task_group() as group:
        socket = ["--socket", str(running.endpoints.socket_path)]

        async def cli(*args: str) -> tuple[int, str, str]:
            code = await anyio.to_thread.run_sync(main, [*args, *socket])
            out, err = capsys.readouterr()
            return code, out, err

        out = io.StringIO()
        chat = _Chat(client, "alpha", OS_USER, out)
        await chat.handle(f"/pin {_RULE}", group)
        await chat.handle("/pin", group)
        await chat.handle("/pins", group)
        said = out.getvalue()
        assert "Pinned #1: it is in every request from the next." in said
        assert "Usage: /pin TEXT" in said
        assert f"#1 by {OS_USER} at " in said and f"UTC: {_RULE}" in said

        code, printed, _ = await cli("pin", "alpha", "Close every position by Friday.")
        assert code == 0 and "Pinned #2 to alpha" in printed
        code, printed, _ = await cli("pins", "alpha", "--json")
        assert code == 0
        assert [(p["id"], p["by"]) for p in json.loads(printed)["pins"]] == [(1, OS_USER),
                                                                             (2, OS_USER)]
        code, printed, _ = await cli("unpin", "alpha", "1")
        assert code == 0 and "Unpinned #1 from alpha" in printed
        code, printed, _ = await cli("pins", "alpha")
        assert code == 0 and printed.startswith(f"#2 by {OS_USER} at ")
        assert printed.splitlines()[0].endswith("UTC: Close every position by Friday.")
        assert printed.splitlines()[1:] == ["(config) Trade only BTC."]
        code, _, err = await cli("unpin", "alpha", "1")
        assert code == 2 and "desk 'alpha' has no pin 1; its pins: 2" in err
        code, _, err = await cli("pin", "gamma", "Hold.")
        assert code == 2 and "no desk named 'gamma'" in err

        await chat.handle("/unpin 2", group)
        await chat.handle("/pins", group)
        assert "Unpinned #2." in out.getvalue()
        assert out.getvalue().rstrip().endswith("(config) Trade only BTC.")
        code, printed, _ = await cli("pins", "beta")
        assert (code, printed) == (0, "beta has no standing instructions.\n")
        group.cancel_scope.cancel()


async def test_a_pin_made_mid_turn_is_in_the_turns_next_request_and_outlives_a_reload(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    released = threading.Event()
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
              hold_until=released),
        Reply("Looked."),
        Reply("After the reload."))
    config = write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks={"alpha": _DESK})

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "How is BTC?"})
        with anyio.fail_after(10):
            await scripted_server.wait_for_requests(1)
        pinned = await client.post("/api/desks/alpha/pins", json={"text": _RULE})
        assert pinned.status_code == 201, pinned.text
        released.set()
        with anyio.fail_after(10):
            await scripted_server.wait_for_requests(2)
        assert _RULE not in _system(scripted_server, 0)
        assert _RULE in _system(scripted_server, 1)  # the same turn's next request

        write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS,
                            desks={"alpha": {**_DESK, "system_prompt": "You are alpha, v2."}})
        reloaded = await client.post("/api/reload", json={})
        assert reloaded.status_code == 200, reloaded.text
        assert await _ask(client, "And now?") == "After the reload."
    assert _system(scripted_server, 2) == f"You are alpha, v2.\n\n{PIN_BLOCK_START}\n" \
                                          f"[1] {_RULE}\n{PIN_BLOCK_END}"
    scripted_server.assert_complete()


async def test_a_control_that_keeps_no_pins_says_so_rather_than_failing(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    # A fleet's control keeps none yet: the test daemon's control stands in for it.
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), OperatorConfig(), tmp_path) as (
            endpoints, _), uds_client(endpoints.socket_path) as client:
        for method, path in (("GET", "/api/desks/alpha/pins"),
                             ("POST", "/api/desks/alpha/pins"),
                             ("DELETE", "/api/desks/alpha/pins/1")):
            response = await client.request(method, path, json={"text": "Hold."})
            assert response.status_code == 501, response.text
            assert response.json()["error"]["code"] == "not_supported"
            assert "fleet" in response.json()["error"]["message"]
