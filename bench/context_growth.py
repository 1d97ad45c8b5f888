"""Context growth over a simulated 500-turn desk day, with and without compaction.

Every turn a 5-minute candle closes; the desk asks for a chart (a real ~90 KB PNG drawn with
pillow) and the ticker, then answers. Measured per model request: the tokens sent, as the
server counts them (what it bills), and the bytes of the real OpenAI wire body.

**The server's tokens.** The in-process server counts like a small model's tokenizer
(:class:`ServerTokenizer`: every digit one token, as Gemma's and Llama's tokenizers split
numbers, the other characters four to a token, 800 per image), reports that count as the
usage of every request, and refuses one over the window with a context overflow, as
llama.cpp does. Prices, ids and volumes make a desk's day digit-heavy, so the loop's raw
characters / 4 guess under-counts it; the loop calibrates its count from the reported usage.
For each window the bench prints the error of the estimate the loop used before each
request (``estimated_tokens`` of its ``ModelRequest`` event, calibrated) against the tokens
the server then counted, next to the raw characters / 4 guess's error for the same requests,
and whether any request crossed 70% (the flush mark) or 100% of the window by the server's
count.

- **Reference**: the same day with no compressor and no image pruning (every chart ever
  drawn is sent again with every request), in the same process.
- **Compressed**: the desk as deployed: ``ContextCompressor`` (memory flush at 70%, summary,
  mid-turn summary at 85%) and ``ImagePreparer`` (four newest images), for each window.

In-process: the real ``AgentLoop``, ``ToolCallExecutor``, ``ContextCompressor``,
``ImagePreparer``, ``EventBus`` and the real OpenAI wire encoder
(``OpenAICompatibleBackend.request_body``; no network), with :class:`BenchModel`, an
in-process ``ModelBackend``, playing the model (and the summarizer). Requests do not go
through the scripted HTTP server: the reference day ends with ~45 MB bodies, a thousand of
them.

Prompt caching: for each day it also prints the share of prompt tokens a provider with
automatic prefix caching (OpenAI's) would serve from cache, and the input cost with cached
tokens at a tenth of the input price. A request's cached part is the longest prefix it shares
with any earlier request of the day (same system prompt and tools, then the same messages,
byte for byte on the wire), counted in the server's tokens, when it is at least 1,024
tokens (OpenAI's minimum); no eviction is modelled.

Run: ``.venv/bin/python bench/context_growth.py [--turns 500] [--windows 32000 128000]``
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from PIL import Image, ImageChops, ImageDraw
from pydantic import BaseModel

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.context_compressor import (
    FLUSH_NO_OP,
    FLUSH_TRIGGER_PREFIX,
    ContextCompressor,
    request_tokens,
)
from trading_agent.agent.conversation import (
    IMAGE_TOKEN_COST,
    ContentBlock,
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import ModelRequest
from trading_agent.agent.image_preparer import ImageLimits, ImagePreparer
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolOutput, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend, encode_message
from trading_agent.errors import ContextOverflowError

SYSTEM_PROMPT = (
    "You are the desk alpha, trading BTC/USDT on 5-minute candles. Before each decision look "
    "at the chart and the ticker; keep risk under 1% of equity per trade; explain every "
    "decision in two or three sentences; save what you must not forget with remember."
)
DISTINCT_CHARTS = 24
"""Charts drawn (then cycled): each is a real PNG of its own; drawing 500 would take a minute."""
CACHE_MINIMUM_TOKENS = 1_024
"""The shortest prefix a provider's automatic prompt cache serves (OpenAI's)."""
CACHED_PRICE_SHARE = 0.1
"""A cached prompt token's price, as a share of the input price."""


# --------------------------------------------------------------------------- the chart


