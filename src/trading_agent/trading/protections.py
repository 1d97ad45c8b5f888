"""Protections: small rules over a desk's books, equity and tool calls that put the desk in
reduce-only for a while when it loses or flails (``[desks.<name>.protections]``).

Each rule looks back over its ``lookback_minutes`` and, when its condition holds, trips:
the desk goes into reduce-only (:mod:`.reduce_only`) until ``pause_minutes`` after the
newest piece of evidence (the last stop, exit, reversal, error, or the equity sample that
showed the drawdown). Evidence a rule already tripped on is not counted again (only what
came after its last trip), so a rule that lifted does not trip at once on what it answered.

- ``max_drawdown``: the equity (the account valued in the quote currency, sampled on each
  candle and each order check) fell ``max_drawdown_percent`` below its high;
- ``stoploss_guard``: ``max_stops`` round trips closed with exit reason ``stop_loss``;
- ``cooldown_after_exit``: a round trip closed (its lookback is its pause);
- ``flip_flop_guard``: more than ``max_flips`` round trips opened on the other side of the
  desk's previous round trip in the same market;
- ``tool_error_guard``: more than ``max_errors`` tool calls failed or were refused (a
  refusal by reduce-only itself excluded).

:class:`ProtectionGuard` runs them for one desk: the risk policy asks it for the desk's
reduce-only on every order (:meth:`ProtectionGuard.current`), and the desk's market watcher
has it look on each candle (:meth:`ProtectionGuard.observe`), so a trip shows in the desk's
status before the next order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Protocol

from trading_agent.trading.books import STOP_LOSS_TURN, DeskBookRecords, RoundTrip
from trading_agent.trading.config import (
    CooldownAfterExitConfig,
    FlipFlopGuardConfig,
    MaxDrawdownConfig,
    ProtectionsConfig,
    StoplossGuardConfig,
    ToolErrorGuardConfig,
)
from trading_agent.trading.formatting import format_amount
from trading_agent.trading.reduce_only import ReduceOnly, ReduceOnlyStates

__all__ = ["REDUCE_ONLY_LIMIT", "STOP_LOSS_EXIT", "Evidence", "Protection", "ProtectionGuard",
           "Trip", "protections_from"]

STOP_LOSS_EXIT = STOP_LOSS_TURN
"""The exit reason of a round trip its stop loss closed (as the books record it)."""

REDUCE_ONLY_LIMIT = "reduce_only"
"""The limit a refusal of new exposure names (a tool error the guard does not count)."""

_MAX_EQUITY_POINTS = 20_000


@dataclass(frozen=True)
class Evidence:
    """What the rules read, each list oldest first.

    Attributes:
        trades: The desk's round trips (open and closed).
        equity: The desk's equity samples, ``(at, value)``.
        tool_errors: When its tool calls failed or were refused.
        quote: The quote currency, for the texts.
    """

    trades: Sequence[RoundTrip]
    equity: Sequence[tuple[datetime, Decimal]]
    tool_errors: Sequence[datetime]
    quote: str


@dataclass(frozen=True)
class Trip:
    """A rule that tripped.

    Attributes:
        protection: Its name.
        reason: What it saw, with the numbers.
        until: When the desk's reduce-only lifts.
    """

    protection: str
    reason: str
    until: datetime


class Protection(Protocol):
    """One rule."""

    @property
    def name(self) -> str:
        """Its settings key."""
        ...

    def check(self, evidence: Evidence, now: datetime, since: datetime | None) -> Trip | None:
        """Whether it trips at ``now``, counting only evidence after ``since`` (its previous
        trip)."""
        ...


def _minutes(value: float) -> timedelta:
    return timedelta(minutes=value)


def _span(value: float) -> str:
    minutes = round(value)
    return f"{minutes // 60} h" if minutes >= 60 and minutes % 60 == 0 else f"{minutes} min"


def _after(at: datetime, start: datetime, since: datetime | None) -> bool:
    return at >= start and (since is None or at > since)


@dataclass(frozen=True)
class MaxDrawdown:
    """``max_drawdown``: the equity's fall from its high within the lookback."""

    config: MaxDrawdownConfig
    name: str = "max_drawdown"

    def check(self, evidence: Evidence, now: datetime, since: datetime | None) -> Trip | None:
        start = now - _minutes(self.config.lookback_minutes)
        points = [(at, value) for at, value in evidence.equity if _after(at, start, since)]
        high: tuple[datetime, Decimal] | None = None
        found: tuple[Decimal, Decimal, Decimal, datetime] | None = None
        for at, value in points:
            if high is None or value > high[1]:
                high = (at, value)
            elif high[1] > 0:
                fall = (high[1] - value) / high[1] * 100
                if fall >= self.config.max_drawdown_percent:
                    found = (fall, high[1], value, at)
        if found is None:
            return None
        fall, top, low, at = found
        until = at + _minutes(self.config.pause_minutes)
        if until <= now:
            return None
        return Trip(self.name, f"equity fell {fall:.2f}% from its high of "
                    f"{format_amount(top, evidence.quote)} to "
                    f"{format_amount(low, evidence.quote)} within the last "
                    f"{_span(self.config.lookback_minutes)} (max_drawdown_percent "
                    f"{self.config.max_drawdown_percent}%)", until)


