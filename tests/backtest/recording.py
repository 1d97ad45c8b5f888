"""What a backtest's model was sent, with the simulated time of each request, and checks that
none of it comes from after that time.

The model sees exactly what the desk's tools produced: tool result texts and chart images,
in the requests. :class:`RequestClock` (a backtest's ``on_progress`` callback) records every
request a :class:`~tests.scripted_server.ScriptedServer` received, with the feed time of the
step during which it was made (the engine runs a step's turns to the end before it calls
``on_progress``, and the clock stands still while the desk thinks). :func:`first_sent` turns
the requests into the texts and images the desk produced, each at the first request that
carried it. The checks raise :class:`LookAheadError`, naming the request, the tool result,
the clock and the value:

- :func:`check_times`: every date and time written is at or before the clock; a tool that
  stamps its answer with the time stamps the clock itself.
- :func:`check_candle_tables` and :func:`check_charts`: every candle a tool shows is the one
  built from the candles closed by the clock (a longer timeframe's last one may be forming:
  built from the closed ones of its bucket); a chart's PNG is byte for byte the chart drawn
  from those candles alone.
- :func:`check_prices`: nothing produced at or before a cut time names a price from the
  range the data takes only after it.
- :func:`check_same_requests`: freqtrade's truncation check: every request made at or before
  the cut is byte for byte the one a run on data cut there made.
- :func:`check_fills`: an order reaches the book at the open of the candle opening at its
  decision. A market order fills there, slipped, with the taker fee, and so does a limit
  order that open already beats; any other limit order fills at its own price, with the
  maker fee, on the first candle from then on that trades through it.
"""

from __future__ import annotations

import base64
import bisect
import csv
import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from tests.scripted_server import ScriptedServer
from trading_agent.backtest.engine import Progress
from trading_agent.backtest.record import BacktestRecord, FillRecord
from trading_agent.tools.charts import render_chart_png
from trading_agent.trading.booked_exchange import STARTING_TURN
from trading_agent.trading.config import PaperExchangeConfig
from trading_agent.trading.exchange import Candle, timeframe_delta
from trading_agent.trading.feed import resample
from trading_agent.trading.formatting import format_price

__all__ = [
    "LookAheadError",
    "RequestClock",
    "Sent",
    "SentRequest",
    "check_candle_tables",
    "check_charts",
    "check_fills",
    "check_prices",
    "check_same_requests",
    "check_times",
    "first_sent",
    "price_range",
    "write_candles",
]

_FULL_TIME = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2})(?::(\d{2}))?")
"""``2023-01-05 10:00`` (format_time, schedules, memory notes) and ISO ``2023-01-05T10:00``."""
_SHORT_TIME = re.compile(r"(?<![\d-])(\d{2})-(\d{2}) (\d{2}):(\d{2})(?!\d)")
"""``01-05 10:00``: candle table rows and ``placed 01-05 10:00 UTC`` of orders (no year)."""
_NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+(?![\w])|\d+)(?:\.\d+)?(?![\w])")
"""A number as the tools write it: ``16,807.50`` in sentences, ``16807.5`` in CSV tables
(where a comma separates fields); digits glued to letters (ids, hashes, ``5m``) are not
numbers."""
_STAMPED = {
    "get_ticker": re.compile(r" · at (\d{4}-\d{2}-\d{2} \d{2}:\d{2}) UTC$"),
    "get_order_book": re.compile(r"^\S+ order book at (\d{4}-\d{2}-\d{2} \d{2}:\d{2}) UTC"),
    "get_balance": re.compile(r"^Balances on \S+ at (\d{4}-\d{2}-\d{2} \d{2}:\d{2}) UTC:"),
}
"""Tools that say when their answer holds: that time is the clock itself."""
_TABLE_HEAD = re.compile(
    r"^(?P<symbol>\S+) (?P<timeframe>\d+[mhdw]): (?P<count>\d+) candles from "
    r"(?P<first>[\d: -]+) UTC to (?P<last>[\d: -]+) UTC \(open times, UTC\)\.")
