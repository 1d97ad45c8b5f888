"""What the operator side may ask of the running daemon: the seam between them.

The supervisor implements :class:`DeskControl`; the operator API and the CLI use only this,
so either side can change behind it (and a future remote daemon is one more adapter).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import date
from typing import Any, Literal, Protocol

from pydantic import BaseModel

from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.daemon.mailbox import Delivery
from trading_agent.errors import TradingAgentError

__all__ = ["CancelRefusedError", "DeskControl", "DeskReply", "DeskState", "DeskStatus",
           "MessageNotKeptError", "UnknownDeskError", "UnknownOrderError",
           "message_id_for"]

DeskState = Literal["idle", "working", "paused", "stopped"]


class UnknownDeskError(KeyError):
    """No desk of that name runs in this daemon."""


class DeskUnreachableError(TradingAgentError):
    """In a fleet: the daemon holding a desk could not be asked, or could not do what was
    asked (its own error, as it said it)."""


class UnknownOrderError(TradingAgentError):
    """The desk has no open order of that id (the message names those it has)."""


class MessageNotKeptError(TradingAgentError):
    """An operator's message may not have been kept (a transient failure: the fleet's NATS
    down or slow).

    Args:
        message: What happened, readable by an operator.
        kept: False: certainly not kept (sending it again is needed). None: it may have
            been kept; sending it again with the same idempotency key is safe (it is stored
            and read once either way).
    """

    def __init__(self, message: str, kept: bool | None) -> None:
        super().__init__(message)
        self.kept = kept


def message_id_for(desk: str, idempotency_key: str) -> str:
    """The id of the message a client sends to ``desk`` under ``idempotency_key``: the same
    key gives the same id, so a message sent again (the client retrying after a failure or a
    lost answer) is stored, and read by the desk, once."""
    digest = hashlib.sha256(f"{desk}\0{idempotency_key}".encode()).hexdigest()
    return f"k{digest[:31]}"


class CancelRefusedError(TradingAgentError):
    """An order cannot be cancelled from here: the desk keeps no books (its orders cannot be
    told from the account's), or the exchange has not answered for the order yet."""


class DeskStatus(BaseModel):
    """One desk as an operator sees it.

    Attributes:
        name: The desk's name.
        state: idle, working, paused (its model is unavailable and it waits) or stopped.
        mode: paper or live.
        model: The model it talks to.
        symbols: The markets it trades.
        last_turn_at: When its last turn ended (seconds since the epoch), or None.
        last_turn_text: The final text of its last turn.
        equity: The desk's own equity in the quote currency, when known: a live desk's
            by its books (its profit at the marks), a paper desk's its account's value.
        open_orders: How many orders are open.
        tokens_today: Prompt plus completion tokens used today (UTC).
        cost_today: Their cost, when prices are configured.
        prompt_tokens_today: The prompt tokens among them.
        cached_tokens_today: The prompt tokens the model's server served from its prompt
            cache today.
        cache_share_today: ``cached_tokens_today / prompt_tokens_today``, or None when no
            prompt was sent today.
        pending_approvals: Tool calls waiting for an operator's decision.
        queued_triggers: Triggers waiting for the desk to be free.
        paused_reason: Why it is paused: an operator paused it, a spend cap is used up, or
            its model is unavailable.
        dropped_triggers: Triggers dropped since it was paused (``when_paused = "drop"``).
        kill_switch: Why new orders are refused ("halted by NAME at TIME: REASON"), or empty.
        spend: Today's use of each spend cap that applies to the desk (its own and the
            daemon's), each with ``scope``, ``measure``, ``used``, ``cap`` and ``share``.
        daemon: In a fleet, the daemon that holds the desk (empty when none does at the
            moment, or outside a fleet).
        realized_today: Profit the desk's own books realized today (UTC), quote fees
            subtracted, as a decimal string; None when it keeps no books (or they could not
            be read in time).
        unrealized: Profit of what its books hold now at the marks, as a decimal string;
            None when it keeps no books or a mark is missing.
        reduce_only: While the desk may only shrink its positions: ``by``, ``reason``,
            ``at``, ``until`` (None: until an operator lifts it), ``protection`` and
            ``text``; None otherwise.
    """

    name: str
    state: DeskState
    mode: str = "paper"
    model: str = ""
    symbols: list[str] = []
    last_turn_at: float | None = None
    last_turn_text: str = ""
    equity: float | None = None
    open_orders: int = 0
    tokens_today: int = 0
    cost_today: float | None = None
    prompt_tokens_today: int = 0
    cached_tokens_today: int = 0
    cache_share_today: float | None = None
    pending_approvals: int = 0
    queued_triggers: int = 0
    paused_reason: str = ""
    dropped_triggers: int = 0
    kill_switch: str = ""
    spend: list[dict[str, Any]] = []
    daemon: str = ""
    realized_today: str | None = None
    unrealized: str | None = None
    reduce_only: dict[str, Any] | None = None


class DeskReply(BaseModel):
    """The answer to an operator's message (``send --wait``): how the turn that read it ended.

    Attributes:
        ok: False when the turn failed, was cancelled or stopped.
        text: The desk's final text.
        error: Why it did not end well.
    """

    ok: bool
    text: str = ""
    error: str = ""


class DeskControl(Protocol):
    """The running daemon, as the operator API sees it."""

    event_bus: EventBus

    def desk_names(self) -> Sequence[str]:
        """The desks, in config order."""
        ...

    async def desk_status(self, desk: str) -> DeskStatus:
        """One desk's status.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def send_message(self, desk: str, text: str, source: str = "operator",
                           images: Sequence[ImageBlock] = (), *,
                           message_id: str | None = None) -> str:
        """Gives an operator's message to a desk: it steers a running turn (delivered after
        the current tool round) or starts a turn. Stored before this returns.

        ``images`` are the operator's pictures as sent (bytes, declared media type, a
        description); the desk sizes each to its limits before anything is stored. A caller
        with no pictures may leave the argument out. ``message_id`` (from
        :func:`message_id_for`): a message of that id sent before is not stored or read
        again.

        Returns:
            The message's id.

        Raises:
            UnknownDeskError: No such desk.
            ImageRejectedError: A picture is not one, not a PNG, JPEG, GIF or WebP, or too
                large; nothing was stored.
            MessageNotKeptError: It may not have been kept (a desk held by another daemon of
                a fleet, and NATS down or slow); ``kept`` says whether certainly not.
        """
        ...

    def message_delivery(self, desk: str, message_id: str) -> Delivery:
        """How the desk took a message :meth:`send_message` just gave it (call it right
        after, with no await between): ``steering`` a running turn, or a ``turn`` of its own.
        The desk's mailbox decides; this only tells.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    def message_limit(self, desk: str) -> int | None:
        """The most characters of one message the desk's model reads whole (a longer one is
        cut in the middle in what is sent; the store keeps it all); None for no limit.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def wait_for_reply(self, desk: str, message_id: str) -> DeskReply:
        """Waits for the end of the turn that read an operator's message (call it right after
        :meth:`send_message`, with no await between).

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def pause(self, desk: str, by: str, reason: str) -> bool:
        """Holds a desk: no turns until resumed; a running turn ends at its next safe point.

        Returns:
            False when it was held already.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def resume(self, desk: str, by: str) -> int | None:
        """Lets a held desk take turns again.

        Returns:
            How many triggers waited, or None when it was not held.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    def cancel_turn(self, desk: str, by: str, *, now: bool = False) -> bool:
        """Ends a desk's running turn at its next safe point, or at once with ``now``.

        Returns:
            False when no turn was running.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def retry(self, desk: str, by: str) -> int:
        """Runs a desk's last turn again from its trigger, its last answer taken out of what
        is sent (the store keeps it, marked).

        Returns:
            How many messages left what is sent.

        Raises:
            UnknownDeskError: No such desk.
            RetryRefusedError: The desk is in a turn, or has no turn to run again.
        """
        ...

    async def set_kill_switch(self, on: bool, *, desk: str | None, by: str, reason: str = "",
                              cancel_orders: bool = False,
                              flatten: bool = False) -> dict[str, Any]:
        """Switches a desk's kill switch (every desk's with ``desk`` None) on or off; with
        ``cancel_orders`` and ``flatten`` also cancels open orders and closes positions.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    def kill_switch_halts(self) -> list[dict[str, str]]:
        """The kill switches that are on."""
        ...

    async def set_reduce_only(self, on: bool, *, desk: str, by: str,
                              reason: str = "") -> dict[str, Any]:
        """Puts a desk in reduce-only (it may only shrink its positions) until an operator
        lifts it, or lifts it (whoever set it: an operator, a protection, a spend cap).

        Returns:
            ``on``, ``desk``, ``state`` (as :meth:`ReduceOnly.to_dict`, None when off) and
            ``was`` (the state lifted, when off).

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def reload(self, by: str) -> list[str]:
        """Reads the config file again and applies it.

        Returns:
            What changed, one line each.

        Raises:
            ConfigError: The config is not valid (or there is no file); nothing changed.
        """
        ...

    async def compact(self, desk: str) -> bool:
        """Flushes memory and compacts a desk's conversation now (waits for a running turn).

        Returns:
            True when something was compacted.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def transcript(self, desk: str, *, before: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]:
        """A page of a desk's stored messages, newest last, each as JSON-ready data with a
        ``seq`` (increasing per desk); ``before`` pages back from a ``seq``.

        Raises:
            UnknownDeskError: No such desk.
        """
        ...

    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]:
        """Stored events with id greater than ``after_id`` (for a reconnecting stream)."""
        ...

    async def books(self, desk: str, view: str, *, since: date | None = None,
                    open_only: bool = False, period: str = "daily") -> dict[str, Any]:
        """One view of a desk's own books, JSON-ready: ``positions``, ``orders``, ``trades``
        or ``profit`` (shapes in :mod:`trading_agent.daemon.books_view`). A desk without
        books answers empty lists and a zero summary.

        Raises:
            UnknownDeskError: No such desk.
            ValueError: An unknown view or period.
        """
        ...

    async def cancel_order(self, desk: str, order_id: str, by: str) -> dict[str, Any]:
        """Cancels one open order of a desk's own books on its exchange.

        Returns:
            ``desk`` and ``order``, the exchange's answer.

        Raises:
            UnknownDeskError: No such desk.
            UnknownOrderError: The desk has no open order of that id.
            CancelRefusedError: The desk keeps no books, or the order is not answered yet.
            ExchangeError: The exchange could not cancel it.
        """
        ...
