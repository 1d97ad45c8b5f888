"""``GET /metrics``: a real daemon's figures in Prometheus' text format, read by
prometheus-client's own parser, over the Unix socket and over TCP with its token."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon_config import write_daemon_config
from tests.operator.harness import InProcessDaemon, uds_client
from tests.scripted_server import Reply, ScriptedServer, ToolCall, rate_limited
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import (
    ModelRequest,
    TurnEnded,
    TurnStarted,
    UsageReported,
)
from trading_agent.app.services import open_daemon
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.metrics import DaemonMetrics, order_state, refused_limit
from trading_agent.settings import load_settings

TOKEN = "metrics-scraper-token-0123456789"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _daemon_config(folder: Path, base_url: str) -> Path:
    """One paper desk on the replay (BTC near 16,600) whose orders above 1,000 USDT wait for
    an operator and above 10,000 USDT are refused; the API also listens on TCP."""
    return write_daemon_config(
        folder, base_url,
        operator={"tcp_address": "127.0.0.1:0", "approval_timeout_seconds": 30,
                  "approval_notional_threshold": 1000},
        desks={"alpha": {"system_prompt": "You are alpha.", "tools": ["place_order"],
                         "risk": {"max_order_notional": "10000"}}})


@contextlib.asynccontextmanager
async def _running_daemon(config: Path) -> AsyncIterator[InProcessDaemon]:
    """The daemon as ``run`` runs it (the harness's ``in_process_daemon``, with the TCP
    token in its environment)."""
    environ = {"TRADING_AGENT_OPERATOR_TOKEN": TOKEN}
    async with open_daemon(load_settings(config), environ=environ, config_path=config) \
            as daemon, anyio.create_task_group() as group:
        group.start_soon(daemon.store.events.persist_events, daemon.store_subscription)
        assert daemon.serve_api is not None
        endpoints = await group.start(daemon.serve_api)
        await group.start(daemon.supervisor.run)
        try:
            yield InProcessDaemon(daemon, endpoints)
        finally:
            group.cancel_scope.cancel()


def _parse(text: str) -> Samples:
    """Every sample, by name and labels, as prometheus-client's parser reads them."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def _scrape(client: httpx.AsyncClient, headers: dict[str, str] | None = None) -> Samples:
    response = await client.get("/metrics", headers=headers or {})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return _parse(response.text)


async def _scrape_until(client: httpx.AsyncClient, ready: Callable[[Samples], bool]) -> Samples:
    """Scrapes until ``ready`` (events reach the metrics a moment after they happen)."""
    with anyio.fail_after(10):
        while True:
            samples = await _scrape(client)
            if ready(samples):
                return samples
            await anyio.sleep(0.02)


async def _pending_approval(client: httpx.AsyncClient) -> dict[str, Any]:
    with anyio.fail_after(10):
        while True:
            pending = (await client.get("/api/approvals")).json()["approvals"]
            if pending:
                return dict(pending[0])
            await anyio.sleep(0.01)


