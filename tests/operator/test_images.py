"""Pictures an operator sends, and the desk's charts, reach the model at the desk's limits.

A real daemon in this process (the wiring ``trading-agent run`` uses: store, supervisor, paper
desk on the replay, operator API on its Unix socket) whose model is the scripted server. What
the model received is read back from the recorded requests and decoded with pillow. Bad
pictures are refused by the API with the limit named, and nothing of them is stored. Only the
four newest pictures, an operator's and the charts mixed, are ever sent.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import ByteReceiveStream, Process
from PIL import Image

from tests.agent.test_image_preparer import chart, noise
from tests.agent.test_randomized_conversations import wire_images
from tests.daemon_config import write_daemon_config
from tests.operator.harness import InProcessDaemon, in_process_daemon, uds_client
from tests.os_user import OS_USER
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, ToolCall
from trading_agent.operator.client import ImageAttachment, OperatorClient

MAX_SIDE = 320
MAX_BYTES = 60_000
MAX_UPLOAD = 200_000


def _config(folder: Path, base_url: str) -> Path:
    return write_daemon_config(
        folder, base_url, model={"context_window": 64000},
        operator={"max_image_bytes": MAX_UPLOAD},
        desks={"alpha": {"system_prompt": "You are alpha.",
                         "tools": ["render_chart", "get_ticker"], "maximum_rounds": 6,
                         "images": {"max_side": MAX_SIDE, "max_bytes": MAX_BYTES}}})


def _running(folder: Path, base_url: str) -> contextlib.AbstractAsyncContextManager[
        InProcessDaemon]:
    """The daemon's store, desks and API running, as ``run`` runs them (without signals)."""
    return in_process_daemon(_config(folder, base_url))


def _png(width: int, height: int, seed: int = 1) -> bytes:
    return chart(width, height, seed=seed)


def _sent_pictures(request: RecordedRequest) -> list[Image.Image]:
    """The pictures of a request, decoded from their data: URLs."""
    pictures: list[Image.Image] = []
    for message in request.messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") == "image_url":
                url = part["image_url"]["url"]
                head, _, data = url.partition(",")
                assert head in ("data:image/png;base64", "data:image/jpeg;base64"), head
                raw = base64.b64decode(data)
                assert len(raw) <= MAX_BYTES
                image = Image.open(io.BytesIO(raw))
                image.load()
                pictures.append(image)
    return pictures


async def _wait_turn_end(client: OperatorClient, count: int = 1) -> None:
    with anyio.fail_after(20):
        async for event in client.events(desk="alpha", after=0):
            if event.type == "turn_end":
                count -= 1
                if count == 0:
                    return


async def test_an_operators_picture_reaches_the_model_at_the_desks_limits(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("A rising channel; I would wait for the breakout."))
    async with _running(state_dir, scripted_server.base_url) as running, \
            OperatorClient(socket_path=running.endpoints.socket_path) as client:
        sent = await client.send_message(
            "alpha", "What do you make of this?",
            images=[ImageAttachment(_png(1600, 900), "image/png", "btc 4h.png")])
        assert sent["delivery"] == "turn"
        await _wait_turn_end(client)
        transcript = await client.transcript("alpha")

    [request] = scripted_server.requests
    [picture] = _sent_pictures(request)
    assert picture.size == (MAX_SIDE, 180)  # 1600 × 900, scaled to the longest side
    operator_message = request.messages[-1]
    text = operator_message["content"][0]["text"]
    assert text == f"[Message from {OS_USER}, a human operator]\nWhat do you make of this?"
    # The store keeps the sized picture, named for the placeholder that will replace it.
    [stored] = [m for m in transcript if m["kind"] == "operator"]
    [block] = [b for b in stored["content"] if b["type"] == "image"]
    assert block["description"] == f"picture from {OS_USER} (btc 4h.png)"
    assert block["size"] <= MAX_BYTES
    scripted_server.assert_complete()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bmp() -> bytes:
    return chart(300, 200, image_format="BMP")