_CHART_HEAD = re.compile(
    r"^Chart of (?P<symbol>\S+) (?P<timeframe>\d+[mhdw]), (?P<count>\d+) candles from "
    r"(?P<first>[\d: -]+) UTC to (?P<last>[\d: -]+) UTC: last (?P<close>[\d,.]+), range "
    r"(?P<low>[\d,.]+)–(?P<high>[\d,.]+), change")
_TABLE_HEADER = "time,open,high,low,close,volume"
_CUT = re.compile(r"^\[\.\.\. [\d,]+ characters of this \w+ were cut here to fit")
"""The context compressor's note where it cut the middle out of a long old text."""
_IMAGES_OF = re.compile(r"^Images from tool call (?P<call>.+):$")
_CHART_WARMUP = 50
"""Candles ``render_chart`` fetches before the chart's first to seed its averages."""
_EXCERPT = 160


class LookAheadError(AssertionError):
    """Something the model was sent could only be known after the clock it was sent at, or
    a fill used a price nobody knew at the decision."""


# --------------------------------------------------------------------------- recording


@dataclass(frozen=True)
class SentRequest:
    """One chat-completions request, as the scripted server received it.

    Attributes:
        number: 1-based, in the order of the run.
        clock: The simulated time at which it was made.
        body: The JSON body, byte for byte (images included).
    """

    number: int
    clock: datetime
    body: bytes

    @functools.cached_property
    def messages(self) -> list[dict[str, Any]]:
        """The ``messages`` sent."""
        return list(json.loads(self.body)["messages"])

    def where(self) -> str:
        """``request 7 (clock 2023-01-05 10:15 UTC)``."""
        return f"request {self.number} (clock {_stamp(self.clock)})"


class RequestClock:
    """A backtest's ``on_progress`` callback that gives each request its simulated time.

    The requests a scripted server received since the previous step were made during the
    step just taken, at its clock: the engine runs every queued turn to its end before it
    reports the step, and the clock does not move meanwhile.

    Args:
        server: The server the desk's model talks to (it may have served earlier runs).
    """

    def __init__(self, server: ScriptedServer) -> None:
        self._server = server
        self._seen = len(server.requests)
        self.requests: list[SentRequest] = []
        self.steps: list[datetime] = []

    def __call__(self, progress: Progress) -> None:
        """Takes the requests of the step that ended at ``progress.now``."""
        new = self._server.requests[self._seen:]
        self._seen += len(new)
        for request in new:
            self.requests.append(SentRequest(len(self.requests) + 1, progress.now, request.body))
        self.steps.append(progress.now)


@dataclass(frozen=True)
class Sent:
    """A text or an image the desk produced, at the first request that carried it.

    Attributes:
        request: That request.
        what: What it is (``tool result of get_candles (call c1)``, ``user message``).
        tool: The tool that produced it; None for a trigger or operator message.
        call: The tool call's id.
        text: The text (empty for an image).
        image: The image's bytes.
    """

    request: SentRequest
    what: str
    tool: str | None = None
    call: str | None = None
    text: str = ""
    image: bytes | None = None

    @property
    def clock(self) -> datetime:
        """When it was sent (and produced: a turn runs within one step)."""
        return self.request.clock

    def where(self) -> str:
        """``request 7 (clock 2023-01-05 10:15 UTC), tool result of get_ticker (call c1)``."""
        return f"{self.request.where()}, {self.what}"