def draw_chart(seed: int, width: int = 1200, height: int = 700, candles: int = 160) -> bytes:
    """A candlestick chart with volume, grid and labels on a lightly textured background."""
    rng = random.Random(seed)
    texture = Image.effect_noise((width, height), 64).point(
        lambda v: 255 if v < 250 else 246).convert("RGB")
    image = ImageChops.darker(Image.new("RGB", (width, height), (252, 252, 250)), texture)
    draw = ImageDraw.Draw(image)
    plot_height = int(height * 0.75)
    for y in range(0, plot_height, 50):
        draw.line([(0, y), (width, y)], fill=(228, 228, 228))
    for x in range(0, width, 75):
        draw.line([(x, 0), (x, height)], fill=(232, 232, 232))
    price, bars = 64_000.0, []
    for _ in range(candles):
        close = price + rng.gauss(0, 60)
        high = max(price, close) + abs(rng.gauss(0, 30))
        low = min(price, close) - abs(rng.gauss(0, 30))
        bars.append((price, high, low, close))
        price = close
    low_all, high_all = min(b[2] for b in bars), max(b[1] for b in bars)

    def y_of(value: float) -> float:
        return (high_all - value) / (high_all - low_all) * (plot_height - 20) + 10

    step = width / candles
    for index, (open_, high, low, close) in enumerate(bars):
        middle = index * step + step / 2
        color = (38, 166, 91) if close >= open_ else (214, 69, 65)
        draw.line([(middle, y_of(high)), (middle, y_of(low))], fill=color)
        draw.rectangle([middle - step * 0.35, y_of(max(open_, close)),
                        middle + step * 0.35, y_of(min(open_, close)) + 1], fill=color)
        volume = abs(rng.gauss(0, 1)) * (height - plot_height - 20)
        draw.rectangle([middle - step * 0.35, height - volume, middle + step * 0.35, height],
                       fill=(150, 170, 200))
    for y in range(0, plot_height, 50):
        level = high_all - (high_all - low_all) * y / plot_height
        draw.text((width - 70, y + 2), f"{level:,.0f}", fill=(90, 90, 90))
    draw.text((10, 10), f"BTC/USDT 5m  chart {seed}", fill=(20, 20, 20))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# --------------------------------------------------------------------------- server's tokens

_NO_DIGITS = str.maketrans("", "", "0123456789")


def tokenizer_tokens(text: str) -> int:
    """A text's tokens as a small model's tokenizer counts them: every digit one token, the
    other characters four to a token."""
    others = len(text.translate(_NO_DIGITS))
    return len(text) - others + (others + 3) // 4


class ServerTokenizer:
    """How the bench's server counts a request: :func:`tokenizer_tokens` of the system
    prompt, the tool definitions and every text, name and argument, four tokens of framing
    a message and a call, 800 per image (the loop's own image cost). Memoized per message
    object (the loop memoizes what it sends, so each is counted once)."""

    def __init__(self) -> None:
        self._messages: dict[int, tuple[Message, int]] = {}
        self._heads: dict[str, int] = {}

    def head(self, system_prompt: str, tools: Sequence[dict[str, Any]]) -> int:
        """The request's fixed part: system prompt and tool definitions."""
        text = system_prompt + (json.dumps(list(tools), separators=(",", ":")) if tools
                                else "")
        if text not in self._heads:
            self._heads[text] = 4 + tokenizer_tokens(text)
        return self._heads[text]

    def message(self, message: Message) -> int:
        """One message as sent."""
        known = self._messages.get(id(message))
        if known is not None and known[0] is message:
            return known[1]
        tokens = 4
        for block in message.content:
            if isinstance(block, TextBlock):
                tokens += tokenizer_tokens(block.text)
            elif isinstance(block, ImageBlock):
                tokens += IMAGE_TOKEN_COST
            elif isinstance(block, ToolUseBlock):
                tokens += 4 + tokenizer_tokens(block.name + block.arguments)
            elif isinstance(block, ToolResultBlock):
                tokens += tokenizer_tokens(block.text) + IMAGE_TOKEN_COST * sum(
                    1 for b in block.content if isinstance(b, ImageBlock))
        self._messages[id(message)] = (message, tokens)
        return tokens

    def request(self, request: ModelRequestSpec) -> int:
        """A whole request's prompt tokens."""
        return self.head(request.system_prompt, request.tools) + sum(
            self.message(m) for m in request.messages)


# --------------------------------------------------------------------------- prefix cache


