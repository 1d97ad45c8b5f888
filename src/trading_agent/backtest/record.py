"""What a backtest produced: the one input of its figures and its report.

The engine fills a :class:`BacktestRecord` as the run goes; :mod:`.metrics` and
:mod:`.report` read it and nothing else, so the figures are pure functions of the ledger
and the candles (and can be checked by hand on a record made up in a test).

The ledger is the desk's own books (:mod:`trading_agent.trading.books`), the same ones a
running desk keeps: its round trips (:class:`~trading_agent.trading.books.RoundTrip`) are
the record's trades, and its fills, each with the decision that led to it, the record's
fills. A backtest's win rate, trade count and profit are thus the ones the operator views
would show for the same fills.
"""

from __future__ import annotations

import json
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import IO, Literal, overload

from trading_agent.trading.books import RoundTrip
from trading_agent.trading.exchange import Candle

__all__ = ["BacktestRecord", "Decision", "EquityPoint", "FillRecord", "ModelUsage",
           "TranscriptEntry", "TranscriptSpool"]


@dataclass(frozen=True)
class EquityPoint:
    """The account's value at one candle close.

    Attributes:
        at: The close time (the simulated clock after the step).
        equity: Everything the account holds, valued in the quote currency at the closes.
        exposure: The part of ``equity`` held in positions (0 when flat, 1 when all in).
    """

    at: datetime
    equity: Decimal
    exposure: Decimal


@dataclass(frozen=True)
class FillRecord:
    """One fill of the desk's books, with the decision that led to it.

    Attributes:
        decided_at: The simulated time of the turn that placed the order (for what the
            account held at the start, the start).
        filled_at: When it filled (a market order: the next candle's open).
        symbol: The market.
        side: ``buy`` or ``sell``.
        amount: Base amount.
        price: Fill price, slippage included.
        fee: Fee paid, in the quote currency.
        client_order_id: The order's client order id (``start-<symbol>`` for what the
            account held at the start).
        reason: The desk's own words at the decision (its final answer of that turn).
        turn: The turn that placed the order (``t000001``...; ``start`` for the starting
            holding), None when unknown.
    """

    decided_at: datetime
    filled_at: datetime
    symbol: str
    side: Literal["buy", "sell"]
    amount: Decimal
    price: Decimal
    fee: Decimal
    client_order_id: str
    reason: str
    turn: str | None = None


@dataclass(frozen=True)
class TranscriptEntry:
    """One line of a decision's transcript.

    Attributes:
        kind: ``trigger``, ``operator``, ``text`` (the model's words), ``tool_call``,
            ``tool_result``, ``notice``.
        text: What it says (a tool call: ``name(arguments)``).
        is_error: For a tool result, whether the tool failed.
    """

    kind: str
    text: str
    is_error: bool = False


class TranscriptSpool:
    """Decisions' transcripts kept in an anonymous temporary file, not in memory: a year of
    decisions would otherwise hold every tool result of the run until the report is written.

    :meth:`add` writes one transcript and returns a sequence that reads it back when asked
    (the report reads each once). The file disappears when the spool is closed or dropped.
    """

    def __init__(self) -> None:
        # Held open for the record's life: the file has no name and goes when it closes.
        self._file: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._lock = threading.Lock()
        self._end = 0
        # Closed with the last decision that reads from it (or at exit), never left to the
        # file object's own finalizer, which would warn.
        self._closer = weakref.finalize(self, self._file.close)

    def add(self, entries: Sequence[TranscriptEntry]) -> Sequence[TranscriptEntry]:
        """Writes a transcript; returns it as a sequence read from the file on demand."""
        line = json.dumps([[e.kind, e.text, e.is_error] for e in entries],
                          ensure_ascii=False).encode("utf-8", "surrogatepass")
        with self._lock:
            self._file.seek(self._end)
            self._file.write(line)
            start, self._end = self._end, self._end + len(line)
        return _SpooledTranscript(self, start, len(line), len(entries))

    def read(self, start: int, size: int) -> tuple[TranscriptEntry, ...]:
        """One transcript, as written."""
        with self._lock:
            self._file.seek(start)
            raw = self._file.read(size)
        return tuple(TranscriptEntry(kind, text, is_error)
                     for kind, text, is_error in json.loads(raw.decode("utf-8",
                                                                       "surrogatepass")))

    def close(self) -> None:
        """Removes the file now (else it goes with the last decision that reads from it)."""
        self._closer()


