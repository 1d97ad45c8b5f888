"""The test harness itself: the scripted server speaks HTTP as promised, and the network guard
refuses everything beyond loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from tests.conftest import NetworkBlockedError, NetworkGuard
from tests.scripted_server import (
    RawJSON,
    RawSSE,
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    calls_then_answer,
    rate_limited,
)

CHAT = "/chat/completions"


@pytest.fixture
async def client(scripted_server: ScriptedServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=scripted_server.base_url, timeout=5) as client:
        yield client


def _data_lines(body: str) -> list[str]:
    return [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]


async def test_a_streamed_reply_is_sse_ending_in_done(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("Hello", text_chunks=2, usage=(10, 2)))

    response = await client.post(CHAT, json={
        "model": "m", "messages": [], "stream": True,
        "stream_options": {"include_usage": True}})

    assert response.headers["content-type"] == "text/event-stream"
    data = _data_lines(response.text)
    assert data[-1] == "[DONE]"
    assert '"content": "Hel"' in data[1] and '"content": "lo"' in data[2]
    assert '"finish_reason": "stop"' in data[3]
    assert '"prompt_tokens": 10' in data[4]
    scripted_server.assert_complete()


async def test_usage_is_streamed_only_when_asked_for(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("Hi"))

    response = await client.post(CHAT, json={"model": "m", "messages": [], "stream": True})

    assert not [d for d in _data_lines(response.text) if "usage" in d]


async def test_a_non_streamed_reply_is_one_completion(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("Buying.", tool_calls=[ToolCall("buy", {"qty": 1}, id="c1")]))

    response = await client.post(CHAT, json={"model": "m", "messages": []})

    body = response.json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Buying."
    assert choice["message"]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "buy", "arguments": '{"qty": 1}'}}]
    assert body["usage"]["completion_tokens"] > 0


async def test_requests_are_recorded_with_body_and_headers(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("a"), Reply("b"))

    for text in ("first", "second"):
        await client.post(CHAT, json={"model": "m", "messages": [
            {"role": "user", "content": text}]}, headers={"X-Trace": text})

    first, second = scripted_server.requests
    assert [m["content"] for r in (first, second) for m in r.messages] == ["first", "second"]
    assert second.headers["x-trace"] == "second"
    assert first.received_at <= second.received_at
    assert scripted_server.connections == 1  # one keep-alive connection served both


async def test_models_are_listed_without_using_a_step(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    response = await client.get("/models")

    assert response.json()["data"][0]["id"] == scripted_server.model
    assert scripted_server.requests == []
    assert len(scripted_server.other_requests) == 1
    scripted_server.assert_complete()


async def test_faults_and_raw_replays_are_sent_verbatim(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    captured = 'data: {"choices":[]}\n\n: a comment\n\ndata: [DONE]\n\n'
    scripted_server.add(rate_limited(retry_after=3), RawJSON(418, "teapot", {"X-A": "b"}),
                        RawSSE(captured, chunk_delay=0.001))

    limited = await client.post(CHAT, json={})
    teapot = await client.post(CHAT, json={})
    replayed = await client.post(CHAT, json={})

    assert (limited.status_code, limited.headers["retry-after"]) == (429, "3")
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert (teapot.status_code, teapot.text, teapot.headers["x-a"]) == (418, "teapot", "b")
    assert replayed.text == captured


async def test_a_responder_answers_once_the_script_has_run_out(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    def count_messages(request: RecordedRequest) -> Step:
        return Reply(f"{len(request.messages)} messages")

    scripted_server.add(Reply("scripted"))
    scripted_server.responder = count_messages

    texts = []
    for count in range(3):
        response = await client.post(CHAT, json={"messages": [{}] * count})
        texts.append(response.json()["choices"][0]["message"]["content"])

    assert texts == ["scripted", "1 messages", "2 messages"]
    scripted_server.assert_complete()


async def test_calls_then_answer_follows_the_conversation(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    scripted_server.responder = calls_then_answer("get_ticker", 2, "BTC is up.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]

    for _ in range(3):
        response = await client.post(CHAT, json={"messages": messages})
        message = response.json()["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "1"})

    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool",
                                             "assistant"]
    assert messages[-1]["content"] == "BTC is up."


async def test_assert_complete_reports_unused_steps_and_unexpected_requests(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("never asked for"))
    with pytest.raises(AssertionError, match="1 scripted step"):
        scripted_server.assert_complete()

    await client.post(CHAT, json={})
    refused = await client.post(CHAT, json={})

    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "script_exhausted"
    with pytest.raises(AssertionError, match="after the script ran out"):
        scripted_server.assert_complete()
    scripted_server.unexpected.clear()  # so the fixture's teardown stays quiet


async def test_a_held_reply_waits_for_the_test(
        client: httpx.AsyncClient, scripted_server: ScriptedServer) -> None:
    release = threading.Event()
    scripted_server.add(Reply("released", hold_until=release))
    answers: list[str] = []

    async def ask() -> None:
        response = await client.post(CHAT, json={})
        answers.append(response.json()["choices"][0]["message"]["content"])

    async with anyio.create_task_group() as group:
        group.start_soon(ask)
        with anyio.fail_after(5):
            await scripted_server.wait_for_requests(1)
        await anyio.sleep(0.05)
        assert answers == []
        release.set()

    assert answers == ["released"]


def test_the_server_stops_with_a_connection_still_waiting() -> None:
    server = ScriptedServer([Reply("never sent", delay=30)]).start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 2\r\n\r\n{}")
        deadline = time.monotonic() + 5
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.002)
        server.stop()
        assert sock.recv(100) == b""  # closed, not answered
    assert len(server.requests) == 1


def test_the_network_guard_refuses_everything_but_loopback(
        monkeypatch: pytest.MonkeyPatch, scripted_server: ScriptedServer) -> None:
    guard = NetworkGuard().install(monkeypatch)  # over the autouse one, to inspect it

    with pytest.raises(NetworkBlockedError):
        socket.getaddrinfo("api.openai.com", 443)
    with socket.socket() as sock, pytest.raises(NetworkBlockedError):
        sock.connect(("192.0.2.1", 80))  # TEST-NET-1: never routed
    with socket.create_connection(("127.0.0.1", scripted_server.port), timeout=5):
        pass
    with socket.create_connection(("localhost", scripted_server.port), timeout=5):
        pass

    assert guard.attempts == ["look up 'api.openai.com'", "connect to ('192.0.2.1', 80)"]

