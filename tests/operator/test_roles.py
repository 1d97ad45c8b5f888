"""Operators with names and roles on the API: each route needs a role, the name recorded is
the credential's, every action lands in the audit (store, API, CLI); the single token of
before is an owner; the event stream opens with a short-lived ticket; TLS on TCP."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.daemon_config import write_daemon_config
from tests.operator.command_line import run_cli
from tests.operator.harness import InProcessDaemon, build_control, in_process_daemon, running_api
from tests.scripted_server import ScriptedServer
from trading_agent.daemon.spend import SPEND_CAP
from trading_agent.errors import ConfigError
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import DEFAULT_TOKEN_ENV, OperatorConfig
from trading_agent.operator.identity import Operator, load_credentials
from trading_agent.operator.route_roles import ROUTE_ROLES
from trading_agent.operator.tickets import StreamTickets
from trading_agent.settings import load_settings

TOKENS = {"VIEWER_TOKEN": "viewer-token-0123456789abcdef",
          "TRADER_TOKEN": "trader-token-0123456789abcdef",
          "OWNER_TOKEN": "owner-token-0123456789abcdefgh",
          DEFAULT_TOKEN_ENV: "legacy-token-0123456789abcdef"}

OPERATORS = """
[[operator.operators]]
name = "vera"
role = "viewer"
token_env = "VIEWER_TOKEN"

[[operator.operators]]
name = "tina"
role = "trader"
token_env = "TRADER_TOKEN"
telegram_user_id = 4242