class _SpooledTranscript(Sequence[TranscriptEntry]):
    """A transcript in a :class:`TranscriptSpool`, read when it is looked at."""

    def __init__(self, spool: TranscriptSpool, start: int, size: int, count: int) -> None:
        self._spool = spool
        self._start = start
        self._size = size
        self._count = count

    def _entries(self) -> tuple[TranscriptEntry, ...]:
        return self._spool.read(self._start, self._size)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> TranscriptEntry: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[TranscriptEntry]: ...

    def __getitem__(self, index: int | slice) -> TranscriptEntry | Sequence[TranscriptEntry]:
        return self._entries()[index]

    def __iter__(self) -> Iterator[TranscriptEntry]:
        return iter(self._entries())

    def __repr__(self) -> str:
        return f"<transcript of {self._count} entries, spooled>"


@dataclass(frozen=True)
class Decision:
    """One turn of the desk.

    Attributes:
        index: 1-based, in order.
        at: The simulated time of the turn.
        trigger: What woke the desk (``candle: BTC/USDT 1h``, ``schedule: check``...).
        final_text: The desk's answer.
        transcript: The turn, step by step.
        orders: Client order ids of the orders it placed.
        model_calls: Model requests the turn made (cache hits included).
        turn: The turn's id (``t000001``...): what the books note on its orders, and so
            what a round trip's ``opened_turn`` and ``closed_turn`` name.
    """

    index: int
    at: datetime
    trigger: str
    final_text: str
    transcript: Sequence[TranscriptEntry] = ()
    orders: Sequence[str] = ()
    model_calls: int = 0
    turn: str | None = None


@dataclass
class ModelUsage:
    """What the model was asked over the run.

    Attributes:
        model_calls: Requests that reached the model (not answered from the cache).
        cache_hits: Requests answered from the response cache.
        input_tokens: Prompt tokens of every request, cached answers included (what the run
            would cost without the cache).
        output_tokens: Completion tokens, likewise.
        cost: Money at the configured prices, likewise; None when no prices are configured.
        model_seconds: Wall-clock seconds spent waiting for the model (cache hits cost
            none).
    """

    model_calls: int = 0
    cache_hits: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float | None = None
    model_seconds: float = 0.0


@dataclass
class BacktestRecord:
    """Everything a run produced.

    Attributes:
        desk: The desk's name.
        model: The model's name.
        start: The simulated time the run started (the first decision may come at the first
            close after it).
        end: The simulated time it ended.
        timeframe: The candles' timeframe (``5m``).
        quote_currency: The currency equity is measured in.
        candles: Each symbol's candles of the span (the steps taken), oldest first.
        starting_equity: The account's value at ``start``.
        equity: One point per step.
        trades: The desk's round trips from its books, oldest first; one still open at the
            end has no ``closed_at`` (its profit is what it realized so far less fees).
        fills: Every fill of the desk's books, oldest first.
        decisions: Every turn, oldest first.
        usage: Model calls, cache hits, tokens, cost.
        notices: What a reader must know before trusting the figures (the span is before
            the model's knowledge cutoff...), one sentence each.
        masked: Whether the model read the run through the mask (:mod:`.mask`).
    """

    desk: str
    model: str
    start: datetime
    end: datetime
    timeframe: str
    quote_currency: str
    candles: Mapping[str, Sequence[Candle]]
    starting_equity: Decimal
    equity: list[EquityPoint] = field(default_factory=list)
    trades: list[RoundTrip] = field(default_factory=list)
    fills: list[FillRecord] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    usage: ModelUsage = field(default_factory=ModelUsage)
    notices: list[str] = field(default_factory=list)
    masked: bool = False