@dataclass(frozen=True)
class StoplossGuard:
    """``stoploss_guard``: stops hit within the lookback."""

    config: StoplossGuardConfig
    name: str = "stoploss_guard"

    def check(self, evidence: Evidence, now: datetime, since: datetime | None) -> Trip | None:
        start = now - _minutes(self.config.lookback_minutes)
        stops = [t for t in evidence.trades if t.closed_at is not None
                 and t.exit_reason == STOP_LOSS_EXIT and _after(t.closed_at, start, since)]
        if len(stops) < self.config.max_stops:
            return None
        last = max(t.closed_at for t in stops if t.closed_at is not None)
        until = last + _minutes(self.config.pause_minutes)
        if until <= now:
            return None
        lost = sum((t.profit for t in stops), Decimal(0))
        return Trip(self.name, f"{len(stops)} round trips closed by their stop loss within "
                    f"the last {_span(self.config.lookback_minutes)} (max_stops "
                    f"{self.config.max_stops}; together "
                    f"{format_amount(lost, evidence.quote)}), the last at {last:%H:%M} UTC",
                    until)


@dataclass(frozen=True)
class CooldownAfterExit:
    """``cooldown_after_exit``: a pause after each closed round trip."""

    config: CooldownAfterExitConfig
    name: str = "cooldown_after_exit"

    def check(self, evidence: Evidence, now: datetime, since: datetime | None) -> Trip | None:
        closed = [t for t in evidence.trades if t.closed_at is not None
                  and (since is None or t.closed_at > since)]
        if not closed:
            return None
        last = max(closed, key=lambda t: t.closed_at or now)
        assert last.closed_at is not None
        until = last.closed_at + _minutes(self.config.pause_minutes)
        if until <= now:
            return None
        return Trip(self.name, f"a {last.symbol} {last.side} round trip closed at "
                    f"{last.closed_at:%H:%M} UTC (profit "
                    f"{format_amount(last.profit, evidence.quote)}); no new exposure for "
                    f"{_span(self.config.pause_minutes)} after an exit", until)


@dataclass(frozen=True)
class FlipFlopGuard:
    """``flip_flop_guard``: reversals of the desk's position within the lookback."""

    config: FlipFlopGuardConfig
    name: str = "flip_flop_guard"

    def check(self, evidence: Evidence, now: datetime, since: datetime | None) -> Trip | None:
        start = now - _minutes(self.config.lookback_minutes)
        previous: dict[str, str] = {}
        flips: list[RoundTrip] = []
        for trade in sorted(evidence.trades, key=lambda t: (t.opened_at, t.id)):
            before = previous.get(trade.symbol)
            if before is not None and before != trade.side \
                    and _after(trade.opened_at, start, since):
                flips.append(trade)
            previous[trade.symbol] = trade.side
        if len(flips) <= self.config.max_flips:
            return None
        last = flips[-1].opened_at
        until = last + _minutes(self.config.pause_minutes)
        if until <= now:
            return None
        return Trip(self.name, f"the desk reversed its position {len(flips)} times within the "
                    f"last {_span(self.config.lookback_minutes)} (max_flips "
                    f"{self.config.max_flips}), the last at {last:%H:%M} UTC", until)


@dataclass(frozen=True)
class ToolErrorGuard:
    """``tool_error_guard``: failed or refused tool calls within the lookback."""

    config: ToolErrorGuardConfig
    name: str = "tool_error_guard"

    def check(self, evidence: Evidence, now: datetime, since: datetime | None) -> Trip | None:
        start = now - _minutes(self.config.lookback_minutes)
        errors = [at for at in evidence.tool_errors if _after(at, start, since)]
        if len(errors) <= self.config.max_errors:
            return None
        until = errors[-1] + _minutes(self.config.pause_minutes)
        if until <= now:
            return None
        return Trip(self.name, f"{len(errors)} tool calls failed or were refused within the "
                    f"last {_span(self.config.lookback_minutes)} (max_errors "
                    f"{self.config.max_errors})", until)


