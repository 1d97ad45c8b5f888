"""The TCP API under abuse, each case found by trying it as an attacker would.

- A page on another site, holding a token leaked from an event-stream URL, sends a form
  (``text/plain`` can spell a JSON object) to approve an order: it used to be approved.
- ``?token=`` opened every route; then only the event stream, which cannot send headers;
  now none (the stream takes a short-lived ticket instead).
- Connections that never finish their headers used to hold a descriptor each for ever;
  300 of them under a limit of 256 took the Unix socket down too and logged "Too many open
  files" some 8,000 times a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from tests.daemon.process import short_dir, write_config
from tests.operator.harness import build_control, collect_events, running_api, uds_client
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, ToolCall
from tests.waiting import wait_until
from trading_agent.operator import server
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.client import OperatorClient, OperatorClientError
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.server import OperatorEndpoints, tcp_connection_limit

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "correct-horse-battery-staple-42"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENVIRON = {"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}
ORDER = {"symbol": "BTC/USDT", "side": "buy", "amount": 0.5, "price": 64000}
EVIL = "https://evil.example"
PARTIAL_HEADERS = b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: unfinished


def _tcp_config() -> OperatorConfig:
    return OperatorConfig(tcp_address="127.0.0.1:0")


def _origin(endpoints: OperatorEndpoints) -> str:
    assert endpoints.url is not None
    return endpoints.url.rstrip("/")


async def _wait_pending(book: ApprovalBook) -> str:
    with anyio.fail_after(5):
        while not book.pending():  # noqa: ASYNC110 (the desk's turn fills it)
            await anyio.sleep(0.01)
    [approval] = book.pending()
    return approval.id


# --------------------------------------------------------------------------- cross-site POSTs


async def test_a_cross_site_form_with_a_leaked_token_approves_nothing(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", ORDER)]), Reply("Bought."))
    book = ApprovalBook(timeout_seconds=30, is_live=lambda desk: True)
    control, gate = build_control(scripted_server.base_url, approvals=book)
    async with running_api(control, book, _tcp_config(), state_dir,
                           environ=ENVIRON) as (endpoints, _), \
            httpx.AsyncClient(base_url=endpoints.url or "", timeout=5) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Buy."}, headers=AUTH)
        approval_id = await _wait_pending(book)
        approve = f"/api/approvals/{approval_id}/approve"
        # What <form enctype="text/plain" action="...?token=..."> sends: a JSON-looking body.
        spelled = b'{"operator":"mallory","reason":"="}'
        attempts: list[tuple[dict[str, str], dict[str, str], bytes, int, str]] = [
            # (query, headers, body, status, code)
            ({"token": TOKEN}, {"Content-Type": "text/plain", "Origin": EVIL}, spelled,
             401, "unauthorized"),
            ({"token": TOKEN}, {"Content-Type": "application/x-www-form-urlencoded"},
             b"operator=mallory", 401, "unauthorized"),
            ({"token": TOKEN}, {"Content-Type": "application/json"}, spelled,
             401, "unauthorized"),
            ({}, {**AUTH, "Content-Type": "text/plain"}, spelled, 415,
             "unsupported_media_type"),
            ({}, {**AUTH, "Content-Type": "application/x-www-form-urlencoded"},
             b"operator=mallory", 415, "unsupported_media_type"),
            ({}, {**AUTH, "Content-Type": "multipart/form-data; boundary=x"},
             b"--x--", 415, "unsupported_media_type"),
            ({}, AUTH, spelled, 415, "unsupported_media_type"),  # a body of no stated type
            ({}, {**AUTH, "Content-Type": "application/json", "Origin": EVIL}, spelled,
             403, "cross_origin"),
            ({}, {**AUTH, "Content-Type": "application/json", "Origin": "null"}, spelled,
             403, "cross_origin"),
        ]
        for query, headers, body, status, code in attempts:
            response = await client.post(approve, params=query, headers=headers, content=body)
            assert (response.status_code, response.json()["error"]["code"]) == (status, code), (
                query, headers, response.text)
        refusal = await client.post(approve, params={"token": TOKEN}, content=spelled,
                                    headers={"Content-Type": "text/plain"})
        assert "a token never goes in a URL" in refusal.json()["error"]["message"]
        assert [a.id for a in book.pending()] == [approval_id]  # still waiting
        assert gate.orders == []
        # The web page's own request: JSON, the bearer header, its own origin.
        response = await client.post(approve, json={"operator": "alice"},
                                     headers={**AUTH, "Origin": _origin(endpoints)})
        assert response.status_code == 200, response.text
        # The name is the token's (the single token: an owner named owner), not the body's.
        assert response.json()["approval"]["operator"] == "owner"
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
    assert gate.orders == [{"symbol": "BTC/USDT", "side": "buy", "amount": 0.5,
                            "price": 64000.0}]
    scripted_server.assert_complete()


async def test_a_token_in_a_url_opens_nothing_and_the_stream_takes_a_ticket(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Noted."))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _tcp_config(), state_dir,
                           environ=ENVIRON) as (endpoints, _), \
            httpx.AsyncClient(base_url=endpoints.url or "", timeout=5) as client:
        for path in ("/api/desks", "/api/health", "/api/approvals", "/api/desks/alpha",
                     "/api/events"):
            response = await client.get(path, params={"token": TOKEN, "follow": 0})
            assert response.status_code == 401, path
            assert "a token never goes in a URL" in response.json()["error"]["message"]
        sent = await client.post("/api/desks/alpha/messages", json={"text": "hello"},
                                 headers=AUTH)
        assert sent.status_code == 202
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        # An EventSource cannot send headers: the stream takes a ticket in its URL.
        ticket = (await client.post("/api/stream-ticket", headers=AUTH)).json()["ticket"]
        events = await collect_events(client, params={"ticket": ticket, "after": 0},
                                      until=lambda es: es[-1].type == "turn_end")
        assert events[0].type == "turn_start" and events[-1].type == "turn_end"
        wrong = await client.get("/api/events", params={"ticket": ticket[:-1], "follow": 0})
        assert wrong.status_code == 401
    scripted_server.assert_complete()


async def test_a_post_without_a_body_needs_no_type_and_the_unix_socket_is_unchanged(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _tcp_config(), state_dir,
                           environ=ENVIRON) as (endpoints, _):
        async with httpx.AsyncClient(base_url=endpoints.url or "", timeout=5) as client:
            # /compact as the web page and the CLI send it: no body, no Content-Type.
            compact = await client.post("/api/desks/alpha/compact",
                                        headers={**AUTH, "Origin": _origin(endpoints)})
            assert compact.status_code == 200, compact.text
            assert compact.json() == {"desk": "alpha", "compacted": False}
            foreign = await client.post("/api/desks/alpha/compact",
                                        headers={**AUTH, "Origin": EVIL})
            assert foreign.status_code == 403
            # The origin's default port may be left out by one side.
            same = await client.post("/api/desks/alpha/compact",
                                     headers={**AUTH, "Host": "example.test:80",
                                              "Origin": "http://example.test"})
            assert same.status_code == 200, same.text
        # The Unix socket, out of a browser's reach, keeps taking what it took.
        async with uds_client(endpoints.socket_path) as local:
            response = await local.post("/api/desks/alpha/compact", content=b"{}")
            assert response.status_code == 200, response.text
    assert control.sent == []


# --------------------------------------------------------------------------- connections


@contextlib.asynccontextmanager
async def _open_streams(port: int, count: int) -> AsyncIterator[list[anyio.abc.SocketStream]]:
    streams: list[anyio.abc.SocketStream] = []
    try:
        for _ in range(count):
            stream = await anyio.connect_tcp("127.0.0.1", port)
            streams.append(stream)
            await stream.send(PARTIAL_HEADERS)
        yield streams
    finally:
        for stream in streams:
            await stream.aclose()


async def _read_until_closed(stream: anyio.abc.SocketStream) -> bytes:
    received = b""
    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError,
                             ConnectionResetError):
        while True:
            received += await stream.receive()
    return received


async def test_unfinished_headers_get_a_408_and_the_connection_closes(
        scripted_server: ScriptedServer, state_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "HEADER_TIMEOUT_SECONDS", 0.5)
    scripted_server.add(Reply("Here."))
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _tcp_config(), state_dir,
                           environ=ENVIRON) as (endpoints, _):
        assert endpoints.tcp is not None
        host, port = endpoints.tcp
        async with httpx.AsyncClient(base_url=endpoints.url or "", timeout=5) as client:
            # A stream outlives the timeout: its headers came.
            async with client.stream("GET", "/api/events",
                                     params={"token": TOKEN}) as stream:
                lines = stream.aiter_lines()
                async with _open_streams(port, 1) as [idle]:
                    started = time.monotonic()
                    with anyio.fail_after(5):
                        answer = await _read_until_closed(idle)
                    waited = time.monotonic() - started
                assert answer.startswith(b"HTTP/1.1 408 "), answer
                assert b'"code":"request_timeout"' in answer
                assert 0.3 < waited < 3
                sent = await client.post("/api/desks/alpha/messages", headers=AUTH,
                                         json={"text": "still there?"})
                assert sent.status_code == 202
                with anyio.fail_after(5):
                    async for line in lines:
                        if "turn_start" in line:
                            break
                    await control.wait_turns("alpha", 1)
            # Between requests on a kept-alive connection, the same rule.
            reused = await anyio.connect_tcp(host, port)
            async with reused:
                await reused.send(b"GET /api/desks HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n")
                first = await reused.receive()
                assert first.startswith(b"HTTP/1.1 200 "), first
                await reused.send(PARTIAL_HEADERS)
                with anyio.fail_after(5):
                    rest = await _read_until_closed(reused)
                assert b"HTTP/1.1 408 " in rest
    scripted_server.assert_complete()


async def test_beyond_the_connection_limit_a_503_and_the_unix_socket_still_answers(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    limit = tcp_connection_limit()
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), _tcp_config(), state_dir,
                           environ=ENVIRON) as (endpoints, _):
        assert endpoints.tcp is not None
        port = endpoints.tcp[1]
        async with _open_streams(port, limit) as idle:
            async with httpx.AsyncClient(base_url=endpoints.url or "", timeout=5) as client:
                refused = await client.get("/api/health", headers=AUTH)
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "too_many_connections"
                assert f"{limit} connections" in refused.json()["error"]["message"]
            async with uds_client(endpoints.socket_path) as local:
                assert (await local.get("/api/health")).status_code == 200
            await idle.pop().aclose()
            with anyio.fail_after(5):
                while True:
                    async with httpx.AsyncClient(base_url=endpoints.url or "",
                                                 timeout=5) as client:
                        response = await client.get("/api/health", headers=AUTH)
                    if response.status_code == 200:
                        break
                    await anyio.sleep(0.02)


# --------------------------------------------------------------------------- the real daemon


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def _start_daemon(config: Path, log: Path, descriptors: int) -> subprocess.Popen[bytes]:
    """``trading-agent run`` under a lowered descriptor limit (set, then exec'd into)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("TRADING_AGENT_")
           and key not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "STATE_DIRECTORY")}
    env.update(ENVIRON)
    env["PYTHONPATH"] = str(ROOT / "src")
    limited = ("import os, resource, sys; "
               f"resource.setrlimit(resource.RLIMIT_NOFILE, ({descriptors}, {descriptors})); "
               "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    with log.open("wb") as output:
        return subprocess.Popen(
            [sys.executable, "-c", limited, "-m", "trading_agent.cli", "run",
             "--config", str(config)],
            cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)


async def _uds_health(socket_path: Path) -> str:
    """``ok``, or why the Unix socket did not answer."""
    try:
        async with OperatorClient(socket_path=socket_path, timeout=2) as client:
            return str((await client.health())["status"])
    except OperatorClientError as exc:
        return str(exc)


def _records(log: Path) -> list[dict[str, Any]]:
    records = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


async def _refused_answer(port: int) -> httpx.Response | None:
    """A new TCP connection's answer, or None when the daemon reset it at once (it does while
    sixteen refused connections still wait for their clients to read the 503)."""
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=3) as client:
            return await client.get("/api/health", headers=AUTH)
    except httpx.TransportError:
        return None


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _tcp_port(log: Path) -> int | None:
    for record in _records(log):
        if record.get("event") == "operator_api_listening" and record.get("tcp"):
            return int(str(record["tcp"]).rstrip("/").rsplit(":", 1)[1])
    return None


