"""``render_chart``'s picture reaches the model at the desk's configured size: the executor
sizes it with the desk's preparer (the chart itself is drawn at 1200 × 700)."""

from __future__ import annotations

import io

from PIL import Image

from tests.tools.conftest import Desk
from trading_agent.agent.conversation import ImageBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.image_preparer import ImageLimits, ImagePreparer
from trading_agent.agent.tool_call_executor import ExecutedCall, ToolCallExecutor


async def test_a_chart_is_sized_to_small_configured_limits(desk: Desk) -> None:
    limits = ImageLimits(max_side=400, max_bytes=20_000)
    executor = ToolCallExecutor(desk.registry, image_preparer=ImagePreparer(limits))
    call = ToolUseBlock("c1", "render_chart", '{"symbol": "BTC/USDT", "timeframe": "1h"}')
    finished: dict[str, ExecutedCall] = {}
    [executed] = await executor.execute([call], "alpha", "t1", EventBus(), finished)

    result = executed.result
    assert not result.is_error, result.text
    assert result.text.startswith("Chart of BTC/USDT 1h, ")
    [image] = [b for b in result.content if isinstance(b, ImageBlock)]
    with Image.open(io.BytesIO(image.data)) as opened:
        assert max(opened.size) <= 400
        assert opened.size[0] == 400  # the 1200 × 700 chart scaled, not cropped
        assert abs(opened.size[1] - 233) <= 3
    assert len(image.data) <= 20_000
    assert image.description.startswith("BTC/USDT 1h candlestick chart to ")