async def test_a_turn_with_a_refusal_a_retry_and_an_approved_order(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    too_large = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "1"}
    within = {**too_large, "amount": "0.1"}  # ~1,660 USDT: within the limits, above 1,000
    scripted_server.add(
        Reply(tool_calls=[ToolCall("place_order", too_large)], usage=(1000, 50),
              cached_tokens=200),
        rate_limited(retry_after=0),
        Reply(tool_calls=[ToolCall("place_order", within)], usage=(1200, 40),
              cached_tokens=1000),
        Reply("Bought 0.1 BTC.", usage=(1300, 10), cached_tokens=1100))
    started = time.time()
    async with _running_daemon(_daemon_config(state_dir, scripted_server.base_url)) \
            as running, uds_client(running.endpoints.socket_path) as client:
        before = await _scrape(client)
        assert _value(before, "trading_agent_input_tokens_total", desk="alpha") == 0
        assert _value(before, "trading_agent_approvals_pending", desk="alpha") == 0
        assert _value(before, "trading_agent_kill_switch", desk="alpha") == 0
        assert _value(before, "trading_agent_kill_switch", desk="*") == 0
        start_time = _value(before, "trading_agent_start_time_seconds")
        assert start_time is not None and started - 5 < start_time <= time.time()

        await client.post("/api/desks/alpha/messages", json={"text": "Buy bitcoin."})
        pending = await _pending_approval(client)
        waiting = await _scrape_until(client, lambda s: _value(
            s, "trading_agent_model_retries_total", desk="alpha") == 1 and _value(
            s, "trading_agent_risk_refusals_total", desk="alpha",
            limit="max_order_notional") == 1)
        assert _value(waiting, "trading_agent_approvals_pending", desk="alpha") == 1
        assert _value(waiting, "trading_agent_orders_total", desk="alpha", state="refused") == 1
        assert _value(waiting, "trading_agent_desk_state", desk="alpha", state="working") == 1
        assert _value(waiting, "trading_agent_turns_total", desk="alpha",
                      outcome="completed") is None

        await client.post(f"/api/approvals/{pending['id']}/approve", json={"operator": "alice"})
        # The turn's end is counted when it is published; the desk is idle a moment later.
        done = await _scrape_until(client, lambda s: _value(
            s, "trading_agent_turns_total", desk="alpha", outcome="completed") == 1 and _value(
            s, "trading_agent_desk_state", desk="alpha", state="idle") == 1)
        assert _value(done, "trading_agent_input_tokens_total", desk="alpha") == 3500
        assert _value(done, "trading_agent_output_tokens_total", desk="alpha") == 100
        assert _value(done, "trading_agent_cached_input_tokens_total", desk="alpha") == 2300
        assert _value(done, "trading_agent_turn_seconds_count", desk="alpha") == 1
        turn_seconds = _value(done, "trading_agent_turn_seconds_sum", desk="alpha")
        assert turn_seconds is not None and 0 < turn_seconds < time.time() - started
        # Three answered calls (the rate-limited attempt is a retry of the second).
        assert _value(done, "trading_agent_model_call_seconds_count", desk="alpha") == 3
        assert _value(done, "trading_agent_model_retries_total", desk="alpha") == 1
        assert _value(done, "trading_agent_orders_total", desk="alpha", state="filled") == 1
        assert _value(done, "trading_agent_orders_total", desk="alpha", state="refused") == 1
        assert _value(done, "trading_agent_risk_refusals_total", desk="alpha",
                      limit="max_order_notional") == 1
        assert _value(done, "trading_agent_approvals_total", desk="alpha",
                      outcome="approved") == 1
        assert _value(done, "trading_agent_approvals_pending", desk="alpha") == 0
        assert _value(done, "trading_agent_trigger_queue_depth", desk="alpha") == 0
        assert _value(done, "trading_agent_open_orders", desk="alpha") == 0
        equity = _value(done, "trading_agent_equity", desk="alpha")
        assert equity is not None and 9_000 < equity < 11_000  # 10,000 USDT, less fees
        assert _value(done, "trading_agent_desk_paused", desk="alpha") == 0
        assert _value(done, "trading_agent_desk_state", desk="alpha", state="idle") == 1
        assert _value(done, "trading_agent_event_bus_dropped_events_total",
                      subscriber="metrics") == 0
        uptime = _value(done, "trading_agent_uptime_seconds")
        assert uptime is not None and 0 < uptime < time.time() - started + 1

        switched = await client.post("/api/kill-switch", json={
            "on": True, "operator": "alice", "reason": "checking the alerts"})
        assert switched.status_code == 200, switched.text
        paused = await client.post("/api/desks/alpha/pause", json={"reason": "lunch"})
        assert paused.status_code == 200, paused.text
        halted = await _scrape(client)
        assert _value(halted, "trading_agent_kill_switch", desk="*") == 1
        assert _value(halted, "trading_agent_kill_switch", desk="alpha") == 1
        assert _value(halted, "trading_agent_desk_paused", desk="alpha") == 1
    scripted_server.assert_complete()