class PrefixCache:
    """What an automatic prefix cache would serve: a trie of every request seen, by the wire
    bytes of its head (system prompt and tools) and then of each message."""

    def __init__(self, tokenizer: ServerTokenizer,
                 minimum_tokens: int = CACHE_MINIMUM_TOKENS) -> None:
        self.tokenizer = tokenizer
        self.minimum_tokens = minimum_tokens
        self._root: dict[object, Any] = {}

    def serve(self, request: ModelRequestSpec, wire: OpenAICompatibleBackend) -> int:
        """The tokens of ``request`` an earlier request's prefix covers (0 under the minimum);
        then remembers ``request``."""
        head = (request.system_prompt, wire.request_body(
            ModelRequestSpec(request.system_prompt, (), request.tools)))
        node = self._root
        matched = 0
        tokens = self.tokenizer.head(request.system_prompt, request.tools)
        still_matching = head in node
        node = node.setdefault(head, {})
        if still_matching:
            matched = tokens
        for message in request.messages:
            key = encode_message(message)  # memoized: bytes whose hash is computed once
            tokens += self.tokenizer.message(message)
            if still_matching and key in node:
                matched = tokens
            else:
                still_matching = False
            node = node.setdefault(key, {})
        return matched if matched >= self.minimum_tokens else 0


# --------------------------------------------------------------------------- the model


@dataclass
class RequestFigures:
    """One request as measured."""

    kind: str
    tokens: int
    wire_bytes: int
    loop_seconds: float
    cached_tokens: int = 0
    """The part of ``tokens`` a provider's automatic prefix cache would serve."""


@dataclass(frozen=True)
class EstimateFigures:
    """One request's size as the loop estimated it and as the server counted it (refused
    requests included)."""

    kind: str
    """``desk``, ``flush`` or ``summary``."""
    server: int
    """The prompt tokens the server counted."""
    raw: int
    """The raw characters / 4 guess (800 per image)."""
    loop: int | None
    """The estimate the loop published before it (calibrated); None for a summary request,
    which the compressor sends without one."""