@pytest.mark.slow
async def test_300_idle_connections_under_256_descriptors_leave_the_unix_socket_up(
        scripted_server: ScriptedServer, folder: Path) -> None:
    def noted(request: RecordedRequest) -> Reply:
        return Reply("Noted.")

    scripted_server.responder = noted
    config = write_config(folder, scripted_server.base_url,
                          operator={"tcp_address": "127.0.0.1:0"})
    log = folder / "daemon.log"
    process = _start_daemon(config, log, descriptors=256)
    socket_path = folder / "state" / "operator.sock"
    attackers: list[socket.socket] = []
    try:
        with anyio.fail_after(30):
            while (port := _tcp_port(log)) is None or await _uds_health(socket_path) != "ok":
                assert process.poll() is None, log.read_text(errors="replace")[-4000:]
                await anyio.sleep(0.05)
        lines_before = len(log.read_text(errors="replace").splitlines())
        for _ in range(300):
            attacker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            attacker.setblocking(False)
            attacker.connect_ex(("127.0.0.1", port))
            attackers.append(attacker)
        # The listener's queue is short: the kernel holds back most of the 300 handshakes and
        # the attackers' kernels retry them for seconds. Each sends its partial headers once
        # its connection is up.
        pending = list(attackers)

        def send_partial_headers() -> bool:
            for attacker in list(pending):
                try:
                    attacker.send(PARTIAL_HEADERS)
                except (BlockingIOError, InterruptedError):
                    continue  # still connecting
                except OSError:
                    pass  # refused: reset by the daemon
                pending.remove(attacker)
            return not pending

        await wait_until(send_partial_headers, "every attacker connected or refused", within=30,
                         step=0.05)
        answers = [await _uds_health(socket_path) for _ in range(3)]
        refused = await wait_until(lambda: _refused_answer(port), "a 503 for a new connection",
                                   within=30, step=0.1)
        assert process.poll() is None, log.read_text(errors="replace")[-4000:]
        await wait_until(lambda: _descriptors(process.pid) < 200,
                         "the daemon's descriptors below 200", within=15)
        assert process.poll() is None, log.read_text(errors="replace")[-4000:]
        descriptors = _descriptors(process.pid)
        text = log.read_text(errors="replace")
        new_lines = text.splitlines()[lines_before:]
    finally:
        for attacker in attackers:
            attacker.close()
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
    assert answers == ["ok", "ok", "ok"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == (
        "too_many_connections")
    assert descriptors < 200, f"{descriptors} descriptors open of 256"
    assert "Too many open files" not in text
    assert "out of system resource" not in text
    assert len(new_lines) < 100, "\n".join(new_lines[:40])  # before: some 8,000 a second
    # Warned of once (again only if the limit is reached anew after the timeouts freed it).
    limits = [r["limit"] for r in _records(log)
              if r.get("event") == "operator_api_connection_limit"]
    assert limits and set(limits) == {64} and len(limits) <= 3, limits
