"""render_chart: a real PNG with a candle per bar, green up and red down, and a summary."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from trading_agent.agent.tool_registry import ToolOutput
from trading_agent.tools.charts import DARK, main, render_chart_png

from .conftest import Desk, packaged_candles

Color = tuple[int, int, int]


def _near(pixel: Color, color: Color) -> bool:
    return sum((a - b) ** 2 for a, b in zip(pixel, color, strict=True)) < 60 ** 2


def candle_columns(image: Image.Image) -> list[str]:
    """The colours of the candles from left to right, read off the price pane's pixels.

    Rows crossed by the dotted last-price line (candle-coloured across the width) are left out.
    """
    rgb = image.convert("RGB")
    width, height = rgb.size
    left, right, top, bottom = 14, width - 78, 62, int(height * 0.76)
    kinds: dict[Color, str | None] = {}

    def kind(pixel: Color) -> str | None:
        if pixel not in kinds:
            kinds[pixel] = ("up" if _near(pixel, DARK.up)
                            else "down" if _near(pixel, DARK.down) else None)
        return kinds[pixel]

    pane = rgb.crop((left, top, right, bottom))
    columns = right - left
    flat = [kind(pixel) for pixel in pane.get_flattened_data()]  # type: ignore[arg-type]
    grid = [flat[row * columns:(row + 1) * columns] for row in range(bottom - top)]
    rows = [row for row in grid if sum(k is not None for k in row) < 0.3 * columns]
    runs: list[str] = []
    previous: str | None = None
    for x in range(columns):
        found = {row[x] for row in rows} - {None}
        current = found.pop() if len(found) == 1 else ("mixed" if found else None)
        if current is not None and current != previous:
            runs.append(current)
        previous = current
    return runs


async def test_render_chart_returns_a_png_the_model_sees_with_a_summary(
        desk: Desk, tmp_path: Path) -> None:
    result = await desk.call("render_chart", limit=60)
    candles = packaged_candles()[240:300]  # the 60 candles before the replay's present
    low, high = min(c.low for c in candles), max(c.high for c in candles)
    change = candles[-1].close / candles[0].open - 1

    assert isinstance(result, ToolOutput)
    assert result.text == (
        f"Chart of BTC/USDT 5m, 60 candles from 2023-01-03 12:45 UTC to 2023-01-03 17:40 UTC: "
        f"last 16,612.00, range {low:,.2f}–{high:,.2f}, change {change * 100:+.2f}%.")
    [image] = result.images
    assert image.media_type == "image/png"
    assert image.description == "BTC/USDT 5m candlestick chart to 2023-01-03 17:40 UTC"
    path = tmp_path / "render_chart.png"
    path.write_bytes(image.data)
    with Image.open(path) as png:
        assert png.format == "PNG"
        assert png.size == (1200, 700)
        columns = candle_columns(png)

    expected = ["up" if c.close >= c.open else "down" for c in candles]
    assert columns == expected  # one bar per candle, each in its direction's colour


def test_a_chart_needs_two_candles() -> None:
    with pytest.raises(ValueError, match="at least two candles"):
        render_chart_png(packaged_candles()[:1])


def test_the_command_line_writes_the_readme_chart(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "docs" / "chart.png"

    main(["--out", str(out), "--timeframe", "1h", "--candles", "100"])

    with Image.open(io.BytesIO(out.read_bytes())) as png:
        assert png.size == (1200, 700)
        columns = candle_columns(png)
    assert {"up", "down"} <= set(columns)
    assert len(columns) > 50  # bars, not a blank or a single block
    assert "wrote" in capsys.readouterr().out
