"""The TCP listener: only with a token from the environment, and every /api request needs it."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import httpx
import pytest

from tests.operator.harness import build_control, running_api
from tests.scripted_server import ScriptedServer
from trading_agent.errors import ConfigError
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.server import read_token, serve_operator_api

TOKEN = "correct-horse-battery-staple-42"


async def test_refuses_to_listen_on_tcp_without_a_token(scripted_server: ScriptedServer,
                                                        state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0", token_env="TEST_OPERATOR_TOKEN")
    for environ in ({}, {"TEST_OPERATOR_TOKEN": "  "}, {"TEST_OPERATOR_TOKEN": "short"}):
        with pytest.raises(ConfigError, match="TEST_OPERATOR_TOKEN"):
            await serve_operator_api(control, ApprovalBook(), config, state_dir=state_dir,
                                     environ=environ)
    assert not (state_dir / "operator.sock").exists()  # nothing was left listening


def test_the_token_is_read_from_the_named_variable() -> None:
    config = OperatorConfig(tcp_address="127.0.0.1:8765", token_env="MY_TOKEN")
    assert read_token(config, {"MY_TOKEN": f" {TOKEN}\n"}) == TOKEN


@pytest.mark.parametrize("address", ["localhost:80", "127.0.0.1", "127.0.0.1:99999", ":80"])
def test_a_bad_tcp_address_is_a_config_error(address: str) -> None:
    with pytest.raises(ValueError, match=r"host:port|port must|IP address"):
        OperatorConfig(tcp_address=address)


def test_unknown_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="extra"):
        OperatorConfig.model_validate({"tcp_adress": "127.0.0.1:1"})


async def test_every_api_request_needs_the_bearer_token(scripted_server: ScriptedServer,
                                                        state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0")
    environ = {"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ=environ) as (endpoints, _):
        assert endpoints.tcp is not None and endpoints.tcp[1] > 0
        assert endpoints.url is not None
        async with httpx.AsyncClient(base_url=endpoints.url, timeout=5) as client:
            for headers, params in [
                ({}, {}),
                ({"Authorization": "Bearer wrong"}, {}),
                ({"Authorization": f"Bearer {TOKEN}x"}, {}),
                ({"Authorization": f"Basic {TOKEN}"}, {}),
                ({}, {"token": TOKEN[:-1]}),
            ]:
                response = await client.get("/api/desks", headers=headers, params=params)
                assert response.status_code == 401, (headers, params)
                assert response.json()["error"]["code"] == "unauthorized"
                assert response.headers["www-authenticate"].startswith("Bearer")
            refused = await client.post("/api/desks/alpha/messages", json={"text": "buy"},
                                        headers={"Authorization": "Bearer nope"})
            assert refused.status_code == 401
            unknown = await client.get("/api/desks/nope")  # 401 first: no desk enumeration
            assert unknown.status_code == 401
            ok = await client.get("/api/desks", headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200 and len(ok.json()["desks"]) == 2
            for path in ("/api/health", "/api/events"):  # a token in a URL opens nothing
                query = await client.get(path, params={"token": TOKEN})
                assert query.status_code == 401
            ticket = (await client.post("/api/stream-ticket", headers={
                "Authorization": f"Bearer {TOKEN}"})).json()["ticket"]
            async with client.stream("GET", "/api/events",
                                     params={"ticket": ticket, "follow": "0"}) as stream:
                assert stream.status_code == 200
                assert stream.headers["content-type"].startswith("text/event-stream")
            page = await client.get("/")  # the page holds no secret; its API calls do need it
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            assert "default-src 'self'" in page.headers["content-security-policy"]
            script = await client.get("/static/app.js")
            assert script.status_code == 200
    assert control.sent == []
    assert json.dumps(config.model_dump(mode="json")).find(TOKEN) == -1


async def test_answers_on_a_reused_connection_are_not_held_back(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    # Without TCP_NODELAY, Nagle's algorithm and the client's delayed ACK held each answer
    # on a kept-alive connection for about 40 ms (1 ms on a fresh one).
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0")
    environ = {"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ=environ) as (endpoints, _), \
            httpx.AsyncClient(base_url=endpoints.url or "", timeout=5,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        first = await client.get("/api/desks")
        connection = first.extensions["network_stream"]
        seconds = []
        for _ in range(20):
            started = time.perf_counter()
            response = await client.get("/api/desks")
            seconds.append(time.perf_counter() - started)
            assert response.status_code == 200
            assert response.extensions["network_stream"] is connection  # one connection
    assert statistics.median(seconds) < 0.020, [f"{s * 1000:.1f} ms" for s in seconds]