def protections_from(config: ProtectionsConfig | None) -> list[Protection]:
    """The rules a desk's ``protections`` table sets, in the order they are checked."""
    if config is None:
        return []
    rules: list[Protection] = []
    if config.max_drawdown is not None:
        rules.append(MaxDrawdown(config.max_drawdown))
    if config.stoploss_guard is not None:
        rules.append(StoplossGuard(config.stoploss_guard))
    if config.cooldown_after_exit is not None:
        rules.append(CooldownAfterExit(config.cooldown_after_exit))
    if config.flip_flop_guard is not None:
        rules.append(FlipFlopGuard(config.flip_flop_guard))
    if config.tool_error_guard is not None:
        rules.append(ToolErrorGuard(config.tool_error_guard))
    return rules


Equity = Callable[[], Awaitable[Decimal | None]]
"""The desk's equity now, in its quote currency (None when it cannot be valued)."""


class ProtectionGuard:
    """One desk's protections and its reduce-only state.

    Args:
        desk: The desk.
        rules: Its protections (none: only an operator or a spend cap sets reduce-only).
        states: The daemon's reduce-only states.
        books: The desk's books (its round trips).
        clock: The desk's clock (the exchange's).
        equity: Values the desk's account.
        quote: Its quote currency.
    """

    def __init__(self, desk: str, rules: Sequence[Protection], states: ReduceOnlyStates,
                 books: DeskBookRecords, clock: Callable[[], datetime], equity: Equity,
                 quote: str) -> None:
        self.desk = desk
        self.rules = list(rules)
        self.states = states
        self._books = books
        self._clock = clock
        self._equity = equity
        self._quote = quote
        self._samples: deque[tuple[datetime, Decimal]] = deque(maxlen=_MAX_EQUITY_POINTS)
        self._tool_errors: deque[datetime] = deque(maxlen=_MAX_EQUITY_POINTS)
        self._cleared: dict[str, datetime] = {}

    def note_tool_result(self, is_error: bool, refused_limit: str | None) -> None:
        """A tool call of the desk finished: a failure (or refusal) counts for
        ``tool_error_guard``, unless reduce-only itself refused it."""
        if is_error and refused_limit != REDUCE_ONLY_LIMIT:
            self._tool_errors.append(self._clock())

    async def observe(self) -> ReduceOnly | None:
        """Samples the equity and runs the rules (each candle)."""
        return await self.current(sample=True)

    async def current(self, *, sample: bool = True) -> ReduceOnly | None:
        """The desk's reduce-only now: a lapsed one lifted, the rules run when none holds.

        Args:
            sample: Take an equity sample first.
        """
        now = self._clock()
        await self.states.lift_expired(self.desk, now)
        held = self.states.state_for(self.desk, now)
        if not self.rules:
            return held
        if sample and any(isinstance(rule, MaxDrawdown) for rule in self.rules):
            value = await self._equity()
            if value is not None:
                self._samples.append((now, value))
        if held is not None:
            self._cleared_by(held)
            return held
        evidence = Evidence(await self._trades(), list(self._samples),
                            list(self._tool_errors), self._quote)
        for rule in self.rules:
            trip = rule.check(evidence, now, self._cleared.get(rule.name))
            if trip is not None:
                state = await self.states.switch_on(ReduceOnly(
                    self.desk, f"protection {trip.protection}", trip.reason, now, trip.until,
                    trip.protection))
                self._cleared_by(state)
                return state
        return None

    def _cleared_by(self, state: ReduceOnly) -> None:
        """What a rule tripped on is not counted again once its pause lifts (what came
        after the trip is)."""
        if state.protection is not None:
            self._cleared[state.protection] = state.at

    async def _trades(self) -> list[RoundTrip]:
        reach = [_reach(rule) for rule in self.rules
                 if isinstance(rule, StoplossGuard | CooldownAfterExit | FlipFlopGuard)]
        if not reach:
            return []
        # A day more: the trade before the lookback tells whether the first one in it
        # reversed the position.
        return await self._books.trades(self._clock() - max(reach) - timedelta(days=1))


def _reach(rule: StoplossGuard | CooldownAfterExit | FlipFlopGuard) -> timedelta:
    """How far back a rule over the round trips reads."""
    if isinstance(rule, CooldownAfterExit):
        return _minutes(rule.config.pause_minutes)
    return _minutes(rule.config.lookback_minutes)
