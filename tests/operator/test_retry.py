"""An operator's retry: the desk's last answer leaves what it is sent (the store keeps it,
marked) and the turn runs again from the same trigger, which is not added twice; across a
restart too. Against the real daemon (its API on a Unix socket) and the scripted server."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import anyio

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.harness import in_process_daemon, uds_client
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.operator.client import OperatorClient, OperatorRequestError


def _contents(server: ScriptedServer, request: int) -> list[str]:
    return [str(m.get("content")) for m in server.requests[request].messages]


async def _ask(client: object, text: str) -> dict[str, object]:
    response = await client.post("/api/desks/alpha/messages",  # type: ignore[attr-defined]
                                 json={"text": text, "wait": True,
                                       "timeout": 10})
    assert response.status_code == 200, response.text
    reply: dict[str, object] = response.json()["reply"]
    return reply


async def test_a_retry_drops_the_last_answer_and_runs_its_turn_again_once(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(
        Reply("Let me look.", tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})]),
        Reply("Buy everything now!"),
        Reply("Holding: the move is too small."),
        Reply("Still holding."))
    config = write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS)

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await _ask(client, "How is BTC?"))["text"] == "Buy everything now!"
        response = await client.post("/api/desks/alpha/retry", json={})
        assert response.status_code == 200, response.text
        assert response.json() == {"desk": "alpha", "retried": True, "dropped": 3}
        with anyio.fail_after(10):
            await scripted_server.wait_for_requests(3)
        retried = _contents(scripted_server, 2)
        assert sum("How is BTC?" in text for text in retried) == 1  # not added twice
        assert not any("Buy everything" in text or "Let me look" in text for text in retried)
        with anyio.fail_after(10):
            while True:
                transcript = (await client.get("/api/desks/alpha/transcript")).json()
                texts = [(m["text"], m["retracted"]) for m in transcript["messages"]]
                if ("Holding: the move is too small.", False) in texts:
                    break
                await anyio.sleep(0.02)
        assert ("Buy everything now!", True) in texts  # kept, marked
        assert sum("How is BTC?" in text for text, _ in texts) == 1
        events = (await client.get("/api/events", params={"desk": "alpha", "after": 0,
                                                          "follow": "false"})).text
        assert "turn_retried" in events

    # After a restart, what the desk is sent still leaves the retracted answer out.
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await _ask(client, "And now?"))["text"] == "Still holding."
    after_restart = _contents(scripted_server, 3)
    assert not any("Buy everything" in text for text in after_restart)
    assert any("Holding: the move is too small." in text for text in after_restart)
    scripted_server.assert_complete()


async def test_a_retry_is_refused_with_a_reason_when_there_is_nothing_to_retry_or_a_turn_runs(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    released = threading.Event()
    scripted_server.add(Reply("Thinking it over.", hold_until=released))
    config = write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS)

    async with in_process_daemon(config) as running:
        client = OperatorClient(socket_path=running.endpoints.socket_path)
        try:
            try:
                await client.retry("alpha", OS_USER)
            except OperatorRequestError as exc:
                assert exc.status == 409 and exc.code == "cannot_retry"
                assert "no turn to run again" in exc.message
            else:
                raise AssertionError("a retry with no turn yet was not refused")
            await client.send_message("alpha", "How is BTC?")
            with anyio.fail_after(10):
                await scripted_server.wait_for_requests(1)
            try:
                await client.retry("alpha", OS_USER)
            except OperatorRequestError as exc:
                assert exc.status == 409 and "cancel it first" in exc.message
            else:
                raise AssertionError("a retry during a turn was not refused")
        finally:
            released.set()
            await client.aclose()


async def test_retry_from_the_command_line_says_what_left_and_refuses_with_the_reason(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    scripted_server.add(Reply("Buy everything now!"), Reply("Holding."))
    config = write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS)
    command = [sys.executable, "-m", "trading_agent.cli", "retry", "alpha"]

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        socket = ["--socket", str(running.endpoints.socket_path)]
        refused = await anyio.run_process([*command, *socket], check=False)
        await _ask(client, "How is BTC?")
        done = await anyio.run_process([*command, *socket], check=False)
        with anyio.fail_after(10):
            await scripted_server.wait_for_requests(2)

    assert refused.returncode == 2
    assert "no turn to run again" in refused.stderr.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == (
        "alpha's last answer (1 message) left what it is sent; its turn runs again.")


async def test_a_turn_that_placed_an_order_is_not_retried_so_the_model_never_loses_it(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    buy = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.01"}
    too_big = {**buy, "amount": "50"}
    scripted_server.add(
        Reply(tool_calls=[ToolCall("place_order", buy)]),
        Reply("Bought 0.01 BTC."),
        Reply(tool_calls=[ToolCall("place_order", too_big)]),
        Reply("The limits refused it."),
        Reply("Holding instead."))
    config = write_daemon_config(tmp_path, scripted_server.base_url, daemon=FAST_RESTARTS)

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await _ask(client, "Buy a little."))["text"] == "Bought 0.01 BTC."
        response = await client.post("/api/desks/alpha/retry", json={})
        assert response.status_code == 409, response.text
        message = response.json()["error"]["message"]
        assert message.startswith("nothing was retried: the last turn placed an order (Order P1 "
                                  "filled: bought "
                                  "0.01 BTC on BTC/USDT at 16,654.22 (market)"), message
        assert "send your correction as a new message instead" in message
        transcript = (await client.get("/api/desks/alpha/transcript")).json()
        assert not any(m["retracted"] for m in transcript["messages"])  # nothing hidden

        # An order the risk limits refused never left: that turn may run again.
        assert (await _ask(client, "Buy a lot."))["text"] == "The limits refused it."
        response = await client.post("/api/desks/alpha/retry", json={})
        assert response.status_code == 200, response.text
        with anyio.fail_after(10):
            await scripted_server.wait_for_requests(5)
        # The retried turn still shows the first turn's order to the model.
        assert any("Order P1 filled" in text for text in _contents(scripted_server, 4))
