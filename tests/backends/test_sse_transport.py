"""The model call's transport: events split as a server sends them, connections reused."""

from __future__ import annotations

import anyio
import pytest

from tests.scripted_server import RawJSON, RawSSE, Reply, ScriptedServer, server_error, slow
from trading_agent.backends.sse_transport import (
    ConnectionFailed,
    HttpStatusError,
    RequestTimeout,
    ServerSentEvent,
    SSETransport,
    _EventDecoder,
    verified_ssl_context,
)


def _decode(*chunks: bytes) -> list[ServerSentEvent]:
    decoder = _EventDecoder()
    return [event for chunk in chunks for event in decoder.feed(chunk)]


def test_events_are_split_at_blank_lines_whatever_the_line_ends() -> None:
    assert _decode(b"data: a\n\ndata: b\r\n\r\ndata: c\r\rdata: d\n") == [
        ServerSentEvent(None, "a"), ServerSentEvent(None, "b"), ServerSentEvent(None, "c")]


def test_a_crlf_split_between_two_reads_is_one_line_end() -> None:
    assert _decode(b"data: a\r", b"\n\r", b"\ndata: b\r\n", b"\r\n") == [
        ServerSentEvent(None, "a"), ServerSentEvent(None, "b")]


def test_a_long_line_arriving_in_pieces_is_whole() -> None:
    text = "x" * 300_000
    encoded = f"data: {text}\n\n".encode()
    pieces = [encoded[i:i + 1000] for i in range(0, len(encoded), 1000)]

    assert _decode(*pieces) == [ServerSentEvent(None, text)]


def test_fields_comments_and_multi_line_data() -> None:
    events = _decode(b": ping\n\nevent: error\ndata: {\"a\":\ndata: 1}\nid: 7\n\n"
                     b"retry: 10\n\nunknown: x\n\n")

    assert events == [ServerSentEvent("error", '{"a":\n1}'), ServerSentEvent(None, "")]


def test_a_multibyte_character_split_between_reads_is_kept() -> None:
    encoded = "data: Ünïcode €\n\n".encode()

    assert _decode(encoded[:8], encoded[8:]) == [ServerSentEvent(None, "Ünïcode €")]


async def _events(transport: SSETransport) -> list[ServerSentEvent]:
    events = []
    async with await transport.post(b'{"stream": true}') as stream:
        while (event := await stream.next()) is not None:
            events.append(event)
    return events


async def test_answers_read_to_the_end_leave_one_connection_for_every_request(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(*[Reply(f"answer {n}") for n in range(5)])
    transport = SSETransport(scripted_server.base_url + "/chat/completions", {}, 5.0,
                             verified_ssl_context())
    try:
        for _ in range(5):
            assert (await _events(transport))[-1].data == "[DONE]"
    finally:
        await transport.aclose()

    assert scripted_server.connections == 1


async def test_concurrent_requests_each_get_a_connection_then_share_them(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(*[slow(0.2, Reply("x")) for _ in range(8)],
                        *[Reply("y") for _ in range(8)])
    transport = SSETransport(scripted_server.base_url + "/chat/completions", {}, 5.0,
                             verified_ssl_context())
    try:
        for _ in range(2):
            async with anyio.create_task_group() as group:
                for _ in range(8):
                    group.start_soon(_events, transport)
    finally:
        await transport.aclose()

    assert scripted_server.connections == 8


async def test_failures_come_back_as_the_transports_own_errors(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(server_error(503, "busy"), slow(2.0),
                        RawSSE('data: {"a": 1}\n\n', headers={"Content-Length": "999"}))
    transport = SSETransport(scripted_server.base_url + "/chat/completions", {}, 0.3,
                             verified_ssl_context())
    try:
        with pytest.raises(HttpStatusError) as status:
            await transport.post(b"{}")
        with pytest.raises(RequestTimeout):
            await transport.post(b"{}")
    finally:
        await transport.aclose()
    closed = SSETransport("http://127.0.0.1:9/v1/chat/completions", {}, 2.0, verified_ssl_context())
    try:
        with pytest.raises(ConnectionFailed):
            await closed.post(b"{}")
    finally:
        await closed.aclose()

    assert status.value.status == 503
    assert "busy" in status.value.text


async def test_a_proxy_named_by_the_environment_carries_the_requests(
        scripted_server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", scripted_server.base_url.removesuffix("/v1"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    scripted_server.add(Reply("through the proxy"))
    transport = SSETransport("http://model.invalid/v1/chat/completions", {}, 5.0,
                             verified_ssl_context())
    exempt = SSETransport("http://127.0.0.1:9/v1/chat/completions", {}, 2.0, verified_ssl_context())
    try:
        events = await _events(transport)
        with pytest.raises(ConnectionFailed):  # straight there, not through the proxy
            await exempt.post(b"{}")
    finally:
        await transport.aclose()
        await exempt.aclose()

    assert scripted_server.requests[0].path == "http://model.invalid/v1/chat/completions"
    assert "through the proxy" in "".join(event.data for event in events)


async def test_a_redirect_is_an_error_not_a_post_repeated_elsewhere(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(RawJSON(307, {"moved": True},
                                {"Location": scripted_server.base_url + "/elsewhere"}))
    transport = SSETransport(scripted_server.base_url + "/chat/completions", {}, 5.0,
                             verified_ssl_context())
    try:
        with pytest.raises(HttpStatusError) as caught:
            await transport.post(b"{}")
    finally:
        await transport.aclose()

    assert caught.value.status == 307
    assert len(scripted_server.requests) == 1 and not scripted_server.other_requests