async def test_tcp_needs_the_bearer_token_in_the_header(scripted_server: ScriptedServer,
                                                       state_dir: Path) -> None:
    async with _running_daemon(_daemon_config(state_dir, scripted_server.base_url)) \
            as running:
        assert running.endpoints.url is not None
        async with httpx.AsyncClient(base_url=running.endpoints.url, timeout=5) as client:
            for headers, params in [({}, {}), ({"Authorization": "Bearer wrong"}, {}),
                                    ({"Authorization": f"Basic {TOKEN}"}, {}),
                                    ({}, {"token": TOKEN})]:  # never in a URL
                refused = await client.get("/metrics", headers=headers, params=params)
                assert refused.status_code == 401, (headers, params)
                assert refused.json()["error"]["code"] == "unauthorized"
                assert refused.headers["www-authenticate"].startswith("Bearer")
                assert "trading_agent" not in refused.text
            samples = await _scrape(client, {"Authorization": f"Bearer {TOKEN}"})
            assert _value(samples, "trading_agent_kill_switch", desk="alpha") == 0
            assert _value(samples, "trading_agent_input_tokens_total", desk="alpha") == 0
            posted = await client.post("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert posted.status_code == 405


async def test_two_daemons_in_one_process_keep_their_own_figures() -> None:
    def usage(desk: str, tokens: int) -> list[Any]:
        return [TurnStarted(desk=desk, turn="t1", trigger_kind="operator", trigger_text="hi",
                            at=100.0),
                ModelRequest(desk=desk, turn="t1", round=1, message_count=2, tool_count=0,
                             estimated_tokens=tokens, image_count=0, at=100.0),
                UsageReported(desk=desk, turn="t1", input_tokens=tokens, output_tokens=5,
                              estimated=False, cost=0.25, context_tokens=tokens + 5,
                              context_window=32000, at=101.5),
                TurnEnded(desk=desk, turn="t1", rounds=1, hit_round_limit=False,
                          final_text="ok", input_tokens=tokens, output_tokens=5, cost=0.25,
                          at=102.0)]

    first, second = _Control(EventBus()), _Control(EventBus())
    one, two = DaemonMetrics(first, ApprovalBook()), DaemonMetrics(second, ApprovalBook())
    for event in usage("alpha", 10):
        one.observe(event)
    for event in usage("alpha", 70):
        two.observe(event)
    a, b = _parse((await one.render()).decode()), _parse((await two.render()).decode())
    assert _value(a, "trading_agent_input_tokens_total", desk="alpha") == 10
    assert _value(b, "trading_agent_input_tokens_total", desk="alpha") == 70
    assert _value(a, "trading_agent_model_cost_total", desk="alpha") == 0.25
    assert _value(a, "trading_agent_turn_seconds_sum", desk="alpha") == 2.0
    assert _value(a, "trading_agent_model_call_seconds_sum", desk="alpha") == 1.5
    assert _value(b, "trading_agent_turns_total", desk="alpha", outcome="completed") == 1


class _Control:
    """The least of a DeskControl the scrape-time figures read: no desks, no switches."""

    def __init__(self, bus: EventBus) -> None:
        self.event_bus = bus

    def desk_names(self) -> list[str]:
        return []

    def kill_switch_halts(self) -> list[dict[str, str]]:
        return []


@pytest.mark.parametrize(("text", "limit"), [
    ("Error: Refused (kill_switch): halted by alice at 2024-01-01 00:00:00 UTC: test.",
     "kill_switch"),
    ("Error: Refused: order notional 16,600.00 USDT exceeds max_order_notional 10,000.00 USDT.",
     "max_order_notional"),
    ("Error: Refused: ETH/USDT is not in allowed_symbols; this desk may trade BTC/USDT.",
     "allowed_symbols"),
    ("Error: Refused: daily loss 600.00 USDT since 00:00 UTC reached max_daily_loss 500.00 "
     "USDT; new orders are halted until 00:00 UTC on 2024-01-02.", "max_daily_loss"),
    ("Error: Refused: an earlier BTC/USDT order (client id x) was sent but its outcome is "
     "still unknown.", "unresolved_orders"),
    ("Error: Could not place the order (buy 1 BTC/USDT): insufficient funds", None),
    ("Order 12 filled: bought 0.1 BTC on BTC/USDT at 16,600.00 (market).", None),
])
def test_a_refusal_is_counted_under_its_limit(text: str, limit: str | None) -> None:
    assert refused_limit(text) == limit


@pytest.mark.parametrize(("text", "is_error", "state"), [
    ("Order 12 filled: bought 0.1 BTC on BTC/USDT at 16,600.00 (market).", False, "filled"),
    ("Order 13 placed and resting: buy limit 0.1 BTC on BTC/USDT @ 16,000.00, filled 0 so far.",
     False, "open"),
    ("Order 14 accepted: buy market 0.1 BTC on BTC/USDT. It fills at the open of the next "
     "candle.", False, "open"),
    ("Order 15 is canceled: buy limit 0.1 BTC.", False, "canceled"),
    ("Error: Refused: order notional 16,600.00 USDT exceeds max_order_notional.", True,
     "refused"),
    ("Denied by operator bob: too large. The place_order call was not placed.", True, "denied"),
    ("Timed out waiting for approval after 30 s: not placed.", True, "approval_timed_out"),
    ("Error: Could not place the order (buy 1 BTC/USDT): insufficient funds", True, "failed"),
])
def test_an_order_is_counted_by_how_it_ended(text: str, is_error: bool, state: str) -> None:
    assert order_state(text, is_error) == state
