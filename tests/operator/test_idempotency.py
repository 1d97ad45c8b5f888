"""A message sent again is read once: ``POST .../messages`` takes a client's idempotency key
(the ``Idempotency-Key`` header or the body's ``idempotency_key``); a message that may not
have been kept (a fleet's NATS down) is answered 503 with the truth, the key to send it again
with; the CLI's client sends one key per message and sends it again under that key.

Real parts: the operator API on its Unix socket, real AgentLoops on the scripted model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.operator.harness import build_control, running_api, uds_client
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.daemon.control import MessageNotKeptError, message_id_for
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.client import OperatorClient
from trading_agent.operator.config import OperatorConfig

CONFIG = OperatorConfig.model_validate({"approval_timeout_seconds": 5})


async def test_a_message_sent_again_with_its_key_is_taken_once_and_answered_alike(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = lambda request: Reply("Noted.")
    control, _ = build_control(scripted_server.base_url)
    async with running_api(control, ApprovalBook(), CONFIG, state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        url = "/api/desks/alpha/messages"
        first = await client.post(url, json={"text": "Buy 0.01 BTC."},
                                  headers={"Idempotency-Key": "order-7"})
        again = await client.post(url, json={"text": "Buy 0.01 BTC."},
                                  headers={"Idempotency-Key": "order-7"})
        in_body = await client.post(url, json={"text": "Buy 0.01 BTC.",
                                               "idempotency_key": "order-7"})
        other_desk = await client.post("/api/desks/beta/messages",
                                       json={"text": "Buy 0.01 BTC."},
                                       headers={"Idempotency-Key": "order-7"})
        differ = await client.post(url, json={"text": "x", "idempotency_key": "a"},
                                   headers={"Idempotency-Key": "b"})
        bad = await client.post(url, json={"text": "x"}, headers={"Idempotency-Key": "a b"})

    assert [r.status_code for r in (first, again, in_body, other_desk)] == [202] * 4
    assert first.json()["id"] == again.json()["id"] == in_body.json()["id"] \
        == message_id_for("alpha", "order-7")
    assert other_desk.json()["id"] != first.json()["id"]  # a key is a desk's own
    assert control.sent == [("alpha", "Buy 0.01 BTC.", OS_USER),
                            ("beta", "Buy 0.01 BTC.", OS_USER)]
    assert (differ.status_code, bad.status_code) == (400, 400)


@pytest.mark.parametrize(("kept", "code", "says"), [
    (False, "message_not_kept", "was not kept"),
    (None, "message_not_confirmed", "may or may not have been kept"),
])
async def test_a_message_that_may_not_be_kept_is_answered_503_with_the_truth(
        scripted_server: ScriptedServer, state_dir: Path, kept: bool | None, code: str,
        says: str) -> None:
    scripted_server.responder = lambda request: Reply("Noted.")
    control, _ = build_control(scripted_server.base_url)
    control.refuse_messages.append(MessageNotKeptError("NATS is not connected", kept))
    async with running_api(control, ApprovalBook(), CONFIG, state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        url = "/api/desks/alpha/messages"
        refused = await client.post(url, json={"text": "Sell half."})
        error = refused.json()["error"]
        # The key the daemon chose for a client that sent none: sending again with it is safe.
        resent = await client.post(url, json={"text": "Sell half."},
                                   headers={"Idempotency-Key": error["idempotency_key"]})

    assert refused.status_code == 503
    assert (error["code"], error["kept"]) == (code, kept)
    assert says in error["message"] and error["idempotency_key"] in error["message"]
    assert error["id"] == message_id_for("alpha", error["idempotency_key"])
    assert resent.status_code == 202 and resent.json()["id"] == error["id"]
    assert control.sent == [("alpha", "Sell half.", OS_USER)]


async def test_the_client_sends_a_message_again_under_its_key_until_it_is_kept(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = lambda request: Reply("Noted.")
    control, _ = build_control(scripted_server.base_url)
    control.refuse_messages += [MessageNotKeptError("NATS is not connected", False),
                                MessageNotKeptError("not confirmed", None)]
    async with running_api(control, ApprovalBook(), CONFIG, state_dir) as (endpoints, _), \
            OperatorClient(socket_path=endpoints.socket_path) as client:
        sent = await client.send_message("alpha", "Flatten BTC.",
                                         idempotency_key="flatten-1")
        own_key = await client.send_message("beta", "Hello.")

    assert sent["id"] == message_id_for("alpha", "flatten-1")
    assert own_key["id"].startswith("k")  # a key of the client's own, every message
    assert control.sent == [("alpha", "Flatten BTC.", OS_USER), ("beta", "Hello.", OS_USER)]
    assert not control.refuse_messages