@dataclass
class BenchModel:
    """An in-process ModelBackend playing a disciplined desk, its memory flush and its
    summarizer; it measures every request (tokens, wire bytes, loop time before it)."""

    model: str
    context_window: int
    wire: OpenAICompatibleBackend
    summary_chars: int
    events: Subscription
    tokenizer: ServerTokenizer = field(default_factory=ServerTokenizer)
    figures: list[RequestFigures] = field(default_factory=list)
    estimates: list[EstimateFigures] = field(default_factory=list)
    prefix_cache: PrefixCache | None = None
    clock: Callable[[], float] = time.perf_counter
    _last_return: float | None = None
    _calls: int = 0

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        entered = self.clock()
        body = self.wire.request_body(request)
        built = self.clock()
        waited = entered - self._last_return if self._last_return is not None else 0.0
        tokens = self._measure(request)
        if tokens + (request.max_output_tokens or 0) > self.context_window:
            self._last_return = self.clock()
            raise ContextOverflowError(
                f"the request needs {tokens + (request.max_output_tokens or 0):,} tokens; "
                f"the model's context is {self.context_window:,}", status_code=400,
                model=self.model)
        kind, content = self._answer(request)
        self.figures.append(RequestFigures(kind, tokens, len(body),
                                           waited + (built - entered)))
        text = "".join(b.text for b in content if isinstance(b, TextBlock))
        if on_text is not None and text:
            on_text(text)
        # Outside the loop's measured time: the provider's work, not the loop's.
        if self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self.tokenizer)
        self.figures[-1].cached_tokens = min(tokens, self.prefix_cache.serve(request, self.wire))
        self._last_return = self.clock()
        return ModelReply(content, Usage(tokens, tokenizer_tokens(text) + 10))

    def _measure(self, request: ModelRequestSpec) -> int:
        """The server's count of the prompt, recorded with the loop's estimate of it: the
        ModelRequest event published since the last request (none before a summary)."""
        published = None
        while (event := self.events.get_nowait()) is not None:
            if isinstance(event, ModelRequest):
                published = event.estimated_tokens
        tokens = self.tokenizer.request(request)
        kind = ("summary" if not request.tools else "flush" if any(
            m.id.startswith(FLUSH_TRIGGER_PREFIX) for m in request.messages) else "desk")
        self.estimates.append(EstimateFigures(kind, tokens, request_tokens(request),
                                              published))
        return tokens

    def _answer(self, request: ModelRequestSpec) -> tuple[str, tuple[ContentBlock, ...]]:
        messages = request.messages
        if not request.tools:
            line = "- BTC/USDT long 0.05 from 64,120, stop 63,700, target 64,900; "
            return "summary", (TextBlock(
                "## Goal\n- grow equity on BTC/USDT 5m swings\n## Positions and open orders\n"
                + (line * (self.summary_chars // len(line)))[: self.summary_chars]
                + "\n## Decisions and why\n- bought the reclaim of 64,000\n## Risks\n"
                  "- a failed retest\n## Next steps\n- trail the stop"),)
        if any(m.id.startswith(FLUSH_TRIGGER_PREFIX) for m in messages):
            if messages[-1].kind == "tool_results":
                return "flush", (TextBlock(FLUSH_NO_OP),)
            return "flush", (self._call("remember", {"note": "long 0.05 BTC from 64,120, "
                                                              "stop 63,700"}),)
        if messages[-1].kind == "tool_results":
            return "desk", (TextBlock(
                "The candle closed above the 20-period mean with rising volume; the chart "
                "shows a higher low at 63,880. I keep the long, move the stop to 63,750 and "
                "watch 64,900 for a partial take-profit. Nothing else to do this candle."),)
        return "desk", (self._call("get_chart", {"symbol": "BTC/USDT", "timeframe": "5m"}),
                        self._call("get_ticker", {"symbol": "BTC/USDT"}))

    def _call(self, name: str, arguments: dict[str, str]) -> ToolUseBlock:
        self._calls += 1
        return ToolUseBlock(f"call_{self._calls}", name, json.dumps(arguments))


# --------------------------------------------------------------------------- the day


class ChartArguments(BaseModel):
    symbol: str
    timeframe: str = "5m"


class TickerArguments(BaseModel):
    symbol: str


class NoteArguments(BaseModel):
    note: str


def desk_tools(charts: Sequence[ImageBlock]) -> ToolRegistry:
    registry = ToolRegistry()
    drawn = iter(range(1, 10**9))

    @registry.tool(description="A candlestick chart of a market, as a PNG.")
    async def get_chart(arguments: ChartArguments, context: ToolContext) -> ToolOutput:
        number = next(drawn)
        picture = charts[number % len(charts)]
        image = ImageBlock(picture.data, picture.media_type,
                           f"{arguments.symbol} {arguments.timeframe} chart #{number}")
        return ToolOutput(f"{arguments.symbol} {arguments.timeframe} chart #{number}, 160 "
                          "candles", images=(image,))

    @registry.tool(description="Last price, bid and ask of a market.")
    async def get_ticker(arguments: TickerArguments, context: ToolContext) -> str:
        return f"{arguments.symbol} last 64,123.5 bid 64,123.0 ask 64,124.0 24h vol 12,345 BTC"

    @registry.tool(description="Saves a note to long-term memory.")
    async def remember(arguments: NoteArguments, context: ToolContext) -> str:
        return "saved"

    return registry


@dataclass
class Day:
    """The figures of one simulated day."""

    label: str
    figures: list[RequestFigures]
    seconds: float
    compactions: int
    estimates: list[EstimateFigures]
    window: int | None


async def run_day(label: str, turns: int, charts: Sequence[ImageBlock], *,
                  window: int | None) -> Day:
    """One day; ``window=None`` is the reference (no compressor, every image sent)."""
    config = OpenAIBackendConfig(base_url="http://127.0.0.1:9/v1", model="bench",
                                 context_window=window or 10**9)
    async with OpenAICompatibleBackend(config) as wire:
        compressor = ContextCompressor(window) if window else None
        bus = EventBus()
        model = BenchModel("bench", config.context_window, wire,
                           summary_chars=(compressor.summary_max_tokens * 3 if compressor
                                          else 0),
                           events=bus.subscribe("bench", max_buffer=10**6,
                                                accept=lambda e: isinstance(e, ModelRequest)))
        preparer = ImagePreparer() if window else ImagePreparer(ImageLimits(keep=10**9))
        loop = AgentLoop("alpha", model, ToolCallExecutor(desk_tools(charts)), bus,
                         maximum_rounds=8, compressor=compressor, image_preparer=preparer)
        conversation = Conversation(SYSTEM_PROMPT)
        started = time.perf_counter()
        for turn in range(turns):
            change = (turn * 37 % 21 - 10) / 10
            await loop.run_turn(conversation, Trigger(
                kind="candle", source="BTC/USDT",
                text=f"5m candle closed at {64_000 + turn * 3:,.1f} ({change:+.1f}%), "
                     f"volume {100 + turn % 50} BTC"))
        seconds = time.perf_counter() - started
    compactions = sum(1 for f in model.figures if f.kind == "summary")
    return Day(label, model.figures, seconds, compactions, model.estimates, window)


# --------------------------------------------------------------------------- report


def _row(day: Day) -> str:
    figures = day.figures
    tokens = [f.tokens for f in figures]
    wire_mb = sum(f.wire_bytes for f in figures) / 1e6
    flushes = sum(1 for f in figures if f.kind == "flush")
    loop_ms = statistics.median(f.loop_seconds for f in figures) * 1000
    median = statistics.median(tokens)
    return (f"{day.label:<26} {len(figures):>5} {max(tokens):>9,} {median:>9,.0f}"
            f" {sum(tokens):>13,} {wire_mb:>10,.1f} {day.compactions:>5} {flushes:>5}"
            f" {loop_ms:>8.2f} {day.seconds:>7.1f}")


async def main(turns: int, windows: Sequence[int]) -> None:
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
          f"{sys.version.split()[0]}")
    drawn = time.perf_counter()
    pngs = [draw_chart(seed) for seed in range(1, DISTINCT_CHARTS + 1)]
    preparer = ImagePreparer()
    charts = [preparer.prepare(png, f"chart {n}") for n, png in enumerate(pngs, 1)]
    assert all(c.data == p for c, p in zip(charts, pngs, strict=True))  # kept as drawn
    sizes = sorted(len(p) for p in pngs)
    print(f"day: {turns} turns, a chart PNG every turn ({sizes[0] // 1000}-{sizes[-1] // 1000} "
          f"KB, {DISTINCT_CHARTS} distinct charts cycled, drawn in "
          f"{time.perf_counter() - drawn:.1f} s); model in-process, real OpenAI wire encoding")
    reference = await run_day("reference (no compaction)", turns, charts, window=None)
    days = [await run_day(f"window {w:,}", turns, charts, window=w) for w in windows]
    print()
    print(f"{'':<26} {'reqs':>5} {'max tok':>9} {'median':>9} {'total tokens':>13} "
          f"{'wire MB':>10} {'summ':>5} {'flush':>5} {'loop ms':>8} {'wall s':>7}")
    print("  (tokens per request, summary and flush requests included; summ/flush = those "
          "requests; loop ms = median time the loop spends on each request, encoding "
          "included)")
    for day in (reference, *days):
        print(_row(day))
    print()
    ref_tokens = [f.tokens for f in reference.figures]
    for day in days:
        tokens = [f.tokens for f in day.figures]
        window = int(day.label.split()[-1].replace(",", ""))
        ratio = statistics.median(ref_tokens) / statistics.median(tokens)
        print(f"{day.label}: total tokens {sum(ref_tokens) / sum(tokens):.1f}x fewer, median "
              f"request {ratio:.1f}x smaller, largest request {max(tokens):,} "
              f"tokens ({max(tokens) / window:.0%} of the window; the reference's largest is "
              f"{max(ref_tokens) / window:.1f}x the window)")
    print_cache_figures(reference, days)
    print_estimate_figures(days)


def _error(estimate: int, server: int) -> float:
    return (estimate - server) / server


def print_estimate_figures(days: Sequence[Day]) -> None:
    """How far the loop's token estimate was from the server's count, and whether any
    request crossed the flush mark or the window by the server's count."""
    print()
    print("the loop's token estimate before each request vs the tokens the server counted "
          "(error = (estimate - server) / server; negative = under-counted; desk and "
          "memory-flush requests, refused ones included)")
    print(f"{'':<26} {'reqs':>5} {'calibrated: mean':>17} {'under':>7} {'over':>7} "
          f"{'chars/4: mean':>14} {'under':>7} {'over':>7} {'>70%':>5} {'>100%':>6} "
          f"{'max share':>10}")
    for day in days:
        assert day.window is not None
        pairs = [(e.loop, e.raw, e.server) for e in day.estimates if e.loop is not None]
        loop_errors = [_error(loop, server) for loop, _, server in pairs]
        raw_errors = [_error(raw, server) for _, raw, server in pairs]
        sizes = [e.server for e in day.estimates]
        over_mark = sum(1 for s in sizes if s > 0.7 * day.window)
        over_window = sum(1 for s in sizes if s > day.window)
        print(f"{day.label:<26} {len(pairs):>5} {statistics.mean(loop_errors):>17.1%} "
              f"{min(loop_errors):>7.1%} {max(loop_errors):>7.1%} "
              f"{statistics.mean(raw_errors):>14.1%} {min(raw_errors):>7.1%} "
              f"{max(raw_errors):>7.1%} {over_mark:>5} {over_window:>6} "
              f"{max(sizes) / day.window:>10.0%}")
        over = [e for e in day.estimates if e.server > 0.7 * day.window]
        if over:
            kinds = sorted({e.kind for e in over})
            print("  over 70% by kind: " + ", ".join(
                f"{kind} {sum(1 for e in over if e.kind == kind)} (largest "
                f"{max(e.server for e in over if e.kind == kind) / day.window:.0%})"
                for kind in kinds))
    print("  (under / over = the worst under-count and over-count; >70% / >100% = requests "
          "of any kind, summaries included, over that share of the window by the server's "
          "count; the server refuses one over 100%, and the loop compacts and replays it; max "
          "share = the largest request's)")


def _input_cost(day: Day, *, cached: bool) -> float:
    """The day's prompt tokens in millions, each priced 1 (cached ones at a tenth when
    ``cached``): the input cost at a price of 1 per million tokens."""
    total = sum(f.tokens for f in day.figures)
    served = sum(f.cached_tokens for f in day.figures) if cached else 0
    return (total - served + served * CACHED_PRICE_SHARE) / 1e6


def print_cache_figures(reference: Day, days: Sequence[Day]) -> None:
    """The share a prefix cache would serve, and what the day's prompts would cost."""
    print()
    print(f"automatic prefix caching (a prefix >= {CACHE_MINIMUM_TOKENS:,} tokens shared with "
          f"an earlier request; cached tokens at {CACHED_PRICE_SHARE:g}x the input price; "
          "cost = prompt tokens priced 1 per million)")
    print(f"{'':<26} {'cached share':>12} {'reqs hit':>9} {'cost, no cache':>15} "
          f"{'with cache':>11} {'saved':>6} {'vs reference':>13}")
    reference_cost = _input_cost(reference, cached=False)
    for day in (reference, *days):
        total = sum(f.tokens for f in day.figures)
        served = sum(f.cached_tokens for f in day.figures)
        hits = sum(1 for f in day.figures if f.cached_tokens)
        plain, cheap = _input_cost(day, cached=False), _input_cost(day, cached=True)
        print(f"{day.label:<26} {served / total:>12.1%} {hits / len(day.figures):>9.0%} "
              f"{plain:>15,.2f} {cheap:>11,.2f} {1 - cheap / plain:>6.0%} "
              f"{cheap / reference_cost:>12.1%}")
        kinds = sorted({f.kind for f in day.figures})
        print("  by kind: " + ", ".join(
            f"{kind} {_share(day, kind):.0%} of "
            f"{sum(f.tokens for f in day.figures if f.kind == kind):,}" for kind in kinds))
    print("  (vs reference = the cached cost as a share of the reference day's cost without "
          "a cache)")
    reference_cached = _input_cost(reference, cached=True)
    for day in days:
        plain, cheap = _input_cost(day, cached=False), _input_cost(day, cached=True)
        print(f"{day.label}: without a cache {reference_cost / plain:.1f}x cheaper than the "
              f"reference; with a cache on both days {reference_cached / cheap:.1f}x cheaper")


def _share(day: Day, kind: str) -> float:
    figures = [f for f in day.figures if f.kind == kind]
    total = sum(f.tokens for f in figures)
    return sum(f.cached_tokens for f in figures) / total if total else 0.0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=500)
    parser.add_argument("--windows", type=int, nargs="+", default=[32_000, 128_000])
    arguments = parser.parse_args()
    anyio.run(main, arguments.turns, arguments.windows)
