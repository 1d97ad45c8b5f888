"""Reduce-only as operators use it, and protections that set it, through the real daemon.

The daemon is opened as ``trading-agent run`` opens it (:func:`in_process_daemon`) with paper
desks on the replayed candles; the desks' model is :class:`OrderModel` (it places the orders
an operator's message spells out and repeats every tool result), so the tests read the
refusals exactly as the model read them. The CLI and chat run in processes of their own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.command_line import run_cli
from tests.operator.harness import collect_events, in_process_daemon, uds_client
from tests.operator.test_control_cli import _chat, _order_turn
from tests.operator.test_controls import OrderModel, positions
from tests.os_user import OS_USER
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step
from trading_agent.errors import ConfigError
from trading_agent.settings import load_settings

REFUSED_BY_ANN = re.compile(
    rf"Refused \(reduce_only, set by {OS_USER}\): FOMC at 18:00\. This desk may only reduce its "
    r"positions until an operator switches it off: this buy of 0\.01 BTC would take the "
    r"BTC/USDT position from 0\.02 to 0\.03 \(open orders counted\); a sell of at most 0\.02 "
    r"BTC still passes\.")


async def _status(client: httpx.AsyncClient, desk: str = "alpha") -> dict[str, Any]:
    return dict((await client.get(f"/api/desks/{desk}")).json())


async def _events_of(client: httpx.AsyncClient, kind: str, count: int = 1) -> list[Any]:
    events = await collect_events(client, params={"after": 0}, until=lambda es: sum(
        e.type == kind for e in es) >= count)
    return [e for e in events if e.type == kind]


@pytest.mark.slow  # two daemons and five CLI processes: about ten seconds
async def test_reduce_only_from_the_command_line_refuses_new_exposure_and_survives_a_restart(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks=("alpha", "beta"))
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        socket = running.endpoints.socket_path
        [bought] = await _order_turn(client, scripted_server, "alpha", "market buy 0.02")
        assert "filled: bought 0.02 BTC" in bought
        code, out, err = await run_cli(socket, "reduce-only", "on", "alpha", "--reason",
                                       "FOMC at 18:00")
        assert code == 0, err
        assert re.match(rf"alpha is in reduce-only: reduce-only by {OS_USER} at \S+ \S+ UTC: "
                        r"FOMC at 18:00 \(until an operator switches it off\)\. Orders that would "
                        r"open, grow or reverse a position are refused; orders that shrink one "
                        r"pass\.",
                        out), out
        code, out, _ = await run_cli(socket, "desks")
        assert code == 0 and (f"alpha: REDUCE-ONLY, new exposure refused: reduce-only by "
                              f"{OS_USER} at ") in out, out
        assert "beta: REDUCE-ONLY" not in out

        refused, reduced = await _order_turn(client, scripted_server, "alpha",
                                             "market buy 0.01; market sell 0.01")
        assert REFUSED_BY_ANN.search(refused), refused
        assert "filled: sold 0.01 BTC" in reduced
        [other] = await _order_turn(client, scripted_server, "beta", "market buy 0.01")
        assert "filled: bought 0.01 BTC" in other  # another desk is not held back
        status = await _status(client)
        assert status["reduce_only"]["by"] == OS_USER
        assert status["reduce_only"]["reason"] == "FOMC at 18:00"
        assert status["reduce_only"]["until"] is None
        assert status["state"] == "idle"  # it still thinks
        [event] = await _events_of(client, "reduce_only")
        assert event.data["desk"] == "alpha" and event.data["on"] is True
        assert event.data["text"].startswith(
            f"REDUCE-ONLY ON (alpha): reduce-only by {OS_USER} at ")
        metrics = (await client.get("/metrics")).text
        assert 'trading_agent_desk_reduce_only{desk="alpha"} 1.0' in metrics
        assert 'trading_agent_desk_reduce_only{desk="beta"} 0.0' in metrics
        assert 'trading_agent_risk_refusals_total{desk="alpha",limit="reduce_only"} 1.0' \
            in metrics

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        socket = running.endpoints.socket_path
        after_restart = await _status(client)
        assert after_restart["reduce_only"]["by"] == OS_USER
        assert after_restart["reduce_only"]["text"] == status["reduce_only"]["text"]
        [refused] = await _order_turn(client, scripted_server, "alpha", "market buy 0.01")
        assert f"Refused (reduce_only, set by {OS_USER}): FOMC at 18:00." in refused
        code, out, err = await run_cli(socket, "reduce-only", "off", "alpha")
        assert code == 0, err
        assert out.startswith(
            f"alpha is no longer in reduce-only (it was reduce-only by {OS_USER} at ")
        code, out, _ = await run_cli(socket, "reduce-only", "off", "alpha")
        assert out.strip() == "alpha was not in reduce-only."
        [bought] = await _order_turn(client, scripted_server, "alpha", "market buy 0.01")
        assert "filled: bought 0.01 BTC" in bought
        assert (await _status(client))["reduce_only"] is None
        off = (await _events_of(client, "reduce_only", 2))[-1]
        assert off.data["on"] is False and off.data["by"] == OS_USER
        code, _, err = await run_cli(socket, "reduce-only", "on", "gamma")
        assert code == 2 and "gamma" in err
    assert await positions(state_dir, "alpha") == {"BTC/USDT": pytest.approx(0.02)}


async def test_chat_and_the_api_switch_reduce_only(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        async with _chat(running.endpoints.socket_path, "alpha") as chat:
            await chat.expect("Connected to alpha")
            await chat.type("/reduce_only on the desk is overtrading")
            await chat.expect(re.compile(rf"alpha is in reduce-only: reduce-only by {OS_USER} "
                                         r"at \S+ \S+ UTC: the desk is overtrading"))
            await chat.expect(f"⇲ REDUCE-ONLY ON (alpha): reduce-only by {OS_USER}")  # the event
            await chat.type("/status")
            await chat.expect(f"REDUCE-ONLY: reduce-only by {OS_USER}")
            [refused] = await _order_turn(client, scripted_server, "alpha", "market buy 0.01")
            assert refused.startswith(f"Error: Refused (reduce_only, set by {OS_USER}): the "
                                      "desk is overtrading."), refused
            assert refused.endswith("it holds no position to reduce.")
            await chat.type("/reduce_only maybe")
            await chat.expect("Usage: /reduce_only on REASON, or /reduce_only off")
            await chat.type("/reduce_only off")
            await chat.expect(f"alpha is no longer in reduce-only (it was reduce-only by {OS_USER}")
            await chat.expect(f"⇲ reduce-only off (alpha) by {OS_USER}")

        response = await client.post("/api/desks/alpha/reduce_only",
                                     json={"on": True, "reason": "audit"})
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["on"] is True and answer["state"]["by"] == OS_USER
        assert answer["status"]["reduce_only"]["reason"] == "audit"
        response = await client.post("/api/desks/alpha/reduce_only", json={"on": "yes"})
        assert response.status_code == 400
        response = await client.post("/api/desks/gamma/reduce_only", json={"on": True})
        assert response.status_code == 404
        response = await client.post("/api/desks/alpha/reduce_only",
                                     json={"on": False})
        assert response.json()["was"]["reason"] == "audit"
        assert response.json()["status"]["reduce_only"] is None


async def test_a_protection_trips_in_the_daemon_and_the_model_reads_its_name_and_lift_time(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(
        state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
        desks={"alpha": {"risk": {"max_order_notional": "10000"},
                         "protections": {"tool_error_guard": {
                             "max_errors": 1, "lookback_minutes": 60,
                             "pause_minutes": 120}}}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        results = await _order_turn(
            client, scripted_server, "alpha",
            "market buy 0.02; market buy 100; market buy 100; market buy 0.01; "
            "market sell 0.01")
        status = await _status(client)
        [event] = await _events_of(client, "reduce_only")
    bought, too_large, again, refused, reduced = results
    assert "filled: bought 0.02 BTC" in bought
    assert "max_order_notional" in too_large and "max_order_notional" in again
    assert re.search(r"Refused \(reduce_only, protection tool_error_guard\): 2 tool calls "
                     r"failed or were refused within the last 1 h \(max_errors 1\)\. This desk "
                     r"may only reduce its positions until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: "
                     r"this buy of 0\.01 BTC would take the BTC/USDT position from 0\.02 to "
                     r"0\.03", refused), refused
    assert "filled: sold 0.01 BTC" in reduced
    assert status["reduce_only"]["protection"] == "tool_error_guard"
    assert status["reduce_only"]["by"] == "protection tool_error_guard"
    assert status["reduce_only"]["until"] is not None
    assert event.data["by"] == "protection tool_error_guard" and event.data["on"] is True
    assert event.data["until"] == status["reduce_only"]["until"]


def _model_of(request: RecordedRequest) -> str:
    return str(request.json["model"])


async def test_a_spend_cap_switches_the_desk_to_its_fallback_model(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("One.", usage=(900, 150)), Reply("Two.", usage=(10, 5)))
    config = write_daemon_config(
        state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
        desks={"alpha": {"controls": {"max_tokens_per_day": 1000, "on_cap": "fallback",
                                      "fallback_model": "small-model"}}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages",
                          json={"text": "First.", "wait": True, "timeout": 10})
        [switched] = await _events_of(client, "model_switched")
        response = await client.post("/api/desks/alpha/messages",
                                     json={"text": "Second.", "wait": True, "timeout": 10})
        status = await _status(client)
    assert response.json()["reply"]["text"] == "Two."
    assert [_model_of(r) for r in scripted_server.requests] == ["scripted-model", "small-model"]
    assert switched.data["model"] == "small-model"
    assert switched.data["previous"] == "scripted-model"
    assert switched.data["reason"].startswith("desk alpha's daily spend cap is used up: 1,050 "
                                              "of 1,000 tokens today (UTC)")
    assert status["model"] == "small-model" and status["state"] == "idle"
    scripted_server.assert_complete()


async def test_a_spend_cap_can_put_the_desk_in_reduce_only_instead_of_pausing_it(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    model = OrderModel()

    def respond(request: RecordedRequest) -> Step:
        step = model(request)
        assert isinstance(step, Reply)
        return Reply(step.text, tool_calls=step.tool_calls, usage=(600, 50))

    scripted_server.responder = respond
    config = write_daemon_config(
        state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
        desks={"alpha": {"controls": {"max_tokens_per_day": 1000, "on_cap": "reduce_only"}}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await _order_turn(client, scripted_server, "alpha", "market buy 0.02")
        [event] = await _events_of(client, "reduce_only")
        results = await _order_turn(client, scripted_server, "alpha",
                                    "market buy 0.01; market sell 0.01")
        status = await _status(client)
    refused, reduced = results
    assert event.data["by"] == "spend cap" and event.data["until"].endswith("T00:00:00+00:00")
    assert refused.startswith("Error: Refused (reduce_only, set by spend cap): desk alpha's "
                              "daily spend cap is used up: "), refused
    assert "filled: sold 0.01 BTC" in reduced
    assert status["state"] == "idle" and status["paused_reason"] == ""
    assert status["reduce_only"]["by"] == "spend cap"


def test_bad_protection_and_on_cap_settings_name_the_file_the_key_and_what_is_allowed(
        tmp_path: Path) -> None:
    bad = write_daemon_config(tmp_path, "http://127.0.0.1:9/v1", desks={"alpha": {
        "protections": {"stoploss_guard": {"max_stops": 0, "lookback_minutes": 60}}}})
    with pytest.raises(ConfigError) as error:
        load_settings(bad)
    text = str(error.value)
    assert str(bad) in text and "desks.alpha.protections.stoploss_guard.max_stops" in text
    assert "greater than or equal to 1" in text

    bad = write_daemon_config(tmp_path, "http://127.0.0.1:9/v1", desks={"alpha": {
        "protections": {"max_drawdown_guard": {"pause_minutes": 5}}}})
    with pytest.raises(ConfigError) as error:
        load_settings(bad)
    assert "desks.alpha.protections.max_drawdown_guard" in str(error.value)

    bad = write_daemon_config(tmp_path, "http://127.0.0.1:9/v1", desks={"alpha": {
        "controls": {"on_cap": "fallback"}}})
    with pytest.raises(ConfigError) as error:
        load_settings(bad)
    assert "desks.alpha.controls" in str(error.value)
    assert 'on_cap = "fallback" needs fallback_model' in str(error.value)

    bad = write_daemon_config(tmp_path, "http://127.0.0.1:9/v1", desks={"alpha": {
        "controls": {"on_cap": "stop"}}})
    with pytest.raises(ConfigError) as error:
        load_settings(bad)
    assert "desks.alpha.controls.on_cap" in str(error.value)
    assert "'pause', 'fallback' or 'reduce_only'" in str(error.value)