def _huge_bilevel() -> bytes:
    buffer = io.BytesIO()
    Image.new("1", (8000, 7000)).save(buffer, format="PNG")
    return buffer.getvalue()


REFUSALS: list[tuple[str, dict[str, Any], int, str, str]] = [
    # (case, body, status, code, message)
    ("not base64", {"text": "look", "images": [{"media_type": "image/png", "data": "@@@"}]},
     400, "not_an_image", "images[0].data is not base64"),
    ("not a picture", {"text": "look", "images": [
        {"media_type": "image/png", "data": _b64(b"%PDF-1.7 statement")}]},
     400, "not_an_image", "the picture was refused: not a readable picture: no known picture "
                          "format"),
    ("a BMP", {"text": "look", "images": [{"media_type": "image/png", "data": _b64(_bmp())}]},
     400, "unsupported_image",
     "the picture was refused: the picture is a BMP; send GIF, JPEG, PNG, WebP"),
    ("declared BMP", {"text": "look", "images": [
        {"media_type": "image/bmp", "data": _b64(_bmp())}]},
     400, "unsupported_image", "images[0]: media_type 'image/bmp' is not accepted; send "
                               "image/png, image/jpeg, image/gif, image/webp"),
    ("too large", {"text": "look", "images": [
        {"media_type": "image/png", "data": _b64(noise(300, 300))}]},
     413, "image_too_large", f"the limit is {MAX_UPLOAD:,} bytes (operator.max_image_bytes)"),
    ("too many pixels", {"text": "look", "images": [
        {"media_type": "image/png", "data": _b64(_huge_bilevel())}]},
     413, "image_too_large", "the picture is 8000 × 7000 pixels; the most that can be opened"),
    ("five pictures", {"text": "look", "images": [
        {"media_type": "image/png", "data": _b64(_png(40, 40))}] * 5},
     400, "invalid_body", "images: List should have at most 4 items"),
    ("over the body cap", {"text": "look", "images": [
        {"media_type": "image/png", "data": "A" * 1_200_000}]},
     413, "body_too_large", f"at most 4 pictures of at most {MAX_UPLOAD:,} bytes each "
                            "(operator.max_image_bytes)"),
    ("nothing at all", {"text": " ", "images": []}, 400, "empty_message", "the message is empty"),
]


