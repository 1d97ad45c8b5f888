"""Dangerous tool calls wait for a person: the daemon's book of pending approvals.

:class:`ApprovalBook` is the :class:`~trading_agent.agent.tool_call_executor.ApprovalGate` of
every desk of a daemon. A call to a tool marked ``dangerous`` is held when the desk trades live,
or when it is an order whose notional is above the configured threshold (paper desks too).
A held call publishes :class:`ApprovalRequested`, waits for :meth:`ApprovalBook.approve` or
:meth:`ApprovalBook.deny` (the operator API calls them), and is denied when nobody answers
within the timeout. The model reads the outcome as the tool's result: an approved call runs;
a denied or timed-out one comes back as an error saying so, and the turn goes on.

Risk comes first: the executor runs a tool's precheck before it asks the book (for
``place_order``, the desk's risk limits), so an order the limits refuse is never held here,
and an approved order is checked again by the risk policy when it is sent.

How the notional is computed, since the order tool's argument names are its own: the first of
``amount``, ``quantity``, ``qty``, ``size`` is the base amount; the first of ``price``,
``limit_price`` the price; a market order (no price) is valued at the last price from the
``price_lookup`` callable, given the desk and the ``symbol`` argument, and a sell at the
higher of its price and the last price (a sell limit below the market fills at the market).
A call whose arguments hold none of the amount names is not an order and the threshold does
not apply to it. An order whose notional cannot be computed (no price, no lookup, a lookup
that fails) is held: when unsure, ask.

The threshold also bounds what a desk places without approval in any rolling hour: an order
is held when it plus the orders that passed unapproved in the hour before would exceed it,
so a large order cannot be split into small ones.
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, Protocol

import anyio
from pydantic import BaseModel

from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.tool_registry import Tool, ToolContext
from trading_agent.errors import TradingAgentError
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.events import ApprovalOutcome, ApprovalRequested, ApprovalResolved

__all__ = [
    "AMOUNT_FIELDS",
    "PRICE_FIELDS",
    "ApprovalAlreadyResolvedError",
    "ApprovalBook",
    "ApprovalError",
    "Approvals",
    "Decision",
    "PendingApproval",
    "PriceLookup",
    "UnknownApprovalError",
    "order_notional",
]

AMOUNT_FIELDS = ("amount", "quantity", "qty", "size")
"""Argument names read as an order's base amount, first match wins."""

PRICE_FIELDS = ("price", "limit_price")
"""Argument names read as an order's price, first match wins."""

PriceLookup = Callable[[str, str], Awaitable[float | None]]
"""``(desk, symbol) -> last price``, to value market orders; None when unknown."""

_RESOLVED_KEPT = 500
"""How many answered approvals are remembered, to tell a late click what happened."""

_WINDOW_SECONDS = 3600.0
"""The rolling window of the unapproved notional a desk may place, up to the threshold."""


class ApprovalError(TradingAgentError):
    """An approve or deny could not be applied."""


class UnknownApprovalError(ApprovalError, LookupError):
    """No approval of that id exists (or it is long gone)."""


class ApprovalAlreadyResolvedError(ApprovalError):
    """The approval was already answered, timed out or cancelled.

    Args:
        approval: The approval, with its outcome.
    """

    def __init__(self, approval: PendingApproval) -> None:
        who = f" by {approval.operator}" if approval.operator else ""
        super().__init__(f"approval {approval.id} was already {approval.outcome}{who}")
        self.approval = approval


