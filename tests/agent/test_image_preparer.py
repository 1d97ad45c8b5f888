"""Pictures are sized to the model's limits once, and only the four newest are sent.

Sizing runs real pillow on real pictures; pruning is checked on what the scripted server
received: never more than four images, each older one a placeholder naming it, requests
byte-identical when the conversation is the same, originals kept in the conversation.
"""

from __future__ import annotations

import io
import random

import anyio
import anyio.lowlevel
import pytest
from PIL import Image, ImageDraw
from pydantic import BaseModel

from tests.agent.test_randomized_conversations import wire_images, wire_problems
from tests.scripted_server import Reply, ScriptedServer, ToolCall, server_error
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.conversation import (
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.image_preparer import ImageLimits, ImagePreparer
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolOutput, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend, encode_message


def chart(width: int, height: int, *, mode: str = "RGB", seed: int = 1,
          image_format: str = "PNG") -> bytes:
    """A price chart: a random walk drawn on a grid."""
    rng = random.Random(seed)
    image = Image.new(mode, (width, height), "white" if mode != "RGBA" else (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    for x in range(0, width, 40):
        draw.line([(x, 0), (x, height)], fill=(220, 220, 220) if mode != "L" else 220)
    price, points = height / 2, []
    for x in range(0, width, 3):
        price = min(height - 1.0, max(0.0, price + rng.uniform(-6, 6)))
        points.append((x, price))
    draw.line(points, fill=(0, 90, 200) if mode != "L" else 0, width=2)
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def noise(width: int, height: int) -> bytes:
    """A picture PNG cannot compress: random pixels."""
    image = Image.frombytes("RGB", (width, height), random.Random(7).randbytes(width * height * 3))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def opened(block: ImageBlock) -> Image.Image:
    return Image.open(io.BytesIO(block.data))


# --------------------------------------------------------------------------- sizing


def test_a_picture_that_fits_is_kept_byte_for_byte() -> None:
    data = chart(800, 500)
    block = ImagePreparer().prepare(data, "chart BTC/USDT 5m")
    assert block.data == data
    assert (block.media_type, block.description) == ("image/png", "chart BTC/USDT 5m")


def test_a_large_picture_is_scaled_to_the_longest_side() -> None:
    block = ImagePreparer(ImageLimits(max_side=1000)).prepare(chart(3000, 1500))
    assert opened(block).size == (1000, 500)
    assert block.media_type == "image/png"


def test_a_picture_over_the_byte_limit_becomes_a_smaller_jpeg() -> None:
    data = noise(900, 900)
    assert len(data) > 2_000_000
    block = ImagePreparer(ImageLimits(max_bytes=150_000)).prepare(data)
    assert block.media_type == "image/jpeg"
    assert len(block.data) <= 150_000
    assert opened(block).format == "JPEG"


def test_transparency_becomes_white_in_a_jpeg() -> None:
    image = Image.new("RGBA", (600, 600), (0, 0, 0, 0))
    image.paste(Image.frombytes("RGBA", (300, 300), random.Random(3).randbytes(300 * 300 * 4)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    block = ImagePreparer(ImageLimits(max_bytes=60_000)).prepare(buffer.getvalue())
    assert block.media_type == "image/jpeg"
    corner = opened(block).convert("RGB").getpixel((590, 590))
    assert isinstance(corner, tuple) and min(corner) > 240


@pytest.mark.parametrize("image_format", ["GIF", "BMP", "WEBP"])
def test_other_formats_are_encoded_once_as_png(image_format: str) -> None:
    block = ImagePreparer().prepare(chart(300, 200, image_format=image_format))
    assert block.media_type == "image/png" and opened(block).format == "PNG"


def test_bytes_that_are_not_a_picture_are_refused() -> None:
    with pytest.raises(ValueError, match="not a readable picture"):
        ImagePreparer().prepare(b"<html>not a chart</html>")


async def test_preparing_in_a_thread_gives_the_same_block() -> None:
    data = chart(2400, 1200)
    preparer = ImagePreparer()
    assert await preparer.prepare_async(data, "c") == preparer.prepare(data, "c")


# --------------------------------------------------------------------------- pruning


def _picture(number: int) -> ImageBlock:
    return ImageBlock(f"png {number}".encode(), "image/png", f"chart {number}")


def _conversation_with_six_pictures() -> list[Message]:
    messages: list[Message] = [Message(role="user", kind="operator", content=(
        TextBlock("Look at these"), _picture(1), _picture(2)))]
    for number in range(3, 7):
        call = ToolUseBlock(f"c{number}", "get_chart", "{}")
        messages.append(Message(role="assistant", content=(call,)))
        messages.append(Message(role="user", kind="tool_results", content=(ToolResultBlock(
            call.id, (TextBlock(f"chart {number} attached"), _picture(number))),)))
    return messages


def test_only_the_four_newest_pictures_stay_and_older_ones_become_placeholders() -> None:
    messages = _conversation_with_six_pictures()
    pruned = ImagePreparer().prune(messages)
    assert sum(m.image_count for m in pruned) == 4
    assert pruned[0].text == ("Look at these\n[image removed to save space: chart 1]\n"
                              "[image removed to save space: chart 2]")
    assert all(a is b for a, b in zip(pruned[1:], messages[1:], strict=True))
    assert messages[0].image_count == 2  # the original is untouched
    newer = ImagePreparer().prune([*messages, *_conversation_with_six_pictures()[3:7]])
    tool_result = newer[4].tool_results[0]
    assert tool_result.text == "chart 4 attached\n[image removed to save space: chart 4]"


def test_pruning_is_deterministic_and_memoized() -> None:
    messages = _conversation_with_six_pictures()
    first = ImagePreparer().prune(messages)
    second = ImagePreparer().prune(messages)
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert [encode_message(m) for m in first] == [encode_message(m) for m in second]


# --------------------------------------------------------------------------- on the wire


class SymbolArguments(BaseModel):
    symbol: str


async def test_the_server_never_gets_more_than_four_pictures(
        scripted_server: ScriptedServer) -> None:
    preparer = ImagePreparer()
    pictures = [preparer.prepare(chart(1200, 700, seed=n), f"chart {n} of BTC/USDT")
                for n in range(1, 8)]
    registry = ToolRegistry()
    served = iter(pictures)

    @registry.tool(description="A price chart.")
    async def get_chart(arguments: SymbolArguments, context: ToolContext) -> ToolOutput:
        picture = next(served)
        return ToolOutput(f"{picture.description} attached", images=(picture,))

    chart_call = Reply(tool_calls=[ToolCall("get_chart", {"symbol": "BTC/USDT"})])
    scripted_server.add(*([chart_call] * 7), server_error(503), Reply("Seven charts seen."))
    conversation = Conversation("You are alpha.")
    config = OpenAIBackendConfig(base_url=scripted_server.base_url, model="scripted-model",
                                 context_window=200_000, request_timeout=10)
    async with OpenAICompatibleBackend(config) as backend:
        loop = AgentLoop("alpha", backend, ToolCallExecutor(registry), EventBus(),
                         maximum_rounds=10, image_preparer=preparer)

        async def no_sleep(delay: float) -> None:
            await anyio.lowlevel.checkpoint()

        loop.retry_policy.sleep = no_sleep
        result = await loop.run_turn(conversation, Trigger(kind="tick", text="BTC moved"))
    assert result.text == "Seven charts seen."
    requests = scripted_server.requests
    assert [wire_images(r.json) for r in requests] == [0, 1, 2, 3, 4, 4, 4, 4, 4]
    assert all(wire_problems(r.json, 200_000) == [] for r in requests)
    # The 503 was retried with the very same bytes: the same conversation, the same request.
    assert requests[7].body == requests[8].body
    last = requests[8].messages
    tool_texts = [m["content"] for m in last if m["role"] == "tool"]
    assert tool_texts[0] == ("chart 1 of BTC/USDT attached\n"
                             "[image removed to save space: chart 1 of BTC/USDT]")
    assert tool_texts[-1].endswith("[image attached in the next message]")
    # The conversation (and so the store) keeps every original.
    assert sum(m.image_count for m in conversation.messages) == 7
    scripted_server.assert_complete()