def first_sent(requests: Sequence[SentRequest]) -> list[Sent]:
    """What the desk produced (tool results, chart images, trigger and operator messages),
    each once, at the first request that carried it.

    A tool call's result is produced once but may be sent in several shapes: once an image
    is pruned from what is sent, its tool result carries a placeholder instead. Each shape
    is kept, at the clock of the first request that carried the call's result: the clock it
    was produced at. The tests keep every turn shorter than ``maximum_rounds``, so a result
    goes out in the request right after its call, within the step that made it; and their
    scripted models give every tool call of a run its own id.

    Args:
        requests: A run's requests, in order.

    Returns:
        The items, in the order they were first sent.
    """
    seen: set[tuple[str, str, str]] = set()
    produced: dict[str, SentRequest] = {}
    found: list[Sent] = []
    for request in requests:
        for item in _items(request):
            digest = hashlib.sha256(item.image if item.image is not None
                                    else item.text.encode()).hexdigest()
            key = (item.what, item.call or "", digest)
            if key in seen:
                continue
            seen.add(key)
            if item.call is not None:
                first = produced.setdefault(item.call, request)
                item = replace(item, request=first)
            found.append(item)
    return found


def _items(request: SentRequest) -> Iterator[Sent]:
    names: dict[str, str] = {}
    for message in request.messages:
        role = message.get("role")
        if role == "assistant":
            for call in message.get("tool_calls") or ():
                names[str(call["id"])] = str(call["function"]["name"])
        elif role == "tool":
            call = str(message["tool_call_id"])
            tool = names.get(call, "?")
            yield Sent(request, f"tool result of {tool} (call {call})", tool, call,
                       _text(message.get("content")))
        elif role == "user":
            yield from _user_items(request, message.get("content"), names)


def _user_items(request: SentRequest, content: Any, names: Mapping[str, str]) -> Iterator[Sent]:
    parts: list[dict[str, Any]] = ([{"type": "text", "text": content}]
                                   if isinstance(content, str) else list(content or ()))
    call: str | None = None  # the tool call whose images follow, in an images message
    for part in parts:
        if part.get("type") == "image_url":
            url = str(part["image_url"]["url"])
            data = base64.b64decode(url.partition("base64,")[2])
            tool = names.get(call, "?") if call is not None else None
            what = (f"image of {tool} (call {call})" if call is not None
                    else "image in a user message")
            yield Sent(request, what, tool, call, image=data)
            continue
        text = str(part.get("text", ""))
        match = _IMAGES_OF.match(text)
        if match:
            call = match.group("call")
            continue
        call = None
        yield Sent(request, "user message", text=text)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(str(p.get("text", "")) for p in content or () if isinstance(p, dict))


# --------------------------------------------------------------------------- time


def _stamp(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M} UTC"