async def test_bad_pictures_are_refused_with_the_limit_named_and_nothing_is_stored(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    async with _running(state_dir, scripted_server.base_url) as running:
        socket_path = running.endpoints.socket_path
        answers = []
        async with uds_client(socket_path) as http:
            for case, body, _, _, _ in REFUSALS:
                response = await http.post("/api/desks/alpha/messages", json=body)
                answers.append((case, response.status_code, response.json()["error"]))
        store = running.daemon.store
        undelivered = await store.inbox.undelivered_operator_messages("alpha")
        async with OperatorClient(socket_path=socket_path) as client:
            transcript = await client.transcript("alpha")
            desk = await client.desk("alpha")

    for (case, _, status, code, message), (_, got_status, error) in zip(
            REFUSALS, answers, strict=True):
        assert (got_status, error["code"]) == (status, code), (case, error)
        assert message in error["message"], (case, error["message"])
    assert undelivered == [] and transcript == []
    assert desk["state"] == "idle" and desk["last_turn_at"] is None
    assert scripted_server.requests == []


async def test_only_the_four_newest_pictures_are_sent_operator_pictures_and_charts_mixed(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    chart_call = Reply(tool_calls=[ToolCall("render_chart", {"symbol": "BTC/USDT",
                                                             "timeframe": "1h"})])
    scripted_server.add(chart_call, chart_call, chart_call,
                        Reply("Both of yours and my three charts agree: a range."))
    pictures = [ImageAttachment(_png(900, 600, 1), "image/png", "first.png"),
                ImageAttachment(_png(600, 900, 2), "image/png", "second.png")]
    async with _running(state_dir, scripted_server.base_url) as running, \
            OperatorClient(socket_path=running.endpoints.socket_path) as client:
        await client.send_message("alpha", "Compare with your charts.",
                                  images=pictures)
        await _wait_turn_end(client)

    requests = scripted_server.requests
    assert [wire_images(r.json) for r in requests] == [2, 3, 4, 4]
    sizes = [[p.size for p in _sent_pictures(r)] for r in requests]
    assert sizes[0] == [(MAX_SIDE, 213), (213, MAX_SIDE)]
    # Each chart, drawn at 1200 × 700, arrives at the desk's configured size.
    assert sizes[3][1:] == [(MAX_SIDE, 187)] * 3
    # The oldest picture, the operator's first, is a placeholder naming it in the last call.
    last = json.dumps(requests[3].json)
    assert f"[image removed to save space: picture from {OS_USER} (first.png)]" in last
    assert f"picture from {OS_USER} (second.png)" not in last  # still sent as a picture
    assert sizes[3][0] == (213, MAX_SIDE)
    scripted_server.assert_complete()


# --------------------------------------------------------------------------- the chat CLI


async def _read_until(stream: ByteReceiveStream, seen: list[str], text: str) -> str:
    """Reads the CLI's output until ``text`` shows (bounded by the caller)."""
    while text not in (output := "".join(seen)):
        seen.append((await stream.receive()).decode(errors="replace"))
    return output


async def _type(process: Process, line: str) -> None:
    assert process.stdin is not None
    await process.stdin.send(line.encode() + b"\n")


@pytest.mark.slow
async def test_chat_sends_a_picture_with_image_and_prints_refusals(
        scripted_server: ScriptedServer, state_dir: Path, tmp_path: Path) -> None:
    scripted_server.add(Reply("That is a clean double bottom."))
    picture = tmp_path / "double bottom.png"
    picture.write_bytes(_png(1200, 800))
    notes = tmp_path / "notes.txt"
    notes.write_text("buy the dip")
    big = tmp_path / "big.png"
    big.write_bytes(noise(300, 300))
    async with _running(state_dir, scripted_server.base_url) as running:
        process = await anyio.open_process(
            [sys.executable, "-m", "trading_agent.cli", "chat", "alpha", "--socket",
             str(running.endpoints.socket_path)],
            env={**os.environ, "NO_COLOR": "1"})
        seen: list[str] = []
        assert process.stdout is not None
        try:
            with anyio.fail_after(30):
                await _read_until(process.stdout, seen, "Connected to alpha")
                await _type(process, "/help")
                await _read_until(process.stdout, seen, "/image PATH [caption]  send a picture")
                await _type(process, f'/image "{picture}" Is this a double bottom?')
                await _read_until(process.stdout, seen, "(sent; it starts a turn)")
                await _read_until(process.stdout, seen, "That is a clean double bottom.")
                await _type(process, f"/image {notes}")
                await _read_until(process.stdout, seen, "Not sent: images[0]: media_type "
                                                        "'text/plain' is not accepted")
                await _type(process, f"/image {big} too big?")
                await _read_until(process.stdout, seen, "Not sent: images[0] is ")
                await _type(process, f"/image {tmp_path / 'missing.png'}")
                output = await _read_until(process.stdout, seen, "Not sent: cannot read ")
                await _type(process, "/quit")
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        transcript = await running.daemon.store.inbox.undelivered_operator_messages("alpha")

    assert "you › [picture double bottom.png, " in output
    assert f"the limit is {MAX_UPLOAD:,} bytes (operator.max_image_bytes)" in output
    assert "No such file or directory" in output
    assert transcript == []
    [request] = scripted_server.requests
    [sent] = _sent_pictures(request)
    assert sent.size == (MAX_SIDE, 213)
    text = request.messages[-1]["content"][0]["text"]
    assert text.endswith("\nIs this a double bottom?")
    scripted_server.assert_complete()
