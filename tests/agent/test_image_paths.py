"""Every picture a tool returns is sized by the executor's preparer, and an operator's picture
must be a PNG, JPEG, GIF or WebP of a size that can be opened: real pillow, real pictures."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from pydantic import BaseModel

from tests.agent.test_image_preparer import chart
from trading_agent.agent.conversation import ImageBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ToolResultReady
from trading_agent.agent.image_preparer import (
    MAX_PIXELS,
    OPERATOR_FORMATS,
    ImageLimits,
    ImagePreparer,
    ImageRejectedError,
)
from trading_agent.agent.tool_call_executor import ExecutedCall, ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolOutput, ToolRegistry


def _size(block: ImageBlock) -> tuple[int, int]:
    with Image.open(io.BytesIO(block.data)) as image:
        return image.size


# --------------------------------------------------------------------------- operator formats


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "GIF", "WEBP"])
def test_an_operator_may_send_png_jpeg_gif_and_webp(image_format: str) -> None:
    block = ImagePreparer(ImageLimits(max_side=200)).prepare(
        chart(600, 300, image_format=image_format), "from carol", formats=OPERATOR_FORMATS)
    assert _size(block) == (200, 100)
    assert block.media_type in ("image/png", "image/jpeg")


def test_another_format_from_an_operator_is_refused_naming_the_formats() -> None:
    with pytest.raises(ImageRejectedError) as refused:
        ImagePreparer().prepare(chart(300, 200, image_format="BMP"), formats=OPERATOR_FORMATS)
    assert refused.value.code == "unsupported_image" and not refused.value.too_large
    assert str(refused.value) == "the picture is a BMP; send GIF, JPEG, PNG, WebP"


def test_bytes_that_are_no_picture_are_refused_as_such() -> None:
    with pytest.raises(ImageRejectedError) as refused:
        ImagePreparer().prepare(b"%PDF-1.7 a statement", formats=OPERATOR_FORMATS)
    assert refused.value.code == "not_an_image"
    assert str(refused.value) == "not a readable picture: no known picture format"


def test_a_picture_with_too_many_pixels_is_refused_before_it_is_decoded() -> None:
    buffer = io.BytesIO()
    Image.new("1", (8000, 7000)).save(buffer, format="PNG")  # small file, 56 megapixels
    with pytest.raises(ImageRejectedError) as refused:
        ImagePreparer().prepare(buffer.getvalue(), formats=OPERATOR_FORMATS)
    assert refused.value.too_large
    assert str(refused.value) == (f"the picture is 8000 × 7000 pixels; the most that can be "
                                  f"opened is {MAX_PIXELS:,} pixels")


# --------------------------------------------------------------------------- tool pictures


class _Nothing(BaseModel):
    pass


async def test_the_executor_sizes_every_picture_a_tool_returns() -> None:
    preparer = ImagePreparer(ImageLimits(max_side=500, max_bytes=40_000))
    seen: list[ImagePreparer | None] = []
    registry = ToolRegistry()

    @registry.tool(description="A big chart and a broken one.")
    async def draw(arguments: _Nothing, context: ToolContext) -> ToolOutput:
        seen.append(context.image_preparer)
        return ToolOutput("two charts", images=(
            ImageBlock(chart(2000, 1000), "image/png", "BTC/USDT 1h chart"),
            ImageBlock(b"not a png", "image/png", "ETH/USDT 1h chart")))

    bus = EventBus()
    events = bus.subscribe("test")
    executor = ToolCallExecutor(registry, image_preparer=preparer)
    finished: dict[str, ExecutedCall] = {}
    [executed] = await executor.execute([ToolUseBlock("c1", "draw", "{}")], "alpha", "t1",
                                        bus, finished)

    result = executed.result
    [image] = [b for b in result.content if isinstance(b, ImageBlock)]
    assert _size(image) == (500, 250) and len(image.data) <= 40_000
    assert image.description == "BTC/USDT 1h chart"
    assert result.text == ("two charts\n[picture not sent: ETH/USDT 1h chart: not a readable "
                           "picture: no known picture format]")
    assert seen == [preparer]  # a tool that runs a model itself can hand it on
    ready = []
    while (event := events.get_nowait()) is not None:
        if isinstance(event, ToolResultReady):
            ready.append(event)
    assert [(e.image_count, e.text) for e in ready] == [(1, result.text)]


async def test_without_a_preparer_the_default_limits_still_apply() -> None:
    registry = ToolRegistry()

    @registry.tool(description="A huge chart.")
    async def draw(arguments: _Nothing, context: ToolContext) -> ToolOutput:
        return ToolOutput("chart", images=(ImageBlock(chart(3136, 1000), "image/png", "c"),))

    finished: dict[str, ExecutedCall] = {}
    [executed] = await ToolCallExecutor(registry).execute(
        [ToolUseBlock("c1", "draw", "{}")], "alpha", "t1", EventBus(), finished)
    [image] = [b for b in executed.result.content if isinstance(b, ImageBlock)]
    assert _size(image) == (ImageLimits().max_side, 500)