def _excerpt(text: str, start: int = 0) -> str:
    begin = max(0, start - _EXCERPT // 2)
    piece = text[begin:begin + _EXCERPT].replace("\n", "⏎")
    return f"{'…' if begin else ''}{piece}{'…' if begin + _EXCERPT < len(text) else ''}"


def _short_time(match: re.Match[str], clock: datetime) -> datetime:
    """A ``MM-DD HH:MM`` time in the year that puts it nearest before the clock."""
    month, day, hour, minute = (int(g) for g in match.groups())
    moment = datetime(clock.year, month, day, hour, minute, tzinfo=UTC)
    if moment > clock + timedelta(days=180):  # December seen from January
        moment = moment.replace(year=clock.year - 1)
    return moment


def _times(text: str, clock: datetime) -> Iterator[tuple[re.Match[str], datetime]]:
    for match in _FULL_TIME.finditer(text):
        year, month, day, hour, minute = (int(g) for g in match.groups()[:5])
        yield match, datetime(year, month, day, hour, minute, int(match.group(6) or 0),
                              tzinfo=UTC)
    for match in _SHORT_TIME.finditer(text):
        yield match, _short_time(match, clock)


def check_times(items: Sequence[Sent]) -> int:
    """Every date and time in what the desk was sent is at or before the clock it was sent
    at, and a tool stamping its answer with the time stamps the clock itself.

    Args:
        items: From :func:`first_sent`.

    Returns:
        How many times were checked.

    Raises:
        LookAheadError: A time after the clock, or a stamp that is not the clock.
    """
    checked = 0
    for item in items:
        for match, moment in _times(item.text, item.clock):
            checked += 1
            if moment > item.clock:
                raise LookAheadError(
                    f"{item.where()} names {match.group(0)!r} ({_stamp(moment)}), after its "
                    f"clock {_stamp(item.clock)}: {_excerpt(item.text, match.start())}")
        pattern = _STAMPED.get(item.tool or "")
        stamp = pattern.search(item.text) if pattern is not None else None
        if stamp is not None and stamp.group(1) != f"{item.clock:%Y-%m-%d %H:%M}":
            raise LookAheadError(
                f"{item.where()} says it holds at {stamp.group(1)} UTC, not at its clock "
                f"{_stamp(item.clock)}: {_excerpt(item.text)}")
    return checked


# --------------------------------------------------------------------------- candles


class _Truth:
    """What a tool may show of one symbol at a clock: candles built from the closed ones."""

    def __init__(self, candles: Sequence[Candle]) -> None:
        self.candles = list(candles)
        self.closes = [c.closes_at for c in self.candles]
        self.base = timeframe_delta(self.candles[0].timeframe)
        self._built: dict[tuple[datetime, str], list[Candle]] = {}

    def at(self, clock: datetime, timeframe: str) -> list[Candle]:
        """The ``timeframe`` candles built from those closed by ``clock``."""
        key = (clock, timeframe)
        if key not in self._built:
            closed = self.candles[:bisect.bisect_right(self.closes, clock)]
            self._built[key] = resample(closed, timeframe)
        return self._built[key]


def _truths(candles: Mapping[str, Sequence[Candle]]) -> dict[str, _Truth]:
    return {symbol: _Truth(series) for symbol, series in candles.items()}


def _decimal(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def check_candle_tables(items: Sequence[Sent],
                        candles: Mapping[str, Sequence[Candle]]) -> tuple[int, int]:
    """Every ``get_candles`` table shows the candles built from those closed by its clock.

    Rows are candle open times. Every row but the last is a candle that closed by the clock;
    the last may be a longer timeframe's forming candle (the tools write it like the others:
    ``fetch_candles`` returns it, as an exchange does): then at least one candle of the data's
    own timeframe in it has closed, and its figures are those of the closed ones alone.

    Args:
        items: From :func:`first_sent`.
        candles: Each symbol's candles, as the run was given them (the future included).

    Returns:
        How many rows were checked, and how many of them were forming candles.

    Raises:
        LookAheadError: A row that had not closed (or begun) by the clock, or whose figures
            differ from the candles closed by then.
    """
    truths = _truths(candles)
    checked = forming = 0
    for item in items:
        if item.tool != "get_candles":
            continue
        head = _TABLE_HEAD.match(item.text)
        if head is None:
            continue  # an error the model reads, such as an unknown symbol
        symbol, timeframe = head.group("symbol"), head.group("timeframe")
        truth = truths[symbol]
        shown = {c.opened_at: c for c in truth.at(item.clock, timeframe)}
        width = timeframe_delta(timeframe)
        rows, whole = _table_rows(item.text)
        if whole and len(rows) != int(head.group("count")):
            raise LookAheadError(f"{item.where()}: says {head.group('count')} candles, shows "
                                 f"{len(rows)}: {_excerpt(item.text)}")
        for number, row in enumerate(rows, start=1):
            checked += 1
            time_text, *figures = row.split(",")
            opened = _short_time(_SHORT_TIME.fullmatch(time_text) or _no_time(item, row),
                                 item.clock)
            # A cut keeps the table's end: its last row is the table's last.
            may_form = number == len(rows) and width > truth.base
            which = (f"row {number}" if whole
                     else f"row {number} of those the context compressor's cut left")
            if opened + (truth.base if may_form else width) > item.clock:
                raise LookAheadError(
                    f"{item.where()}: {which} of the {symbol} {timeframe} table, "
                    f"{row!r}{' (the forming candle)' if may_form else ''}, is a candle "
                    f"opening {_stamp(opened)}: not closed by its clock {_stamp(item.clock)}")
            forming += opened + width > item.clock
            expected = shown.get(opened)
            want = None if expected is None else [
                expected.open, expected.high, expected.low, expected.close,
                round(expected.volume, 3)]
            if want is None or [Decimal(f) for f in figures] != want:
                raise LookAheadError(
                    f"{item.where()}: {which} of the {symbol} {timeframe} table is "
                    f"{row!r}; built from the candles closed by its clock "
                    f"{_stamp(item.clock)} it is "
                    f"{'absent' if want is None else ','.join(str(v) for v in want)}")
        if whole and rows and (head.group("first") != _full(rows[0], item)
                               or head.group("last") != _full(rows[-1], item)):
            raise LookAheadError(f"{item.where()}: the summary's times do not match the table: "
                                 f"{_excerpt(item.text)}")
    return checked, forming


def _table_rows(text: str) -> tuple[list[str], bool]:
    """A candle table's rows, and whether it is whole.

    The context compressor cuts the middle out of long old tool results, leaving a note on
    a line of its own; the lines on either side of the note may be pieces of rows, so only
    whole rows away from the cut are returned.
    """
    lines = text.split("\n")
    cuts = [index for index, line in enumerate(lines) if _CUT.match(line)]
    if not cuts:
        return lines[2:], True
    cut = cuts[0]
    start = lines.index(_TABLE_HEADER) + 1 if _TABLE_HEADER in lines[:cut - 1] else cut + 2
    kept = [*range(start, cut - 1), *range(cut + 2, len(lines))]
    return [lines[index] for index in kept], False


def _full(row: str, item: Sent) -> str:
    """A table row's ``MM-DD HH:MM`` time written as the summary writes times."""
    match = _SHORT_TIME.fullmatch(row.split(",")[0]) or _no_time(item, row)
    return f"{_short_time(match, item.clock):%Y-%m-%d %H:%M}"


def _no_time(item: Sent, row: str) -> re.Match[str]:
    raise LookAheadError(f"{item.where()}: a table row without a MM-DD HH:MM time: {row!r}")


def check_charts(items: Sequence[Sent], candles: Mapping[str, Sequence[Candle]], *,
                 exchange_name: str = "paper") -> int:
    """Every chart is, byte for byte, the chart drawn from the candles closed by its clock,
    and its summary names their last close and range.

    The desk's image limits must let a chart through as drawn (the defaults do: a chart is
    1200×700 and well under the byte limit, so the image preparer keeps its bytes).

    Args:
        items: From :func:`first_sent`.
        candles: Each symbol's candles, as the run was given them (the future included).
        exchange_name: The exchange's name in the charts' titles.

    Returns:
        How many charts were checked.

    Raises:
        LookAheadError: A chart or its summary that differs from the one drawn from the
            candles closed by its clock.
    """
    truths = _truths(candles)
    summaries: dict[str, re.Match[str]] = {}
    checked = 0
    for item in items:
        if item.tool != "render_chart":
            continue
        if item.image is None:
            head = _CHART_HEAD.match(item.text)
            if head is not None and item.call is not None:
                summaries[item.call] = head
                _check_chart_summary(item, head, truths[head.group("symbol")])
            continue
        head = summaries.get(item.call or "")
        if head is None:
            raise LookAheadError(f"{item.where()}: an image with no chart summary before it")
        checked += 1
        symbol, timeframe, count = head.group("symbol"), head.group("timeframe"), int(
            head.group("count"))
        built = truths[symbol].at(item.clock, timeframe)
        fetched = built[-(count + _CHART_WARMUP):]
        drawn, history = fetched[-count:], fetched[:-count]
        expected = render_chart_png(drawn, title=f"{symbol} · {timeframe} · {exchange_name}",
                                    history=history)
        if item.image != expected:
            raise LookAheadError(
                f"{item.where()}: the {symbol} {timeframe} chart of {count} candles "
                f"({len(item.image):,} bytes, sha256 {_sha(item.image)}) is not the chart "
                f"drawn from the candles closed by its clock {_stamp(item.clock)} "
                f"({len(expected):,} bytes, sha256 {_sha(expected)})")
    return checked


def _check_chart_summary(item: Sent, head: re.Match[str], truth: _Truth) -> None:
    count = int(head.group("count"))
    drawn = truth.at(item.clock, head.group("timeframe"))[-count:]
    last_open = datetime.strptime(head.group("last"), "%Y-%m-%d %H:%M").replace(tzinfo=UTC)
    shown = (last_open, head.group("close"), head.group("low"), head.group("high"))
    expected = (drawn[-1].opened_at, format_price(drawn[-1].close),
                format_price(min(c.low for c in drawn)),
                format_price(max(c.high for c in drawn))) if drawn else None
    if len(drawn) != count or shown != expected:
        raise LookAheadError(
            f"{item.where()}: the chart summary shows last open, close, low, high {shown}; "
            f"the candles closed by its clock {_stamp(item.clock)} give {expected} "
            f"({len(drawn)} candles): {_excerpt(item.text)}")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


# --------------------------------------------------------------------------- prices


def price_range(candles: Sequence[Candle]) -> tuple[Decimal, Decimal]:
    """The lowest low and highest high of ``candles``."""
    return min(c.low for c in candles), max(c.high for c in candles)


def check_prices(items: Sequence[Sent], cut: datetime,
                 future: Mapping[str, tuple[Decimal, Decimal]]) -> int:
    """Nothing sent at or before ``cut`` names a number in a range the prices take only
    after it.

    Args:
        items: From :func:`first_sent`.
        cut: The time after which the data's prices moved to ranges never seen before.
        future: Each symbol's price range after ``cut`` (lowest low, highest high).

    Returns:
        How many numbers were checked.

    Raises:
        LookAheadError: Such a number.
    """
    checked = 0
    for item in items:
        if item.clock > cut:
            continue
        for match in _NUMBER.finditer(item.text):
            checked += 1
            value = _decimal(match.group(0))
            for symbol, (low, high) in future.items():
                if low <= value <= high:
                    raise LookAheadError(
                        f"{item.where()} names {match.group(0)}, a {symbol} price of after "
                        f"{_stamp(cut)} (the range {low}–{high}), at its clock "
                        f"{_stamp(item.clock)}: {_excerpt(item.text, match.start())}")
    return checked


# --------------------------------------------------------------------------- truncation


def check_same_requests(full: Sequence[SentRequest], cut: Sequence[SentRequest],
                        until: datetime) -> int:
    """Every request the full run made at or before ``until`` is byte for byte the one the
    run on data cut at ``until`` made, in the same order, and the cut run made no other.

    Args:
        full: The requests of the run on all the data.
        cut: The requests of the run on the data cut at ``until``.
        until: The cut.

    Returns:
        How many requests were compared.

    Raises:
        LookAheadError: A request that differs (the message names the first differing
            message, and what it was in each run), or a different number of requests.
    """
    before = [r for r in full if r.clock <= until]
    for mine, theirs in zip(before, cut, strict=False):
        if mine.clock != theirs.clock:
            raise LookAheadError(
                f"{mine.where()} of the full run was made at {_stamp(theirs.clock)} in the "
                f"run on data cut at {_stamp(until)}")
        if mine.body != theirs.body:
            raise LookAheadError(f"{mine.where()} differs between the full run and the run on "
                                 f"data cut at {_stamp(until)}: {_difference(mine, theirs)}")
    if len(before) != len(cut):
        raise LookAheadError(
            f"the full run made {len(before)} requests by {_stamp(until)}, the run on data "
            f"cut there made {len(cut)}")
    return len(before)


def _difference(full: SentRequest, cut: SentRequest) -> str:
    ours, theirs = full.messages, cut.messages
    for index, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            role = a.get("role")
            left, right = _render(a), _render(b)
            at = next((i for i, (x, y) in enumerate(zip(left, right, strict=False)) if x != y),
                      min(len(left), len(right)))
            call = f", tool call {a['tool_call_id']}" if "tool_call_id" in a else ""
            return (f"message {index + 1} of {len(ours)} ({role}{call}) reads "
                    f"{_excerpt(left, at)} in the full run and {_excerpt(right, at)} on the "
                    "cut data")
    if len(ours) != len(theirs):
        return f"{len(ours)} messages in the full run, {len(theirs)} on the cut data"
    return "the messages are the same; the rest of the body differs"


def _render(message: Mapping[str, Any]) -> str:
    """A message as text, with each image as its size and hash."""
    def shrink(value: Any) -> Any:
        if isinstance(value, dict):
            if value.get("type") == "image_url":
                data = base64.b64decode(str(value["image_url"]["url"]).partition("base64,")[2])
                return f"<image {len(data):,} bytes, sha256 {_sha(data)}>"
            return {k: shrink(v) for k, v in value.items()}
        if isinstance(value, list):
            return [shrink(v) for v in value]
        return value

    return json.dumps(shrink(message), ensure_ascii=False)


# --------------------------------------------------------------------------- fills


@dataclass(frozen=True)
class _Placed:
    decided_at: datetime
    decision: int
    arguments: dict[str, Any]


def _placed_orders(record: BacktestRecord,
                   unmask: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                   ) -> dict[str, _Placed]:
    """Client order id → the decision and the arguments of the ``place_order`` call (in
    real terms, through ``unmask``, for a masked run)."""
    placed: dict[str, _Placed] = {}
    for decision in record.decisions:
        calls = [entry.text for entry in decision.transcript
                 if entry.kind == "tool_call" and entry.text.startswith("place_order(")]
        # The engine lists a turn's orders in the order of its place_order calls.
        for cid, call in zip(decision.orders, calls, strict=True):
            arguments = json.loads(call.removeprefix("place_order(")[:-1])
            placed[cid] = _Placed(decision.at, decision.index,
                                  arguments if unmask is None else unmask(arguments))
    return placed


def check_fills(record: BacktestRecord, candles: Mapping[str, Sequence[Candle]],
                paper: PaperExchangeConfig, *,
                unmask: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> int:
    """Every fill of the run used only prices that came after its decision.

    An order decided at a candle's close reaches the book at the open of the next candle
    (the one opening at the decision). A market order fills there, moved against it by the
    slippage, paying the taker fee; so does a limit order whose price that slipped open
    already beats, if that candle trades through its price. Any other limit order rests and
    fills at its own price, paying the maker fee, at the close of the first candle from then
    on that trades through its price (a buy needs a low below it, a sell a high above it).

    Args:
        record: The run's record.
        candles: Each symbol's candles, as the run was given them.
        paper: The desk's ``[exchange.paper]`` settings.
        unmask: Turns a masked run's ``place_order`` arguments into real ones.

    Returns:
        How many fills of orders were checked (what the account held at the start is
        checked to be adopted at the start, and not counted).

    Raises:
        LookAheadError: A fill at another time or price, or of an order nobody placed.
    """
    placed = _placed_orders(record, unmask)
    checked = 0
    for fill in record.fills:
        if fill.turn == STARTING_TURN:
            _check_starting_holding(record, fill)
            continue  # no decision: what the account held when the run began
        checked += 1
        order = placed.get(fill.client_order_id)
        what = (f"the fill of {fill.side} {fill.amount} {fill.symbol} (client id "
                f"{fill.client_order_id}) at {fill.price} on {_stamp(fill.filled_at)}, fee "
                f"{fill.fee}")
        if order is None:
            raise LookAheadError(f"{what}: no decision placed it")
        if fill.decided_at != order.decided_at:
            raise LookAheadError(f"{what}: decided at {_stamp(fill.decided_at)} by the "
                                 f"record, at {_stamp(order.decided_at)} by decision "
                                 f"{order.decision}")
        series = candles[fill.symbol]
        later = series[bisect.bisect_left([c.opened_at for c in series], order.decided_at):]
        if not later or later[0].opened_at != order.decided_at:
            raise LookAheadError(f"{what}: no candle opens at the decision, "
                                 f"{_stamp(order.decided_at)}")
        expected, rule = _expected_fill(fill, order, later, paper)
        if (fill.filled_at, fill.price, fill.fee) != expected:
            raise LookAheadError(
                f"{what}: {rule}; expected at {_stamp(expected[0])}, price {expected[1]}, fee "
                f"{expected[2]}")
    return checked


def _check_starting_holding(record: BacktestRecord, fill: FillRecord) -> None:
    """The books adopt a paper account's starting coins as one opening fill each, at the
    start, for no fee: nothing after the start can have priced it."""
    if (fill.client_order_id, fill.side, fill.fee) != (f"{STARTING_TURN}-{fill.symbol}",
                                                        "buy", 0) or \
            not fill.decided_at == fill.filled_at == record.start:
        raise LookAheadError(
            f"the starting holding of {fill.amount} {fill.symbol} (client id "
            f"{fill.client_order_id}) is a buy at the start, {_stamp(record.start)}, for no "
            f"fee; the record has a {fill.side} on {_stamp(fill.filled_at)}, fee {fill.fee}")


_Fill = tuple[datetime, Decimal, Decimal]


def _expected_fill(fill: FillRecord, order: _Placed, later: Sequence[Candle],
                   paper: PaperExchangeConfig) -> tuple[_Fill, str]:
    """When, at what price and fee ``order`` fills on ``later`` (the candles from its
    decision on), and the rule, in words."""
    first, buy = later[0], fill.side == "buy"
    slipped = first.open * (1 + (1 if buy else -1) * paper.slippage_bps / Decimal(10000))
    at_open = (first.opened_at, slipped, fill.amount * slipped * paper.taker_fee)
    decided = _stamp(order.decided_at)
    opening = (f"the open of the candle opening then, {first.open}, "
               f"{'+' if buy else '-'}{paper.slippage_bps} bps, taker fee {paper.taker_fee}")
    if order.arguments.get("type") == "market":
        return at_open, f"a market order decided at {decided} fills at {opening}"
    limit = Decimal(str(order.arguments["price"]))
    through = [c for c in later if (c.low < limit if buy else c.high > limit)]
    if not through:
        raise LookAheadError(f"the fill of {fill.side} {fill.amount} {fill.symbol} (client "
                             f"id {fill.client_order_id}) on {_stamp(fill.filled_at)}: no "
                             f"candle from the decision at {decided} trades through {limit}")
    if through[0] is first and (slipped <= limit if buy else slipped >= limit):
        return at_open, (f"a limit {fill.side} at {limit} decided at {decided} reaches the "
                         f"book already beaten by {opening}: it fills there")
    candle = through[0]
    return (candle.closes_at, limit, fill.amount * limit * paper.maker_fee), (
        f"a limit {fill.side} at {limit} decided at {decided} rests from the next open and "
        f"fills at its price when a candle trades through it, first the one of "
        f"{_stamp(candle.opened_at)} (open {candle.open}, low {candle.low}, high "
        f"{candle.high}), at its close, maker fee {paper.maker_fee}")


# --------------------------------------------------------------------------- data


def write_candles(path: Path, candles: Sequence[Candle]) -> Path:
    """Writes candles in the replay's format (``timestamp_ms,open,high,low,close,volume``).

    Returns:
        ``path``.
    """
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["timestamp_ms", "open", "high", "low", "close", "volume"])
        for c in candles:
            writer.writerow([int(c.opened_at.timestamp() * 1000), c.open, c.high, c.low,
                             c.close, c.volume])
    return path
