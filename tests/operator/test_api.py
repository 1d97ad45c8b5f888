"""The operator API over its real Unix socket, against real AgentLoops and the scripted model."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import anyio
import pytest

from tests.operator.harness import build_control, collect_events, running_api, uds_client
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.errors import ConfigError
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.server import serve_operator_api


def _config(**overrides: object) -> OperatorConfig:
    return OperatorConfig.model_validate({"approval_timeout_seconds": 5, **overrides})


async def test_lists_desks_with_their_status(scripted_server: ScriptedServer,
                                             state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        response = await client.get("/api/desks")
        assert response.status_code == 200
        desks = response.json()["desks"]
        assert [d["name"] for d in desks] == ["alpha", "beta"]
        assert {d["state"] for d in desks} == {"idle"}
        assert desks[0]["equity"] == 10_000.0
        assert desks[0]["model"] == "scripted-model"
        one = (await client.get("/api/desks/beta")).json()
        assert one["name"] == "beta" and one["pending_approvals"] == 0
        health = (await client.get("/api/health")).json()
        assert health["status"] == "ok" and health["desks"] == ["alpha", "beta"]


async def test_socket_is_private_and_removed_on_stop(scripted_server: ScriptedServer,
                                                     state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _):
        assert endpoints.socket_path == state_dir / "operator.sock"
        mode = os.stat(endpoints.socket_path).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o600
    assert not endpoints.socket_path.exists()


async def test_a_stale_socket_is_replaced_and_a_live_one_refused(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(state_dir / "operator.sock"))
    stale.close()  # the file stays, nobody listens: what a killed daemon leaves
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _):
        async with uds_client(endpoints.socket_path) as client:
            assert (await client.get("/api/health")).status_code == 200
        other, _ = build_control(scripted_server.base_url)
        with pytest.raises(ConfigError, match="already running"):
            await serve_operator_api(other, ApprovalBook(), _config(), state_dir=state_dir)
        async with uds_client(endpoints.socket_path) as client:  # the first one still serves
            assert (await client.get("/api/health")).status_code == 200


async def test_a_message_starts_a_turn_and_the_answer_streams(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("BTC looks calm today.", text_chunks=4))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        response = await client.post("/api/desks/alpha/messages",
                                     json={"text": "How is BTC?"})
        assert response.status_code == 202
        body = response.json()
        assert body["desk"] == "alpha" and body["delivery"] == "turn" and body["id"]
        events = await collect_events(client, params={"desk": "alpha", "after": 0},
                                      until=lambda es: es[-1].type == "turn_end")
    deltas = [e.data["text"] for e in events if e.type == "text_delta"]
    assert "".join(deltas) == "BTC looks calm today."
    assert len(deltas) == 4
    assert events[-1].data["final_text"] == "BTC looks calm today."
    sent = scripted_server.requests[0].messages
    assert sent[-1]["content"] == f"[Message from {OS_USER}, a human operator]\nHow is BTC?"
    scripted_server.assert_complete()


async def test_steering_mid_turn_reaches_the_model_after_the_tool_round(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(
        Reply(tool_calls=[ToolCall("wait_for_release", {"label": "slow"})]),
        Reply("Understood: I will not buy."),
    )
    control, gate = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Look at BTC."})
        with anyio.fail_after(5):
            await gate.entered.wait()  # the turn is inside its first tool round
        response = await client.post("/api/desks/alpha/messages",
                                     json={"text": "Do not buy anything."})
        assert response.status_code == 202
        assert response.json()["delivery"] == "steering"
        assert len(scripted_server.requests) == 1  # nothing reached the model yet
        gate.release.set()
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        events = await collect_events(client, params={"desk": "alpha", "after": 0},
                                      until=lambda es: es[-1].type == "turn_end")
    second = scripted_server.requests[1].messages
    # After the tool's result, before the model's next answer: the operator's words.
    assert second[-2]["role"] == "tool"
    assert second[-1]["role"] == "user"
    assert second[-1]["content"].endswith("sent while you were working]\nDo not buy anything.")
    assert OS_USER in second[-1]["content"]
    kinds = [e.type for e in events]
    assert kinds.index("tool_result") < kinds.index("steering_delivered") < kinds.index(
        "turn_end")
    delivered = next(e for e in events if e.type == "steering_delivered")
    assert delivered.data["after_round"] == 1
    assert control.desks["alpha"].turns == ["Understood: I will not buy."]
    scripted_server.assert_complete()


async def test_compact_flushes_memory_and_compacts(scripted_server: ScriptedServer,
                                                   state_dir: Path) -> None:
    scripted_server.add(
        Reply("First answer, with enough words to be worth summarizing later on."),
        Reply("Second answer, again with some words that the summary will replace."),
        Reply(tool_calls=[ToolCall("remember", {"note": "watching BTC"})]),  # memory flush
        Reply("NO_REPLY"),
        Reply("## Goal\n- watch BTC\n## Positions and open orders\n- none"),  # the summary
        Reply("Third answer."),
    )
    control, gate = build_control(scripted_server.base_url, keep_recent_tokens=20)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        for number, text in enumerate(["one", "two"], start=1):
            await client.post("/api/desks/alpha/messages", json={"text": f"Message {text}"})
            with anyio.fail_after(5):
                await control.wait_turns("alpha", number)
        response = await client.post("/api/desks/alpha/compact")
        assert response.status_code == 200
        assert response.json() == {"desk": "alpha", "compacted": True}
        await client.post("/api/desks/alpha/messages", json={"text": "Message three"})
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 3)
        events = await collect_events(client, params={"desk": "alpha", "after": 0},
                                      until=lambda es: es[-1].data.get("final_text")
                                      == "Third answer.")
    ended = next(e for e in events if e.type == "compaction_end")
    assert ended.data["reason"] == "command" and ended.data["messages_summarized"] > 0
    assert ended.data["trigger_kind"] == "command" and "compact" in ended.data["trigger_text"]
    assert ended.data["messages_after"] < ended.data["messages_before"]
    flush = next(e for e in events if e.type == "memory_flush")
    assert flush.data["tool_calls"] == 1
    assert gate.memories == ["watching BTC"]
    after = scripted_server.requests[5].messages
    assert after[1]["content"].startswith("[Summary of the earlier conversation")
    assert "watch BTC" in after[1]["content"]
    assert all("Message one" not in str(m.get("content")) for m in after)
    scripted_server.assert_complete()


async def test_compact_with_nothing_to_compact_says_so(scripted_server: ScriptedServer,
                                                       state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        response = await client.post("/api/desks/beta/compact")
    assert response.status_code == 200 and response.json()["compacted"] is False
    assert scripted_server.requests == []


async def test_transcript_pages_back(scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("one"), Reply("two"))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        for number in (1, 2):
            await client.post("/api/desks/alpha/messages", json={"text": f"m{number}"})
            with anyio.fail_after(5):
                await control.wait_turns("alpha", number)
        newest = (await client.get("/api/desks/alpha/transcript",
                                   params={"limit": 2})).json()["messages"]
        older = (await client.get("/api/desks/alpha/transcript",
                                  params={"limit": 2, "before": newest[0]["seq"]})).json()
    assert [m["text"] for m in newest] == [f"[Message from {OS_USER}, a human operator]\nm2",
                                           "two"]
    assert [m["text"] for m in older["messages"]] == [
        f"[Message from {OS_USER}, a human operator]\nm1", "one"]


BAD_REQUESTS = [
    # (method, path, body/content, status, code)
    ("POST", "/api/desks/nope/messages", {"text": "hi"}, 404, "unknown_desk"),
    ("GET", "/api/desks/nope", None, 404, "unknown_desk"),
    ("POST", "/api/desks/nope/compact", None, 404, "unknown_desk"),
    ("GET", "/api/desks/nope/transcript", None, 404, "unknown_desk"),
    ("GET", "/api/events?desk=nope", None, 404, "unknown_desk"),
    ("GET", "/api/approvals?desk=nope", None, 404, "unknown_desk"),
    ("POST", "/api/desks/alpha/messages", {"text": ""}, 400, "empty_message"),
    ("POST", "/api/desks/alpha/messages", {"text": "  \n\t "}, 400, "empty_message"),
    ("POST", "/api/desks/alpha/messages", {"text": "x" * 201}, 400, "message_too_long"),
    ("POST", "/api/desks/alpha/messages", b"x" * 7000, 400, "body_too_large"),
    ("POST", "/api/desks/alpha/messages", b'{"text": "unterminated', 400, "malformed_json"),
    ("POST", "/api/desks/alpha/messages", b"\xff\xfe", 400, "malformed_json"),
    ("POST", "/api/desks/alpha/messages", b'["a list"]', 400, "invalid_body"),
    ("POST", "/api/desks/alpha/messages", b"", 400, "invalid_body"),
    ("POST", "/api/desks/alpha/messages", {"text": 42}, 400, "invalid_body"),
    ("POST", "/api/desks/alpha/messages", {"text": "hi", "urgent": True}, 400, "invalid_body"),
    ("POST", "/api/desks/alpha/messages", {"text": "hi", "source": "a\nb"}, 400,
     "invalid_body"),
    ("GET", "/api/desks/alpha/transcript?limit=0", None, 400, "invalid_parameter"),
    ("GET", "/api/desks/alpha/transcript?before=abc", None, 400, "invalid_parameter"),
    ("GET", "/api/events?after=-1", None, 400, "invalid_parameter"),
    ("GET", "/api/events?follow=maybe", None, 400, "invalid_parameter"),
    ("POST", "/api/desks/alpha/messages", b"[" * 5000, 400, "malformed_json"),
    ("POST", "/api/desks/alpha/messages", b'{"text": "hi \\ud800"}', 400, "invalid_text"),
    ("POST", "/api/desks/alpha/messages", b'{"text": "\\udc00 \\ud83d"}', 400,
     "invalid_text"),
    ("GET", "/api/desks/alpha/transcript?before=99999999999999999999999", None, 400,
     "invalid_parameter"),
    ("GET", f"/api/desks/alpha/transcript?before={2**63}", None, 400, "invalid_parameter"),
    ("GET", "/api/events?after=99999999999999999999999&follow=0", None, 400,
     "invalid_parameter"),
    ("GET", "/api/events?tail=99999999999999999999999", None, 400, "invalid_parameter"),
    ("POST", "/api/approvals/feedbeef/approve", {}, 404, "unknown_approval"),
    ("POST", "/api/approvals/feedbeef/deny", {}, 404, "unknown_approval"),
    ("GET", "/api/nothing-here", None, 404, "not_found"),
    ("DELETE", "/api/desks/alpha", None, 405, "method_not_allowed"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "code"), BAD_REQUESTS,
                         ids=[f"{m} {p} {c}" for m, p, _, _, c in BAD_REQUESTS])
async def test_bad_input_is_refused_and_changes_nothing(
        scripted_server: ScriptedServer, state_dir: Path, method: str, path: str,
        body: object, status: int, code: str) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = _config(max_message_chars=200)
    async with running_api(control, ApprovalBook(), config, state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        if isinstance(body, bytes):
            response = await client.request(method, path, content=body,
                                            headers={"Content-Type": "application/json"})
        elif body is None:
            response = await client.request(method, path)
        else:
            response = await client.request(method, path, json=body)
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["status"] == status and error["code"] == code and error["message"]
        desks = (await client.get("/api/desks")).json()["desks"]
    assert control.sent == []
    assert all(d["state"] == "idle" and d["last_turn_at"] is None for d in desks)
    assert all(not d.conversation.messages for d in control.desks.values())
    assert scripted_server.requests == []


@pytest.mark.parametrize("value", ["99999999999999999999999", str(2**63), "-1", "1e3"])
async def test_an_out_of_range_last_event_id_is_refused_before_the_stream(
        scripted_server: ScriptedServer, state_dir: Path, value: str) -> None:
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        response = await client.get("/api/events", params={"follow": "0"},
                                    headers={"Last-Event-ID": value})
        assert response.status_code == 400, response.text
        assert response.headers["content-type"] == "application/json"
        assert response.json()["error"]["code"] == "invalid_parameter"
        # The largest id there can be is fine.
        response = await client.get("/api/events", params={"follow": "0"},
                                    headers={"Last-Event-ID": str(2**63 - 1)})
        assert response.status_code == 200


async def test_an_unexpected_error_is_a_json_500(scripted_server: ScriptedServer,
                                                 state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)

    async def broken(desk: str, *, before: int | None = None,
                     limit: int = 50) -> list[dict[str, object]]:
        raise RuntimeError("a bug")

    control.transcript = broken  # type: ignore[method-assign]
    async with running_api(control, ApprovalBook(), _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        response = await client.get("/api/desks/alpha/transcript")
        assert response.status_code == 500
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["status"] == 500 and error["code"] == "internal_error"
        assert "a bug" not in error["message"]  # no internals to the client
        assert (await client.get("/api/health")).status_code == 200


async def test_a_message_at_the_length_limit_is_accepted(scripted_server: ScriptedServer,
                                                         state_dir: Path) -> None:
    scripted_server.add(Reply("ok"))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _config(max_message_chars=200),
                           state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        # 200 characters, each an emoji escaped as two \uXXXX (12 bytes): still accepted.
        body = json.dumps({"text": "😀" * 200}, ensure_ascii=True)
        response = await client.post("/api/desks/alpha/messages", content=body)
        assert response.status_code == 202, response.text
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
    scripted_server.assert_complete()


async def test_equity_samples_for_the_chart(scripted_server: ScriptedServer,
                                            state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = _config(equity_sample_seconds=0.05)
    async with running_api(control, ApprovalBook(), config, state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        control.desks["alpha"].equity = 10_250.0
        with anyio.fail_after(5):
            while True:
                points = (await client.get("/api/desks/alpha/equity")).json()["points"]
                if points and points[-1][1] == 10_250.0:
                    break
                await anyio.sleep(0.02)
    assert points[0][1] in (10_000.0, 10_250.0)
    assert all(len(p) == 2 for p in points)
