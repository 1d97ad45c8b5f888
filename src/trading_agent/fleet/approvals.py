"""A fleet's approvals, listed and answered on any daemon.

A call held for an operator waits in the :class:`~trading_agent.operator.approvals.ApprovalBook`
of the daemon that runs its desk: only there can it be let go. :class:`FleetApprovals` is
the operator API's view of every daemon's books:

- the list is this daemon's pending approvals and, asked at once with a short timeout, each
  other daemon's (a daemon that does not answer leaves its approvals out, and is logged);
- an answer to an approval held elsewhere goes to the daemon that runs its desk, which the
  shared store says (every held call is recorded there before it waits), and that daemon's
  book decides, as on one daemon: the same errors for an unknown approval or one already
  answered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog

from trading_agent.daemon.control import DeskUnreachableError
from trading_agent.operator.approvals import (
    ApprovalAlreadyResolvedError,
    ApprovalBook,
    Decision,
    PendingApproval,
    UnknownApprovalError,
)

if TYPE_CHECKING:
    from trading_agent.fleet.control import FleetControl

__all__ = ["ApprovalDesks", "FleetApprovals", "answer_approval"]

_log = structlog.get_logger(__name__)

_LIST_SECONDS = 2.0
"""How long the list waits for each other daemon (a paused one must not hold it up)."""


class ApprovalDesks(Protocol):
    """Which desk held a call under an approval id
    (:class:`~trading_agent.store.held_calls.SqliteHeldCalls` has it)."""

    async def approval_desk(self, approval_id: str) -> str | None:
        """The desk whose call was held under ``approval_id``, or None when none was."""
        ...


class FleetApprovals:
    """The :class:`~trading_agent.operator.approvals.Approvals` of a daemon in a fleet.

    Args:
        book: This daemon's approval book (its desks' held calls).
        control: The fleet's desks, and the way to the daemon that runs each.
        held_calls: The shared store's held calls (which desk held an approval).
    """

    def __init__(self, book: ApprovalBook, control: FleetControl,
                 held_calls: ApprovalDesks) -> None:
        self.book = book
        self.control = control
        self.held_calls = held_calls

    def pending_count(self, desk: str) -> int:
        """How many of a desk's calls wait on this daemon (a desk held elsewhere: its
        status, from its daemon, says)."""
        return self.book.pending_count(desk)

    async def listed(self, desk: str | None = None) -> list[dict[str, Any]]:
        """Every daemon's pending approvals (``desk``'s only, when given), oldest first."""
        found = await self.book.listed(desk)
        desks = [desk] if desk is not None else list(self.control.desk_names())
        leases = await self.control.leases.leases()
        asked: dict[str, str] = {}  # another daemon -> one of its desks to reach it by
        for name in desks:
            lease = leases.get(name)
            if lease is not None and lease.live and not self.control.holds(name):
                asked.setdefault(lease.holder, name)

        async def ask(daemon: str, name: str) -> None:
            try:
                answer = await self.control.ask(name, {"op": "approvals", "desk": desk},
                                                timeout=_LIST_SECONDS)
            except DeskUnreachableError as exc:
                _log.warning("fleet_approvals_unavailable", daemon=daemon, error=str(exc))
                return
            found.extend(answer)

        async with anyio.create_task_group() as group:
            for daemon, name in asked.items():
                group.start_soon(ask, daemon, name)
        return sorted(found, key=lambda approval: approval["requested_at"])

    async def check(self, approval_id: str) -> None:
        """Raises :class:`UnknownApprovalError` unless some desk's call was held under it."""
        await self._elsewhere(approval_id)

    async def decide(self, approval_id: str, decision: Decision, operator: str,
                     note: str = "") -> dict[str, Any]:
        """Approves or denies, on the daemon running the approval's desk.

        Raises:
            UnknownApprovalError: No such approval.
            ApprovalAlreadyResolvedError: It was answered, timed out or cancelled already.
            DeskUnreachableError: The daemon running its desk did not answer.
        """
        desk = await self._elsewhere(approval_id)
        if desk is None:
            return await self.book.decide(approval_id, decision, operator, note)
        answer = await self.control.ask(desk, {
            "op": "decide", "approval_id": approval_id, "decision": decision,
            "operator": operator, "note": note})
        if "resolved" in answer:
            raise ApprovalAlreadyResolvedError(PendingApproval.from_dict(answer["resolved"]))
        if "unknown" in answer:
            raise UnknownApprovalError(str(answer["unknown"]))
        return dict(answer["approval"])

    async def _elsewhere(self, approval_id: str) -> str | None:
        """None for an approval in this daemon's book; else the desk, held elsewhere, whose
        call was held under it.

        Raises:
            UnknownApprovalError: No desk's call was, or its desk runs here (and this
                daemon's book has long forgotten it).
        """
        try:
            self.book.get(approval_id)
        except UnknownApprovalError:
            desk = await self.held_calls.approval_desk(approval_id)
            if desk is None or desk not in self.control.desk_names() \
                    or self.control.holds(desk):
                raise
            return desk
        return None


async def answer_approval(book: ApprovalBook, request: dict[str, Any]) -> Any:
    """The holder's side: another daemon's ``approvals`` or ``decide`` request, answered
    from this daemon's book (an error of the book becomes data the asker raises again)."""
    if request["op"] == "approvals":
        desk = request.get("desk")
        return await book.listed(None if desk is None else str(desk))
    decision = request.get("decision")
    if decision not in ("approved", "denied"):
        raise ValueError(f"a decision must be approved or denied, not {decision!r}")
    try:
        approval = await book.decide(str(request["approval_id"]), decision,
                                     str(request["operator"]), str(request.get("note", "")))
    except UnknownApprovalError as exc:
        return {"unknown": str(exc)}
    except ApprovalAlreadyResolvedError as exc:
        return {"resolved": exc.approval.to_dict()}
    return {"approval": approval}
