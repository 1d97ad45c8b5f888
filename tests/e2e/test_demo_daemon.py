"""``make run`` end to end: the demo daemon, the real local model, an operator's message.

A real ``trading-agent run`` process on a copy of ``config/demo.toml`` (its state directory
and model cache moved to scratch folders through the environment, as an operator would
override them) starts Gemma 3 270M in llama-cpp-python's server, prints how to watch and steer
the desks and the web page's address (127.0.0.1, with a token made at start), serves that
page and its API, and answers a message sent through the operator API on its Unix socket. The test
checks protocol facts (the request went out, every tool call got its result, the turn ended
with text, events and transcript are stored), never the model's wisdom: the 270M base model
is no trader. The demo's desks also wake on their own (price moves, candle closes), so the
message may start a turn or steer one already running; either way it must be answered.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.daemon.process import ROOT, DaemonProcess, short_dir
from tests.e2e.local_model import needs_local_model
from trading_agent.operator.client import OperatorClient
from trading_agent.store.store import Store, database_path

pytestmark = [pytest.mark.slow, needs_local_model]

DESK = "momentum"


def _demo_copy(folder: Path) -> Path:
    """The demo config, copied as it is (the environment moves its state and model cache)."""
    config = folder / "demo.toml"
    shutil.copyfile(ROOT / "config" / "demo.toml", config)
    return config


def _our_turn(events: list[dict[str, Any]], message_id: str, text: str) -> str | None:
    """The turn that took the message: it started one, or steered (or opened) one."""
    for event in events:
        if (event["type"] == "turn_start" and event["trigger_kind"] == "operator"
                and event["trigger_text"] == text):
            return str(event["turn"])
        if event["type"] == "steering_delivered" and event["message_id"] == message_id:
            return str(event["turn"])
    return None


def _ended(events: list[dict[str, Any]], turn: str | None) -> dict[str, Any] | None:
    return next((e for e in events if e["type"] == "turn_end" and e["turn"] == turn), None)


async def _collect_until_answered(watcher: OperatorClient, events: list[dict[str, Any]],
                                  message_id: str, text: str) -> None:
    """Follows the desk's events, from the first one, until the turn with the message ends,
    or fails: a failed turn publishes ``error`` and no ``turn_end`` (the desk retries in a new
    turn), and the test refuses an error in its turn anyway, so it stops there at once rather
    than waiting out its deadline."""
    async with contextlib.aclosing(watcher.events(desk=DESK, after=0)) as stream:
        async for event in stream:
            if event.id is None:
                continue
            events.append(event.data)
            if event.data["type"] not in ("turn_end", "error"):
                continue
            turn = _our_turn(events, message_id, text)
            if turn is not None and event.data.get("turn") == turn:
                return


async def _the_page_opens_with_the_banner_token(log: str) -> str:
    """The banner's address serves the page; its token (in the file the banner names: the
    output is not a terminal) opens the API, nothing else does. Returns the token."""
    found = re.search(r"web page: (http://127\.0\.0\.1:(\d+)/)#token=<the token in (\S+)>",
                      log)
    assert found is not None, log[-3000:]
    url, port = found.group(1), int(found.group(2))
    token = (await anyio.Path(found.group(3)).read_text()).strip()
    assert len(token) >= 40
    assert 8765 <= port < 8775  # the demo's port, or one of the next nine when it is taken
    assert token not in log  # never in the output (the journal, under systemd)
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        page = await client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert (await client.get("/api/desks")).status_code == 401
        wrong = await client.get("/api/desks", headers={"Authorization": "Bearer not-it"})
        assert wrong.status_code == 401
        desks = await client.get("/api/desks", headers={"Authorization": f"Bearer {token}"})
        assert desks.status_code == 200
        assert [desk["name"] for desk in desks.json()["desks"]] == ["momentum", "review"]
    return token


async def _wait_for_banner(daemon: DaemonProcess, within: float) -> str:
    with anyio.fail_after(within):
        while "trading-agent events --follow" not in daemon.log():  # noqa: ASYNC110
            await anyio.sleep(0.1)
    return daemon.log()


@pytest.mark.timeout(420)
async def test_the_demo_daemon_answers_an_operator_with_the_local_model(
        model_cache: Path) -> None:
    with short_dir() as folder:
        daemon = DaemonProcess(_demo_copy(folder), environ={
            "TRADING_AGENT_DAEMON__STATE_DIR": str(folder / "state"),
            "TRADING_AGENT_MODEL__CACHE_DIR": str(model_cache),
            # One llama.cpp thread: its threads spin at each step's barrier, and on a busy
            # two-core machine two of them run ~3x slower than one (measured).
            "TRADING_AGENT_MODEL__THREADS": "1",
            # As on a newcomer's machine: no token set, so the daemon makes one.
            "TRADING_AGENT_OPERATOR_TOKEN": "",
        })
        try:
            await daemon.wait_ready(within=240)  # assembles the model, loads it, starts desks
            log = await _wait_for_banner(daemon, within=30)
            # How to watch and steer, with the socket (not the default ./state here).
            socket = f"--socket {daemon.socket_path}"
            for command in ("desks", f"chat {DESK}", "events --follow"):
                assert f"trading-agent {command} {socket}" in log, log[-3000:]
            assert "momentum, review" in log
            token = await _the_page_opens_with_the_banner_token(log)

            async with daemon.client() as client:
                assert [desk["name"] for desk in await client.desks()] == ["momentum", "review"]

            events: list[dict[str, Any]] = []
            text = f"Operator check {uuid.uuid4().hex[:8]}: what is the BTC/USDT price now?"
            async with daemon.client() as watcher, daemon.client() as client:
                sent = await client.send_message(DESK, text)
                assert sent["delivery"] in ("turn", "steering")
                # From the first event: a steered turn began before the message.
                try:
                    with anyio.fail_after(300):
                        await _collect_until_answered(watcher, events, sent["id"], text)
                except TimeoutError:
                    pytest.fail(f"no answer; the desk's last events: {events[-20:]}\n"
                                f"the daemon's log:\n{daemon.log()[-4000:]}")

                turn = _our_turn(events, sent["id"], text)
                mine = [e for e in events if e.get("turn") == turn]
                kinds = [e["type"] for e in mine]
                assert turn is not None and "error" not in kinds, (
                    f"{mine}\nthe daemon's log:\n{daemon.log()[-4000:]}")
                end = _ended(events, turn)
                assert end is not None
                assert kinds.count("model_request") >= end["rounds"] >= 1
                assert not end["stopped"]
                assert isinstance(end["final_text"], str)
                # The local server reports real token counts on every answer, and each answer
                # keeps to the demo's max_output_tokens (256; plus the few tokens in which the
                # model chose between a message and a call).
                usages = [e for e in mine if e["type"] == "usage"]
                assert usages and all(u["input_tokens"] > 0 and not u["estimated"]
                                      and u["output_tokens"] <= 256 + 64 for u in usages)
                # A round repeats the round before it: the model, which the other desk also
                # asks, read most of it already (it set this desk's context aside and brought
                # it back). Any one such round will do: a compaction, or an old tool result
                # shortened as the window fills, rewrites the conversation in between.
                if len(usages) > 1 and not any(k.startswith("compaction") for k in kinds):
                    assert any(later["cached_input_tokens"] >= earlier["input_tokens"] // 2
                               for earlier, later in itertools.pairwise(usages)), usages
                # A tool call the model asked for was run, and its result came back.
                calls = {e["call_id"]: e["name"] for e in mine if e["type"] == "tool_call"}
                results = {e["call_id"]: e["name"] for e in mine if e["type"] == "tool_result"}
                assert results == calls
                if end["rounds"] > 1:
                    assert calls, "a turn only goes on to a second round after tool calls"
                # The text the model wrote streamed as it came.
                if end["final_text"].strip() and not end["hit_round_limit"]:
                    streamed = "".join(e["text"] for e in mine if e["type"] == "text_delta")
                    assert end["final_text"] in streamed

                transcript = await client.transcript(DESK, limit=500)
                ids = [message["id"] for message in transcript]
                assert sent["id"] in ids
                after = transcript[ids.index(sent["id"]) + 1:]
                assert any(message["role"] == "assistant" for message in after)

            daemon.signal(signal.SIGTERM)
            assert await daemon.wait_exit(within=30) == 0, daemon.log()[-3000:]
            assert token not in daemon.log()  # a whole run's output: never there
        finally:
            daemon.close()

        # Everything the operator saw is in the store, after the daemon is gone.
        async with await Store.open(database_path(folder / "state")) as store:
            stored = await store.events.events_since(0, DESK, limit=100_000)
            stored_kinds = [e["type"] for e in stored if e.get("turn") == turn]
            assert {"turn_start", "model_request", "usage", "turn_end"} <= set(stored_kinds)
            assert stored_kinds.count("tool_call") == stored_kinds.count("tool_result") == len(
                calls)
            kept = await store.transcripts.transcript(DESK, limit=1000)
            assert sent["id"] in [message["id"] for message in kept]
