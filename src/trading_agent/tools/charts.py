"""Candlestick charts drawn with pillow, and the ``render_chart`` tool that shows them to the model.

A chart is a dark-theme PNG: the title (symbol, timeframe, exchange) with the last candle's
OHLC and the change over the window, a price pane with candles, two EMAs and the last price
marked on the right-hand axis, a volume pane under it, and time labels along the bottom.
It is drawn at twice its size and scaled down, which smooths the lines and the text.

Drawing happens in a worker thread (``anyio.to_thread``), never on the event loop.

Run ``python -m trading_agent.tools.charts --out docs/chart.png`` for a chart of the packaged
candles.
"""

from __future__ import annotations

import argparse
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from functools import cache
from pathlib import Path

import anyio
from PIL import Image, ImageDraw, ImageFont
from pydantic import Field

from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.tool_registry import ToolContext, ToolOutput, ToolRegistry
from trading_agent.errors import ToolError
from trading_agent.tools.market import TIMEFRAME_PATTERN, SymbolArguments
from trading_agent.tools.text import format_time, readable_errors, resolve_symbol
from trading_agent.trading.exchange import Candle, Exchange
from trading_agent.trading.formatting import format_percent, format_price

__all__ = ["DARK", "ChartArguments", "ChartTheme", "register_chart_tool", "render_chart_png"]

_SCALE = 2  # drawn at twice the size, then scaled down with a good filter
_WARMUP = 50  # candles fetched before the chart's first, to seed the averages


@dataclass(frozen=True)
class ChartTheme:
    """The colours of a chart (RGB)."""

    background: tuple[int, int, int] = (19, 23, 34)
    grid: tuple[int, int, int] = (36, 41, 56)
    axis_text: tuple[int, int, int] = (140, 146, 163)
    title: tuple[int, int, int] = (232, 234, 240)
    up: tuple[int, int, int] = (38, 166, 154)
    down: tuple[int, int, int] = (239, 83, 80)
    fast_average: tuple[int, int, int] = (255, 183, 77)
    slow_average: tuple[int, int, int] = (100, 149, 237)


DARK = ChartTheme()


class ChartArguments(SymbolArguments):
    """What to chart."""

    timeframe: str = Field(default="5m", pattern=TIMEFRAME_PATTERN,
                           description="Candle length: 5m, 15m, 1h, 4h, 1d")
    limit: int = Field(default=120, ge=20, le=300, description="How many candles")


@cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _nice_step(span: float, target: int) -> float:
    """A round step (1, 2, 2.5 or 5 × 10ⁿ) giving about ``target`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / max(target, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    return next(float(m * power) for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def _ema(values: Sequence[float], period: int) -> list[float | None]:
    if len(values) < period:
        return [None] * len(values)
    alpha = 2 / (period + 1)
    result: list[float | None] = [None] * (period - 1)
    average = sum(values[:period]) / period
    result.append(average)
    for value in values[period:]:
        average = alpha * value + (1 - alpha) * average
        result.append(average)
    return result


def _blend(color: tuple[int, int, int], background: tuple[int, int, int],
           opacity: float) -> tuple[int, int, int]:
    r, g, b = (round(c * opacity + k * (1 - opacity)) for c, k in zip(color, background,
                                                                        strict=True))
    return (r, g, b)


def _label_interval(candle_minutes: float, slot_pixels: float) -> int:
    """A round time between labels, in minutes, leaving about 110 px between them."""
    for minutes in (15, 30, 60, 120, 180, 240, 360, 720, 1440, 2880, 10080, 20160):
        if minutes >= candle_minutes and minutes / candle_minutes * slot_pixels >= 110:
            return minutes
    return 43200


def render_chart_png(candles: Sequence[Candle], *, title: str = "", width: int = 1200,
                     height: int = 700, theme: ChartTheme = DARK,
                     averages: tuple[int, int] = (20, 50),
                     history: Sequence[Candle] = ()) -> bytes:
    """Draws candles as a PNG (blocking; run it in a worker thread).

    Args:
        candles: Oldest first, at least two.
        title: The headline (``BTC/USDT · 5m · paper``).
        width: The image width in pixels.
        height: The image height in pixels.
        theme: The colours.
        averages: The periods of the fast and slow EMA lines.
        history: Earlier candles, not drawn, that seed the averages so their lines span
            the whole chart.

    Returns:
        The PNG bytes.

    Raises:
        ValueError: Fewer than two candles.
    """
    if len(candles) < 2:
        raise ValueError("a chart needs at least two candles")
    s = _SCALE
    image = Image.new("RGB", (width * s, height * s), theme.background)
    draw = ImageDraw.Draw(image)
    small, medium, large = _font(11 * s), _font(13 * s), _font(18 * s)

    # Layout: title band, price pane, gap, volume pane, time axis; price axis on the right.
    left, right = 14 * s, (width - 78) * s
    top = 62 * s
    axis_height = 26 * s
    volume_height = int((height * s - top - axis_height) * 0.2)
    price_bottom = height * s - axis_height - volume_height - 10 * s
    volume_top, volume_bottom = price_bottom + 10 * s, height * s - axis_height

    opens = [float(c.open) for c in candles]
    highs = [float(c.high) for c in candles]
    lows = [float(c.low) for c in candles]
    closes = [float(c.close) for c in candles]
    volumes = [float(c.volume) for c in candles]
    low, high = min(lows), max(highs)
    padding = (high - low) * 0.06 or high * 0.001
    low, high = low - padding, high + padding

    def y_of(price: float) -> float:
        return top + (high - price) / (high - low) * (price_bottom - top)

    slot = (right - left) / len(candles)
    body = max(1 * s, int(slot * 0.68))

    def x_of(index: int) -> float:
        return left + slot * (index + 0.5)

    # Price grid and labels.
    step = _nice_step(high - low, 7)
    tick = math.ceil(low / step) * step
    while tick <= high:
        y = y_of(tick)
        draw.line([(left, y), (right, y)], fill=theme.grid, width=s)
        label = f"{tick:,.{max(0, -math.floor(math.log10(step)) + (1 if step % 1 else 0))}f}"
        draw.text((right + 8 * s, y), label, font=small, fill=theme.axis_text, anchor="lm")
        tick += step

    # Time grid and labels, on round times: midnight shows the date.
    candle_minutes = (candles[1].opened_at - candles[0].opened_at).total_seconds() / 60
    interval = _label_interval(candle_minutes, slot / s)
    for index, candle in enumerate(candles):
        moment = candle.opened_at
        if int(moment.timestamp()) // 60 % interval:
            continue
        x = x_of(index)
        draw.line([(x, top), (x, volume_bottom)], fill=theme.grid, width=s)
        midnight = moment.hour == 0 and moment.minute == 0
        label = f"{moment:%b %d}" if midnight else f"{moment:%H:%M}"
        draw.text((x, volume_bottom + 13 * s), label, font=small,
                  fill=theme.title if midnight else theme.axis_text, anchor="mm")

    # Volume bars.
    top_volume = max(volumes) or 1.0
    for index in range(len(candles)):
        rising = closes[index] >= opens[index]
        color = _blend(theme.up if rising else theme.down, theme.background, 0.45)
        bar_top = volume_bottom - volumes[index] / top_volume * (volume_bottom - volume_top)
        x = x_of(index)
        draw.rectangle([x - body / 2, bar_top, x + body / 2, volume_bottom], fill=color)
    draw.text((left + 4 * s, volume_top + 2 * s), f"Vol  max {top_volume:,.0f}", font=small,
              fill=theme.axis_text, anchor="la")

    # Candles: wick, then body.
    for index in range(len(candles)):
        rising = closes[index] >= opens[index]
        color = theme.up if rising else theme.down
        x = x_of(index)
        draw.line([(x, y_of(highs[index])), (x, y_of(lows[index]))], fill=color, width=s)
        body_top = y_of(max(opens[index], closes[index]))
        body_bottom = max(body_top + s, y_of(min(opens[index], closes[index])))
        draw.rectangle([x - body / 2, body_top, x + body / 2, body_bottom], fill=color)

    # Moving averages.
    legend: list[tuple[str, tuple[int, int, int]]] = []
    seeded = [float(c.close) for c in history] + closes
    for period, color in zip(averages, (theme.fast_average, theme.slow_average), strict=True):
        line = _ema(seeded, period)[len(history):]
        points = [(x_of(i), y_of(v)) for i, v in enumerate(line)
                  if v is not None and low <= v <= high]
        if len(points) > 1:
            draw.line(points, fill=color, width=2 * s, joint="curve")
            legend.append((f"EMA {period} {line[-1]:,.2f}", color))

    # Last price: a dotted line and a tag on the axis.
    last_color = theme.up if closes[-1] >= opens[-1] else theme.down
    y_last = y_of(closes[-1])
    for x in range(int(left), int(right), 8 * s):
        draw.line([(x, y_last), (x + 4 * s, y_last)], fill=last_color, width=s)
    tag = format_price(Decimal(str(closes[-1])))
    box = draw.textbbox((right + 8 * s, y_last), tag, font=small, anchor="lm")
    draw.rectangle([right, box[1] - 3 * s, width * s, box[3] + 3 * s], fill=last_color)
    draw.text((right + 8 * s, y_last), tag, font=small, fill=(255, 255, 255), anchor="lm")

    # Frame of the panes.
    draw.line([(right, top), (right, volume_bottom)], fill=theme.axis_text, width=s)
    draw.line([(left, volume_bottom), (right, volume_bottom)], fill=theme.axis_text, width=s)
    draw.line([(left, volume_top - 5 * s), (right, volume_top - 5 * s)], fill=theme.grid,
              width=2 * s)

    # Title and the last candle's figures.
    change = closes[-1] / opens[0] - 1 if opens[0] else 0.0
    draw.text((left, 12 * s), title, font=large, fill=theme.title, anchor="la")
    x = left
    last = candles[-1]
    for label, value in (("O", last.open), ("H", last.high), ("L", last.low),
                         ("C", last.close)):
        draw.text((x, 40 * s), label, font=medium, fill=theme.axis_text, anchor="la")
        x += draw.textlength(label + " ", font=medium)
        text = format_price(value)
        draw.text((x, 40 * s), text, font=medium, fill=last_color, anchor="la")
        x += draw.textlength(text + "   ", font=medium)
    window = format_percent(Decimal(str(round(change, 6))))
    draw.text((x, 40 * s), f"{window} over {len(candles)} candles", font=medium,
              fill=theme.up if change >= 0 else theme.down, anchor="la")
    x = right
    for text, color in reversed(legend):
        x -= draw.textlength(text, font=medium)
        draw.text((x, 40 * s), text, font=medium, fill=color, anchor="la")
        x -= 18 * s
    stamp = f"{candles[0].opened_at:%Y-%m-%d %H:%M} to {candles[-1].opened_at:%Y-%m-%d %H:%M} UTC"
    draw.text((right, 12 * s), stamp, font=medium, fill=theme.axis_text, anchor="ra")

    output = io.BytesIO()
    image.resize((width, height), Image.Resampling.LANCZOS).save(output, format="PNG")
    return output.getvalue()


def register_chart_tool(registry: ToolRegistry, *, exchange: Exchange,
                        symbols: Sequence[str]) -> None:
    """Registers ``render_chart``: a candlestick chart the model sees, with a short summary.

    Args:
        registry: Where to register it.
        exchange: Where the candles come from.
        symbols: The desk's symbols; the first is the default.
    """

    @registry.tool(description="A candlestick chart (PNG) of a market with volume and EMA "
                               "20/50, returned as an image, with a one-line summary.")
    async def render_chart(arguments: ChartArguments, context: ToolContext) -> ToolOutput:
        symbol = resolve_symbol(arguments.symbol, symbols)
        with readable_errors(f"read {arguments.timeframe} candles of {symbol}"):
            fetched = list(await exchange.fetch_candles(symbol, arguments.timeframe,
                                                        arguments.limit + _WARMUP))
        candles, history = fetched[-arguments.limit:], fetched[:-arguments.limit]
        if len(candles) < 2:
            raise ToolError(f"Not enough {arguments.timeframe} candles of {symbol} to chart.")
        title = f"{symbol} · {arguments.timeframe} · {exchange.name}"
        png = await anyio.to_thread.run_sync(
            lambda: render_chart_png(candles, title=title, history=history))
        first, last = candles[0], candles[-1]
        change = last.close / first.open - 1 if first.open else Decimal(0)
        summary = (f"Chart of {symbol} {arguments.timeframe}, {len(candles)} candles from "
                   f"{format_time(first.opened_at)} to {format_time(last.opened_at)}: last "
                   f"{format_price(last.close)}, range {format_price(min(c.low for c in candles))}"
                   f"–{format_price(max(c.high for c in candles))}, change "
                   f"{format_percent(change)}.")
        description = (f"{symbol} {arguments.timeframe} candlestick chart to "
                       f"{format_time(last.opened_at)}")
        return ToolOutput(text=summary, images=(ImageBlock(png, "image/png", description),))


def main(argv: Sequence[str] | None = None) -> None:
    """Writes a chart of the packaged BTC/USDT candles (for the README)."""
    from trading_agent.trading.config import PACKAGED_CANDLES
    from trading_agent.trading.feed import resample
    from trading_agent.trading.replay import load_candles_csv

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="where to write the PNG")
    parser.add_argument("--timeframe", default="1h", help="candle length (default 1h)")
    parser.add_argument("--candles", type=int, default=120, help="how many (default 120)")
    parser.add_argument("--end", default="2023-01-21T00:00",
                        help="the last candle's open time, UTC (default 2023-01-21T00:00)")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=700)
    options = parser.parse_args(argv)
    end = datetime.fromisoformat(options.end).replace(tzinfo=UTC)
    five_minutes = [c for c in load_candles_csv(PACKAGED_CANDLES, "BTC/USDT")
                    if c.opened_at <= end]
    built = resample(five_minutes, options.timeframe)
    candles, history = built[-options.candles:], built[-options.candles - _WARMUP:-options.candles]
    png = render_chart_png(candles, title=f"BTC/USDT · {options.timeframe} · replay",
                           width=options.width, height=options.height, history=history)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_bytes(png)
    print(f"wrote {options.out} ({len(png):,} bytes, {len(candles)} candles)")


if __name__ == "__main__":
    main()
