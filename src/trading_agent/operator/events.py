"""Events the operator side adds to a desk's stream: a tool call waits for a person, and the
person's answer.

They travel on the desk's :class:`~trading_agent.agent.event_bus.EventBus` like every other
step, so the store keeps them and every stream shows them in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from trading_agent.agent.events import Event

__all__ = ["ApprovalOutcome", "ApprovalRequested", "ApprovalResolved",
           "ReconciliationReported"]

ApprovalOutcome = Literal["approved", "denied", "timed_out", "cancelled"]


@dataclass(frozen=True, kw_only=True)
class ApprovalRequested(Event):
    """A dangerous tool call waits for an operator's approve or deny.

    Attributes:
        approval_id: What the operator names to approve or deny it.
        call_id: The tool call's id.
        tool: The tool's name.
        arguments: The validated arguments, as JSON text.
        reason: Why it needs approval (a live order, a notional above the threshold).
        notional: The order's value in the quote currency, when it could be computed.
        expires_at: When it is denied unless answered (seconds since the epoch).
    """

    type: ClassVar[str] = "approval_requested"
    approval_id: str
    call_id: str
    tool: str
    arguments: str
    reason: str
    notional: float | None
    expires_at: float


@dataclass(frozen=True, kw_only=True)
class ApprovalResolved(Event):
    """An approval was answered, timed out, or its turn was cancelled.

    Attributes:
        approval_id: The approval.
        call_id: The tool call's id.
        tool: The tool's name.
        outcome: approved, denied, timed_out or cancelled.
        operator: Who answered (empty when nobody did).
        note: The operator's reason or note.
    """

    type: ClassVar[str] = "approval_resolved"
    approval_id: str
    call_id: str
    tool: str
    outcome: ApprovalOutcome
    operator: str = ""
    note: str = ""


@dataclass(frozen=True, kw_only=True)
class ReconciliationReported(Event):
    """On start, a live exchange's open orders and balances differed from the journal
    (``trading.reconciliation``); the desk reads the same in its next turn.

    Attributes:
        exchange: The exchange's name.
        differences: Each difference, one readable line.
        adopted: The exchange ids of orders with our client id prefix now in the journal.
    """

    type: ClassVar[str] = "reconciliation"
    exchange: str
    differences: tuple[str, ...]
    adopted: tuple[str, ...] = ()