@dataclass
class PendingApproval:
    """One held tool call.

    Attributes:
        id: Short and typeable (``/approve 3f2a9c1d``).
        desk: The desk whose call it is.
        turn: The turn's id.
        call_id: The tool call's id.
        tool: The tool's name.
        arguments: The validated arguments, JSON-ready.
        reason: Why it needs approval.
        notional: The order's value, when computed.
        requested_at: When it was held (seconds since the epoch).
        expires_at: When it is denied unless answered.
        outcome: None while pending, then approved, denied, timed_out or cancelled.
        operator: Who answered.
        note: The operator's reason or note.
    """

    id: str
    desk: str
    turn: str
    call_id: str
    tool: str
    arguments: dict[str, Any]
    reason: str
    notional: float | None
    requested_at: float
    expires_at: float
    outcome: ApprovalOutcome | None = None
    operator: str = ""
    note: str = ""
    _events: EventBus | None = field(default=None, repr=False)
    _decided: anyio.Event = field(default_factory=anyio.Event, repr=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PendingApproval:
        """An approval from :meth:`to_dict`'s data (another daemon's, in a fleet)."""
        outcome = data.get("outcome")
        return cls(id=str(data["id"]), desk=str(data["desk"]), turn=str(data["turn"]),
                   call_id=str(data["call_id"]), tool=str(data["tool"]),
                   arguments=dict(data["arguments"]), reason=str(data["reason"]),
                   notional=data.get("notional"), requested_at=float(data["requested_at"]),
                   expires_at=float(data["expires_at"]),
                   outcome=None if outcome in (None, "pending") else outcome,
                   operator=str(data.get("operator", "")), note=str(data.get("note", "")))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data for the API."""
        return {
            "id": self.id, "desk": self.desk, "turn": self.turn, "call_id": self.call_id,
            "tool": self.tool, "arguments": self.arguments, "reason": self.reason,
            "notional": self.notional, "requested_at": self.requested_at,
            "expires_at": self.expires_at, "outcome": self.outcome or "pending",
            "operator": self.operator, "note": self.note,
        }


def _number(value: Any) -> Decimal | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = Decimal(str(value))
    except (InvalidOperation, ValueError):
        return None
    return number if number.is_finite() else None


def _first(arguments: Mapping[str, Any], names: tuple[str, ...]) -> tuple[bool, Decimal | None]:
    """Whether any of ``names`` is present, and the first one's number."""
    for name in names:
        if name in arguments:
            return True, _number(arguments[name])
    return False, None


def order_notional(arguments: Mapping[str, Any],
                   last_price: float | None = None) -> tuple[bool, float | None]:
    """Whether the arguments are an order's, and its value in the quote currency.

    Args:
        arguments: The tool call's validated arguments.
        last_price: The market's last price, used when the order has no price (market order)
            and for a sell, which is valued at the higher of its price and this.

    Returns:
        ``(is_order, notional)``; the notional is None when it cannot be computed.
    """
    has_amount, amount = _first(arguments, AMOUNT_FIELDS)
    if not has_amount:
        return False, None
    _, price = _first(arguments, PRICE_FIELDS)
    last = _number(last_price)
    if price is None:
        price = last
    elif _is_sell(arguments):
        # A sell limit below the market fills at the market: never value it lower.
        price = max(price, last) if last is not None else None
    if amount is None or price is None:
        return True, None
    return True, float(abs(amount * price))


def _is_sell(arguments: Mapping[str, Any]) -> bool:
    side = arguments.get("side")
    return isinstance(side, str) and side.strip().lower() == "sell"


class ApprovalRecords(Protocol):
    """Where held calls are kept for recovery (the store has it): a call cut off by a
    restart while it waited never ran, one approved may have."""

    async def record_approval(self, desk: str, turn: str, call_id: str, approval_id: str,
                              outcome: str | None) -> None:
        """Keeps a held call (``outcome`` None while it waits), then how its approval
        ended."""
        ...


Decision = Literal["approved", "denied"]
"""What an operator answers."""


class Approvals(Protocol):
    """What the operator API asks of approvals: a daemon's :class:`ApprovalBook`, or in a
    fleet every daemon's (:class:`~trading_agent.fleet.approvals.FleetApprovals`)."""

    def pending_count(self, desk: str) -> int:
        """How many of a desk's calls wait here (for its status)."""
        ...

    async def listed(self, desk: str | None = None) -> list[dict[str, Any]]:
        """The calls waiting now, as :meth:`PendingApproval.to_dict` data."""
        ...

    async def check(self, approval_id: str) -> None:
        """Raises :class:`UnknownApprovalError` when no approval has that id."""
        ...

    async def decide(self, approval_id: str, decision: Decision, operator: str,
                     note: str = "") -> dict[str, Any]:
        """Approves or denies a held call; the approval, answered.

        Raises:
            UnknownApprovalError: No such approval.
            ApprovalAlreadyResolvedError: It was answered, timed out or cancelled already.
        """
        ...


class ApprovalBook:
    """Holds dangerous tool calls until an operator answers; the approval gate of a daemon.

    Every hold, and then its outcome, is written to ``records`` (when given) before the call
    goes on or is refused, so a restart knows whether a cut-off call could have run.

    Args:
        timeout_seconds: How long a held call waits; no answer means deny.
        notional_threshold: Orders above this value wait on every desk; None: only live.
        is_live: Whether a desk trades real money (its dangerous calls always wait).
        price_lookup: Values market orders: ``(desk, symbol) -> last price``.
        records: Where held calls are kept for recovery; None keeps nothing.
        clock: Seconds since the epoch (tests pass their own).

    Example::

        book = ApprovalBook.from_config(settings.operator, is_live=lambda d: modes[d] == "live")
        executor = ToolCallExecutor(registry, approval_gate=book)
    """

    def __init__(
        self,
        *,
        timeout_seconds: float = 300.0,
        notional_threshold: float | None = None,
        is_live: Callable[[str], bool] | None = None,
        price_lookup: PriceLookup | None = None,
        records: ApprovalRecords | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be positive")
        self.timeout_seconds = timeout_seconds
        self.notional_threshold = notional_threshold
        self._is_live = is_live or (lambda desk: False)
        self._price_lookup = price_lookup
        self._records = records
        self._clock = clock
        self._pending: dict[str, PendingApproval] = {}
        self._resolved: OrderedDict[str, PendingApproval] = OrderedDict()
        # Per desk: (time, notional) of the orders that passed without approval.
        self._unapproved: dict[str, deque[tuple[float, float]]] = {}

    @classmethod
    def from_config(cls, config: OperatorConfig, *, is_live: Callable[[str], bool] | None = None,
                    price_lookup: PriceLookup | None = None,
                    records: ApprovalRecords | None = None) -> ApprovalBook:
        """A book with the configured timeout and threshold.

        Args:
            config: The operator settings.
            is_live: Whether a desk trades real money.
            price_lookup: Values market orders.
            records: Where held calls are kept for recovery (the store).

        Returns:
            The book.
        """
        return cls(timeout_seconds=config.approval_timeout_seconds,
                   notional_threshold=config.approval_notional_threshold,
                   is_live=is_live, price_lookup=price_lookup, records=records)

    # ------------------------------------------------------------------ the gate

    async def review(self, tool: Tool, arguments: BaseModel, context: ToolContext) -> str | None:
        """Lets a call run (None), or holds it for an operator and returns why it was refused.

        Args:
            tool: The tool called.
            arguments: Its validated arguments.
            context: The desk, turn and call, and the bus to publish on.

        Returns:
            None to run the call; otherwise the text the model reads instead of a result.
        """
        if not tool.dangerous:
            return None
        data = arguments.model_dump(mode="json")
        reason, is_order, notional = await self._why_hold(context.desk, data)
        if reason is None:
            return None
        approval = self._hold(tool, data, reason, notional, context)
        try:
            await self._record(approval)
            with anyio.move_on_after(self.timeout_seconds):
                await approval._decided.wait()
        except BaseException:
            # The turn was cancelled (shutdown) while waiting: close the approval so no one
            # approves a call that will never run.
            self._settle(approval, "cancelled", "", "the turn was cancelled")
            with anyio.CancelScope(shield=True):
                await self._record(approval)
            raise
        if approval.outcome is None:
            self._settle(approval, "timed_out", "", "")
        await self._record(approval)  # before the call runs or is refused
        return self._verdict(approval, is_order)

    async def _record(self, approval: PendingApproval) -> None:
        if self._records is not None:
            await self._records.record_approval(approval.desk, approval.turn,
                                                approval.call_id, approval.id,
                                                approval.outcome)

    async def _why_hold(self, desk: str,
                        data: dict[str, Any]) -> tuple[str | None, bool, float | None]:
        """Why a dangerous call must wait (None: it need not), whether it is an order, value."""
        is_order, notional = order_notional(data)
        if is_order and (notional is None or _is_sell(data)):
            notional = await self._with_last_price(desk, data)
        if self._is_live(desk):
            return "the desk trades live", is_order, notional
        threshold = self.notional_threshold
        if threshold is None or not is_order:
            return None, is_order, notional
        if notional is None:
            return (f"its notional could not be computed (the threshold is {threshold:g})",
                    is_order, notional)
        if notional > threshold:
            return (f"notional {notional:,.2f} is above the approval threshold {threshold:,.2f}",
                    is_order, notional)
        # No await from here to the append: concurrent calls cannot both slip under.
        recent = self._recent_unapproved(desk)
        if recent + notional > threshold:
            return (f"notional {notional:,.2f} plus {recent:,.2f} placed without approval in "
                    f"the last hour is above the approval threshold {threshold:,.2f}",
                    is_order, notional)
        self._unapproved.setdefault(desk, deque()).append((self._clock(), notional))
        return None, is_order, notional

    async def _with_last_price(self, desk: str, data: dict[str, Any]) -> float | None:
        """The order's notional with the market's last price; None when that fails."""
        symbol = data.get("symbol")
        if self._price_lookup is None or not isinstance(symbol, str):
            return order_notional(data)[1]
        try:
            last = await self._price_lookup(desk, symbol.strip().upper())
        except Exception:  # no price means no notional: the order is held, not crashed
            return None
        return order_notional(data, last)[1]

    def _recent_unapproved(self, desk: str) -> float:
        """The notional the desk placed without approval in the last hour."""
        window = self._unapproved.get(desk)
        if not window:
            return 0.0
        since = self._clock() - _WINDOW_SECONDS
        while window and window[0][0] <= since:
            window.popleft()
        return sum(notional for _, notional in window)

    def _hold(self, tool: Tool, data: dict[str, Any], reason: str, notional: float | None,
              context: ToolContext) -> PendingApproval:
        approval_id = secrets.token_hex(4)
        while approval_id in self._pending or approval_id in self._resolved:
            approval_id = secrets.token_hex(4)
        now = self._clock()
        approval = PendingApproval(
            id=approval_id, desk=context.desk, turn=context.turn, call_id=context.call_id,
            tool=tool.name, arguments=data, reason=reason, notional=notional,
            requested_at=now, expires_at=now + self.timeout_seconds, _events=context.events)
        self._pending[approval_id] = approval
        context.events.publish(ApprovalRequested(
            desk=context.desk, turn=context.turn, approval_id=approval_id,
            call_id=context.call_id, tool=tool.name, arguments=json.dumps(data),
            reason=reason, notional=notional, expires_at=approval.expires_at))
        return approval

    def _verdict(self, approval: PendingApproval, is_order: bool) -> str | None:
        not_done = "not placed" if is_order else "not run"
        if approval.outcome == "approved":
            return None
        if approval.outcome == "denied":
            because = approval.note or "no reason given"
            return (f"Denied by operator {approval.operator or 'unknown'}: {because}. "
                    f"The {approval.tool} call was {not_done}.")
        return (f"Timed out waiting for approval after {self.timeout_seconds:g} s: "
                f"{not_done}. No operator answered; do not retry it unless asked.")

    # ------------------------------------------------------------------ the operator side

    def pending(self, desk: str | None = None) -> list[PendingApproval]:
        """The calls waiting now, oldest first.

        Args:
            desk: Only this desk's; None for all.

        Returns:
            The pending approvals.
        """
        return [a for a in self._pending.values() if desk is None or a.desk == desk]

    async def listed(self, desk: str | None = None) -> list[dict[str, Any]]:
        """:meth:`pending`, as the API shows it (:class:`Approvals`)."""
        return [approval.to_dict() for approval in self.pending(desk)]

    async def check(self, approval_id: str) -> None:
        """:meth:`get`, for :class:`Approvals`."""
        self.get(approval_id)

    async def decide(self, approval_id: str, decision: Decision, operator: str,
                     note: str = "") -> dict[str, Any]:
        """:meth:`approve` or :meth:`deny`, for :class:`Approvals`."""
        return self._decide(approval_id, decision, operator, note).to_dict()

    def pending_count(self, desk: str) -> int:
        """How many of a desk's calls wait (for its status)."""
        return sum(1 for a in self._pending.values() if a.desk == desk)

    def get(self, approval_id: str) -> PendingApproval:
        """An approval, pending or recently answered.

        Raises:
            UnknownApprovalError: No such approval.
        """
        approval = self._pending.get(approval_id) or self._resolved.get(approval_id)
        if approval is None:
            raise UnknownApprovalError(f"no approval with id {approval_id!r}")
        return approval

    def approve(self, approval_id: str, operator: str, note: str = "") -> PendingApproval:
        """Lets a held call run.

        Args:
            approval_id: The approval.
            operator: Who approves.
            note: Why, for the record.

        Returns:
            The approval, now approved.

        Raises:
            UnknownApprovalError: No such approval.
            ApprovalAlreadyResolvedError: It was answered, timed out or cancelled already.
        """
        return self._decide(approval_id, "approved", operator, note)

    def deny(self, approval_id: str, operator: str, reason: str = "") -> PendingApproval:
        """Refuses a held call; the model reads the operator's reason.

        Args:
            approval_id: The approval.
            operator: Who denies.
            reason: Why; the model reads it.

        Returns:
            The approval, now denied.

        Raises:
            UnknownApprovalError: No such approval.
            ApprovalAlreadyResolvedError: It was answered, timed out or cancelled already.
        """
        return self._decide(approval_id, "denied", operator, reason)

    def _decide(self, approval_id: str, outcome: ApprovalOutcome, operator: str,
                note: str) -> PendingApproval:
        approval = self.get(approval_id)
        if approval.outcome is not None:
            raise ApprovalAlreadyResolvedError(approval)
        self._settle(approval, outcome, operator, note)
        return approval

    def _settle(self, approval: PendingApproval, outcome: ApprovalOutcome, operator: str,
                note: str) -> None:
        """Records the outcome once, publishes it, and wakes the waiting call."""
        if approval.outcome is not None:
            return
        approval.outcome, approval.operator, approval.note = outcome, operator, note
        self._pending.pop(approval.id, None)
        self._resolved[approval.id] = approval
        while len(self._resolved) > _RESOLVED_KEPT:
            self._resolved.popitem(last=False)
        if approval._events is not None:
            approval._events.publish(ApprovalResolved(
                desk=approval.desk, turn=approval.turn, approval_id=approval.id,
                call_id=approval.call_id, tool=approval.tool, outcome=outcome,
                operator=operator, note=note))
        approval._decided.set()