[[operator.operators]]
name = "olga"
role = "owner"
token_env = "OWNER_TOKEN"
"""


def _bearer(env: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[env]}"}


@asynccontextmanager
async def _daemon(folder: Path, model_url: str) -> AsyncIterator[tuple[InProcessDaemon, str]]:
    """The real daemon with three named operators and the single token of before, on TCP."""
    config = write_daemon_config(folder, model_url, desks=("alpha", "beta"),
                                 operator={"tcp_address": "127.0.0.1:0"}, extra=OPERATORS)
    async with in_process_daemon(config, environ=TOKENS) as running:
        assert running.endpoints.url is not None
        yield running, running.endpoints.url


async def test_each_role_is_refused_what_it_may_not_do_and_names_the_role_needed(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _daemon(state_dir, scripted_server.base_url) as (running, url), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        me = await client.get("/api/me", headers=_bearer("VIEWER_TOKEN"))
        assert me.json()["name"] == "vera" and me.json()["role"] == "viewer"
        assert (await client.get("/api/desks", headers=_bearer("VIEWER_TOKEN"))).status_code \
            == 200
        for path in ("/api/approvals/any/approve", "/api/desks/alpha/pause"):
            refused = await client.post(path, json={}, headers=_bearer("VIEWER_TOKEN"))
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["code"] == "forbidden_role" and error["needed_role"] == "trader"
            assert "needs the trader role; vera is a viewer" in error["message"]
        kill = await client.post("/api/kill-switch", headers=_bearer("TRADER_TOKEN"),
                                 json={"on": True, "reason": "test"})
        assert kill.status_code == 403 and kill.json()["error"]["needed_role"] == "owner"
        assert (await client.post("/api/reload", json={}, headers=_bearer("TRADER_TOKEN"))
                ).json()["error"]["needed_role"] == "owner"
        status = await client.get("/api/kill-switch", headers=_bearer("OWNER_TOKEN"))
        assert status.json()["halts"] == []  # nothing was switched on by the refusals
        assert not (await running.daemon.supervisor.desk_status("alpha")).paused_reason


async def test_the_name_recorded_is_the_credentials_and_the_old_token_is_an_owner(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _daemon(state_dir, scripted_server.base_url) as (_, url), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        paused = await client.post("/api/desks/alpha/pause", headers=_bearer("TRADER_TOKEN"),
                                   json={"operator": "olga", "reason": "lunch"})
        assert paused.status_code == 200, paused.text
        assert paused.json()["status"]["paused_reason"].startswith("paused by tina at ")
        kill = await client.post("/api/kill-switch", headers=_bearer(DEFAULT_TOKEN_ENV),
                                 json={"on": True, "desk": "beta", "operator": "olga",
                                       "reason": "stale feed"})
        assert kill.status_code == 200, kill.text
        [halt] = (await client.get("/api/kill-switch", headers=_bearer("VIEWER_TOKEN"))
                  ).json()["halts"]
        assert (halt["scope"], halt["by"]) == ("beta", "owner")
        me = await client.get("/api/me", headers=_bearer(DEFAULT_TOKEN_ENV))
        assert me.json() == {"name": "owner", "role": "owner", "surface": "tcp"}


async def test_lifting_a_spend_cap_needs_an_owner(scripted_server: ScriptedServer,
                                                  state_dir: Path) -> None:
    async with _daemon(state_dir, scripted_server.base_url) as (running, url), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        supervisor = running.daemon.supervisor
        await supervisor.pause("alpha", SPEND_CAP, "tokens: 100% of 1,000 today")
        await supervisor.set_reduce_only(True, desk="beta", by=SPEND_CAP, reason="cost cap")
        for path, body in (("/api/desks/alpha/resume", {}),
                           ("/api/desks/beta/reduce_only", {"on": False})):
            refused = await client.post(path, json=body, headers=_bearer("TRADER_TOKEN"))
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["needed_role"] == "owner"
            assert "spend cap" in refused.json()["error"]["message"]
            lifted = await client.post(path, json=body, headers=_bearer("OWNER_TOKEN"))
            assert lifted.status_code == 200, lifted.text
        assert (await supervisor.desk_status("alpha")).state != "paused"
        assert (await supervisor.desk_status("beta")).reduce_only is None
        # A pause of a trader's own is the trader's to lift.
        await client.post("/api/desks/alpha/pause", json={}, headers=_bearer("TRADER_TOKEN"))
        resumed = await client.post("/api/desks/alpha/resume", json={},
                                    headers=_bearer("TRADER_TOKEN"))
        assert resumed.status_code == 200 and resumed.json()["changed"] is True


async def test_the_audit_lists_every_action_with_its_outcome_in_the_api_and_the_cli(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _daemon(state_dir, scripted_server.base_url) as (running, url), \
            httpx.AsyncClient(base_url=url, timeout=10) as client:
        await client.post("/api/desks/alpha/pause", json={},
                          headers={**_bearer("VIEWER_TOKEN"), "X-Operator-Surface": "web"})
        await client.post("/api/desks/alpha/pause", json={"reason": "news"},
                          headers=_bearer("TRADER_TOKEN"))
        await client.post("/api/desks/alpha/resume", json={}, headers=_bearer("OWNER_TOKEN"))
        await client.post("/api/desks/nope/resume", json={}, headers=_bearer("OWNER_TOKEN"))
        answer = await client.get("/api/audit", params={"desk": "alpha"},
                                  headers=_bearer("VIEWER_TOKEN"))
        rows = [(a["who"], a["role"], a["action"], a["desk"], a["surface"], a["outcome"])
                for a in answer.json()["actions"]]
        assert rows == [("vera", "viewer", "pause", "alpha", "web/tcp", "refused"),
                        ("tina", "trader", "pause", "alpha", "tcp", "ok"),
                        ("olga", "owner", "resume", "alpha", "tcp", "ok")]
        everything = (await client.get("/api/audit", headers=_bearer("VIEWER_TOKEN"))
                      ).json()["actions"]
        assert everything[-1]["detail"] == "404 unknown_desk"
        assert everything[0]["detail"] == "403 forbidden_role"
        code, out, err = await run_cli(running.endpoints.socket_path, "audit", "--desk", "alpha")
        assert code == 0, err
        lines = out.splitlines()
        assert len(lines) == 3
        assert lines[0].endswith("vera (viewer) pause alpha via web/tcp: refused "
                                 "(403 forbidden_role)")
        assert lines[2].endswith("olga (owner) resume alpha via tcp: ok")
        future = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).isoformat()
        code, out, _ = await run_cli(running.endpoints.socket_path, "audit", "--json",
                                     "--since", future)
        assert code == 0 and json.loads(out) == []
    # Kept in the store: a daemon opened again on the same state lists them.
    config = state_dir / "daemon.toml"
    async with in_process_daemon(config, environ=TOKENS) as again:
        kept = await again.daemon.store.database.read(lambda connection: connection.execute(
            "SELECT who, action, outcome FROM operator_audit ORDER BY id").fetchall())
        assert [tuple(row) for row in kept][:3] == [("vera", "pause", "refused"),
                                                    ("tina", "pause", "ok"),
                                                    ("olga", "resume", "ok")]


def test_every_route_has_a_role() -> None:
    from trading_agent.operator.api import OperatorService, create_app

    control, _ = build_control("http://127.0.0.1:9/v1")
    service = OperatorService(control, ApprovalBook(), OperatorConfig())

    class _Metrics:
        pass

    app: Any = create_app(service, metrics=_Metrics())  # type: ignore[arg-type]
    while not hasattr(app, "routes"):
        app = app._app
    served = {(method, route.path) for route in app.routes
              for method in getattr(route, "methods", None) or () if method != "HEAD"}
    assert served == set(ROUTE_ROLES), served ^ set(ROUTE_ROLES)
    assert {role for role, _ in ROUTE_ROLES.values()} == {None, "viewer", "trader", "owner"}
    changing = {key for key in ROUTE_ROLES if key[0] == "POST"} - {
        ("POST", "/api/stream-ticket")}
    assert all(ROUTE_ROLES[key][1] for key in changing)  # every action is audited


def test_tokens_are_unique_and_never_in_errors(tmp_path: Path) -> None:
    config = OperatorConfig.model_validate({
        "tcp_address": "127.0.0.1:0",
        "operators": [{"name": "a", "role": "viewer", "token_env": "A_TOKEN"},
                      {"name": "b", "role": "owner", "token_env": "B_TOKEN"}]})
    same = "shared-token-0123456789abcdef"
    with pytest.raises(ConfigError) as refused:
        load_credentials(config, {"A_TOKEN": same, "B_TOKEN": same})
    assert "operators[1].token_env (B_TOKEN) holds the same token as" in str(refused.value)
    assert same not in str(refused.value)
    with pytest.raises(ConfigError, match=r"B_TOKEN \(operator.operators\[1\].token_env\)"):
        load_credentials(config, {"A_TOKEN": same})
    path = write_daemon_config(tmp_path, "http://127.0.0.1:9/v1", extra=OPERATORS.replace(
        '"tina"', '"vera"'))
    with pytest.raises(ConfigError, match=r"daemon.toml: operator.operators: operators\[1\]"
                                          r"\.name 'vera' is also operators\[0\]'s"):
        load_settings(path)


def test_a_non_loopback_plaintext_listener_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = write_daemon_config(tmp_path, "http://127.0.0.1:9/v1",
                               operator={"tcp_address": "0.0.0.0:8765"})
    with pytest.raises(ConfigError, match=r"daemon.toml: operator: tcp_address '0.0.0.0:8765'"
                                          r" is reachable from other machines.*allow_plaintext"):
        load_settings(path)
    assert OperatorConfig(tcp_address="0.0.0.0:8765", allow_plaintext=True).tcp_address
    with pytest.raises(ValueError, match="tls_cert_file is set but tls_key_file is not"):
        OperatorConfig(tcp_address="0.0.0.0:8765", tls_cert_file=tmp_path / "cert.pem")


def _self_signed(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=1))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName(
                       [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


async def test_a_tls_listener_serves_https_with_the_token(scripted_server: ScriptedServer,
                                                          state_dir: Path,
                                                          tmp_path: Path) -> None:
    cert_file, key_file = _self_signed(tmp_path)
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0", tls_cert_file=cert_file,
                            tls_key_file=key_file)
    environ = {DEFAULT_TOKEN_ENV: TOKENS[DEFAULT_TOKEN_ENV]}
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ=environ) as (endpoints, _):
        assert endpoints.url is not None and endpoints.url.startswith("https://127.0.0.1:")
        trust = ssl.create_default_context(cafile=str(cert_file))
        async with httpx.AsyncClient(base_url=endpoints.url, verify=trust, timeout=5) as client:
            ok = await client.get("/api/desks", headers=_bearer(DEFAULT_TOKEN_ENV))
            assert ok.status_code == 200 and len(ok.json()["desks"]) == 2
            assert (await client.get("/api/desks")).status_code == 401
        plain = endpoints.url.replace("https://", "http://")
        async with httpx.AsyncClient(base_url=plain, timeout=5) as client:
            with pytest.raises(httpx.HTTPError):  # no plain HTTP on a TLS listener
                await client.get("/api/desks", headers=_bearer(DEFAULT_TOKEN_ENV))


async def test_a_ticket_opens_the_event_stream_and_nothing_else(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url)
    config = OperatorConfig(tcp_address="127.0.0.1:0")
    environ = {DEFAULT_TOKEN_ENV: TOKENS[DEFAULT_TOKEN_ENV]}
    async with running_api(control, ApprovalBook(), config, state_dir,
                           environ=environ) as (endpoints, _), \
            httpx.AsyncClient(base_url=endpoints.url or "", timeout=5) as client:
        assert (await client.post("/api/stream-ticket")).status_code == 401
        issued = await client.post("/api/stream-ticket", headers=_bearer(DEFAULT_TOKEN_ENV))
        ticket = issued.json()["ticket"]
        assert issued.json()["expires_in"] == 60 and TOKENS[DEFAULT_TOKEN_ENV] not in ticket
        async with client.stream("GET", "/api/events",
                                 params={"ticket": ticket, "follow": "0"}) as stream:
            assert stream.status_code == 200
        for method, path in (("GET", "/api/desks"), ("GET", "/api/health"),
                             ("POST", "/api/desks/alpha/pause")):
            refused = await client.request(method, path, params={"ticket": ticket})
            assert refused.status_code == 401, (path, refused.text)
            assert "opens GET /api/events and nothing else" in refused.json()["error"]["message"]
        wrong = await client.get("/api/events", params={"ticket": ticket + "x", "follow": "0"})
        assert wrong.status_code == 401 and "unknown or expired" in wrong.text
        # Every answer carries the page's security headers, its files' included.
        for path in ("/", "/static/app.js", "/static/style.css", "/api/health"):
            answer = await client.get(path)
            assert answer.headers["x-content-type-options"] == "nosniff", path
            assert "frame-ancestors 'none'" in answer.headers["content-security-policy"], path
            assert answer.headers["referrer-policy"] == "no-referrer", path


def test_a_ticket_expires() -> None:
    now = [1000.0]
    tickets = StreamTickets(seconds=60, clock=lambda: now[0])
    ticket = tickets.issue(Operator("vera", "viewer"))
    now[0] += 59
    assert tickets.redeem(ticket) == Operator("vera", "viewer")
    now[0] += 1
    assert tickets.redeem(ticket) is None
    assert tickets.redeem("never-issued") is None
