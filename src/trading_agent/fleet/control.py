"""The operator's view of a fleet: every desk, whichever daemon runs it.

:class:`FleetControl` is the :class:`~trading_agent.daemon.control.DeskControl` of a daemon
in a fleet. A desk this daemon holds is answered by its own supervisor; any other goes over
NATS to the daemon that holds it:

- an operator's message (or a trigger) goes to the desk's inbox on JetStream, with its id
  as the message id, so that it is kept, reaches whoever holds the desk (now, or after a
  take-over), and is taken once (:class:`DeskService` acknowledges it once stored);
- a request that needs an answer (status, pause, retry, the kill switch, a reply to wait
  for, the standing instructions) is asked of the holder and answered by it
  (:class:`DeskService`); a daemon that starts serving a desk reads its pins from the
  shared store, so the pins made while another daemon held it are sent.

Transcripts come from the shared store. The live events come from the fleet's one event
stream, so every daemon shows every desk's events with the same ids (the stream's
sequence), and a viewer can resume on any daemon.

Approvals are listed and answered on any daemon (:mod:`trading_agent.fleet.approvals`).
Outside this: ``reload`` is refused in a fleet (see :mod:`trading_agent.app.services`).
"""

from __future__ import annotations

import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import date
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import structlog

from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.daemon.control import (
    DeskReply,
    DeskStatus,
    DeskUnreachableError,
    MessageNotKeptError,
    UnknownDeskError,
)
from trading_agent.daemon.mailbox import Delivery
from trading_agent.daemon.pins import PinRefusedError, UnknownPinError
from trading_agent.fleet.approvals import answer_approval
from trading_agent.fleet.checks import check_inbox_message, check_request
from trading_agent.fleet.sealing import SealRefused

if TYPE_CHECKING:
    from trading_agent.daemon.supervisor import Supervisor
    from trading_agent.fleet.bus import DeskInbox, FleetBus, InboxMessage
    from trading_agent.fleet.member import FleetMember
    from trading_agent.operator.approvals import ApprovalBook
    from trading_agent.store.desk_leases import DeskLeases

__all__ = ["DeskService", "FleetControl", "FleetTranscripts", "TakenMessages"]

_log = structlog.get_logger(__name__)

_REQUEST_SECONDS = 10.0
"""How long a request to another daemon waits for its answer."""

_STATUS_SECONDS = 2.0
"""How long a desk's status waits for the daemon holding it (a paused or dying daemon must
not hold up ``desks``); then the leases answer."""

_REPLY_SECONDS = 3600.0
"""How long ``send --wait`` waits for a desk held elsewhere to end the turn."""


def encode_images(images: Sequence[ImageBlock]) -> list[dict[str, str]]:
    """Pictures as JSON for the bus."""
    return [{"media_type": image.media_type, "description": image.description,
             "data": base64.b64encode(image.data).decode("ascii")} for image in images]


def decode_images(items: Sequence[dict[str, str]]) -> list[ImageBlock]:
    """Pictures from the bus."""
    return [ImageBlock(base64.b64decode(item["data"]), item["media_type"],
                       item.get("description", "")) for item in items]


class FleetTranscripts(Protocol):
    """The shared store's transcripts, which every daemon of the fleet reads
    (:class:`~trading_agent.store.transcripts.SqliteTranscripts` has it)."""

    async def transcript(self, desk: str, before_seq: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]:
        """A page of a desk's stored messages, oldest first."""
        ...


class TakenMessages(Protocol):
    """The operator messages a daemon of the fleet kept
    (:class:`~trading_agent.store.operator_inbox.SqliteOperatorInbox` has it)."""

    async def has_operator_message(self, desk: str, message_id: str) -> bool:
        """Whether an operator's message of this id was kept for ``desk``."""
        ...


class FleetControl:
    """Every desk of the fleet, for the operator API of one daemon.

    Args:
        local: This daemon's supervisor (the desks it holds).
        member: This daemon's leases.
        bus: The fleet's NATS.
        leases: Who holds which desk (for the ``daemon`` of a desk held elsewhere).
        transcripts: The shared store's transcripts.
        desks: Every desk of the config, in config order.
    """

    def __init__(self, local: Supervisor, member: FleetMember, bus: FleetBus,
                 leases: DeskLeases, transcripts: FleetTranscripts,
                 desks: Sequence[str]) -> None:
        self.local = local
        self.member = member
        self.bus = bus
        self.leases = leases
        self.transcripts = transcripts
        self.desks = list(desks)
        self.event_bus: EventBus = local.event_bus
        self.daemon_id = member.daemon_id
        self._limits: dict[str, int | None] = {}
        self._deliveries: dict[str, Delivery] = {}
        """Each desk held elsewhere: its message limit, as its daemon last said."""

    # ------------------------------------------------------------------ where a desk runs

    def desk_names(self) -> Sequence[str]:
        """Every desk of the fleet, in config order."""
        return list(self.desks)

    def desks_here(self) -> list[str]:
        """The desks this daemon runs now (it samples their equity)."""
        return [desk for desk in self.desks if self.holds(desk)]

    def _known(self, desk: str) -> None:
        if desk not in self.desks:
            raise UnknownDeskError(desk)

    def holds(self, desk: str) -> bool:
        """Whether this daemon runs ``desk`` now.

        Raises:
            UnknownDeskError: The fleet has no such desk.
        """
        self._known(desk)
        return desk in self.member.held and desk in self.local.desk_names()

    async def ask(self, desk: str, request: dict[str, Any],
                  timeout: float = _REQUEST_SECONDS) -> Any:  # noqa: ASYNC109 (NATS' own)
        """Asks the daemon holding ``desk``; its answer's ``result``.

        Raises:
            DeskUnreachableError: That daemon failed to do it, or no daemon holds the desk now.
        """
        from trading_agent.fleet.bus import DeskUnreachable

        try:
            answer = await self.bus.request_control(desk, request, timeout=timeout)
        except DeskUnreachable as exc:
            raise DeskUnreachableError(f"desk {desk}: no daemon of the fleet answers for it now "
                                  f"(it may be moving to another daemon; try again in a few "
                                  f"seconds): {exc}") from exc
        if "error" in answer:
            raise DeskUnreachableError(f"desk {desk}: {answer['error']}")
        return answer.get("result")

    # ------------------------------------------------------------------ DeskControl

    async def desk_status(self, desk: str) -> DeskStatus:
        """A desk's status, from the daemon holding it; when none answers, what the
        leases say (stopped, and who held it last)."""
        if self.holds(desk):
            status = await self.local.desk_status(desk)
            return status.model_copy(update={"daemon": self.daemon_id})
        lease = await self.leases.lease(desk)
        holder = lease.holder if lease is not None and lease.live else ""
        if holder:
            try:
                return DeskStatus.model_validate(
                    await self.ask(desk, {"op": "status"}, timeout=_STATUS_SECONDS))
            except DeskUnreachableError as exc:
                _log.warning("fleet_status_unavailable", desk=desk, daemon=holder,
                             error=str(exc))
        return DeskStatus(name=desk, state="stopped", daemon=holder)

    async def send_message(self, desk: str, text: str, source: str = "operator",
                           images: Sequence[ImageBlock] = (), *,
                           message_id: str | None = None) -> str:
        """A desk held here: as on one daemon. Elsewhere: kept in the desk's inbox on
        JetStream (acknowledged by the server) for whoever holds it; the same
        ``message_id`` again is kept once (by the stream, and by the holder's store).

        Raises:
            MessageNotKeptError: NATS did not keep it, or did not confirm it.
        """
        if self.holds(desk):
            return await self.local.send_message(desk, text, source, images,
                                                 message_id=message_id)
        from trading_agent.fleet.bus import FleetUnavailableError

        message_id = message_id or uuid.uuid4().hex
        # The holder waits for the answer from now, so that send --wait gets it even when
        # the turn ends at once (and says the desk's message limit); a desk moving
        # meanwhile: the message waits in its inbox.
        expected: Any = None
        with contextlib.suppress(DeskUnreachableError):
            expected = await self.ask(desk, {"op": "expect", "message_id": message_id},
                                      timeout=_STATUS_SECONDS)
        expected = expected if isinstance(expected, dict) else {}
        limit = expected.get("limit")
        self._limits[desk] = limit if type(limit) is int else None
        # Its holder's mailbox takes it later, from the inbox: steering if that desk was in
        # a turn when asked (a desk that did not answer: a turn of its own).
        self._deliveries[desk] = "steering" if expected.get("in_turn") is True else "turn"
        try:
            await self.bus.send_to_desk(desk, message_id, {
                "op": "message", "desk": desk, "text": text, "source": source,
                "images": encode_images(images)})
        except FleetUnavailableError as exc:
            raise MessageNotKeptError(str(exc), exc.kept) from exc
        return message_id

    def message_delivery(self, desk: str, message_id: str) -> Delivery:
        """How the desk took the message just sent: from its mailbox when it runs here,
        else as its daemon said when it was sent."""
        if self.holds(desk):
            return self.local.message_delivery(desk, message_id)
        return self._deliveries.get(desk, "turn")

    def message_limit(self, desk: str) -> int | None:
        """The desk's message limit: from this daemon when it runs here, else as its daemon
        said when the last message was sent to it (None: unknown, or no limit)."""
        return self.local.message_limit(desk) if self.holds(desk) else self._limits.get(desk)

    async def wait_for_reply(self, desk: str, message_id: str) -> DeskReply:
        """The end of the turn that read a message, from whichever daemon runs the desk."""
        if self.holds(desk):
            return await self.local.wait_for_reply(desk, message_id)
        answer = await self.ask(desk, {"op": "reply", "message_id": message_id},
                                timeout=_REPLY_SECONDS)
        return DeskReply.model_validate(answer)

    async def pause(self, desk: str, by: str, reason: str) -> bool:
        """Holds the desk, on the daemon that runs it."""
        if self.holds(desk):
            return await self.local.pause(desk, by, reason)
        return bool(await self.ask(desk, {"op": "pause", "by": by, "reason": reason}))

    async def resume(self, desk: str, by: str) -> int | None:
        """Lets the desk take turns again, on the daemon that runs it."""
        if self.holds(desk):
            return await self.local.resume(desk, by)
        result = await self.ask(desk, {"op": "resume", "by": by})
        return None if result is None else int(result)

    async def set_reduce_only(self, on: bool, *, desk: str, by: str,
                              reason: str = "") -> dict[str, Any]:
        """The desk's reduce-only, on the daemon that runs it."""
        if self.holds(desk):
            return await self.local.set_reduce_only(on, desk=desk, by=by, reason=reason)
        return dict(await self.ask(desk, {"op": "reduce_only", "on": on, "by": by,
                                          "reason": reason}))

    def cancel_turn(self, desk: str, by: str, *, now: bool = False) -> bool:
        """Ends the desk's running turn; for a desk held elsewhere the request is sent and
        True returned (whether a turn ran is known to that daemon)."""
        if self.holds(desk):
            return self.local.cancel_turn(desk, by, now=now)
        self.local.start_task(f"cancel {desk}", lambda: self._cancel_elsewhere(desk, by, now))
        return True

    async def _cancel_elsewhere(self, desk: str, by: str, now: bool) -> None:
        try:
            await self.ask(desk, {"op": "cancel", "by": by, "now": now})
        except DeskUnreachableError as exc:
            _log.warning("fleet_cancel_failed", desk=desk, error=str(exc))

    async def retry(self, desk: str, by: str) -> int:
        """Runs the desk's last turn again, on the daemon that runs it."""
        if self.holds(desk):
            return await self.local.retry(desk, by)
        return int(await self.ask(desk, {"op": "retry", "by": by}))

    async def compact(self, desk: str) -> bool:
        """Compacts the desk's conversation, on the daemon that runs it."""
        if self.holds(desk):
            return await self.local.compact(desk)
        return bool(await self.ask(desk, {"op": "compact"}, timeout=_REPLY_SECONDS))

    async def set_kill_switch(self, on: bool, *, desk: str | None, by: str, reason: str = "",
                              cancel_orders: bool = False,
                              flatten: bool = False) -> dict[str, Any]:
        """A desk's switch on the daemon that runs it; every desk's on every daemon (each
        daemon switches its own, and handles the orders of the desks it holds)."""
        request = {"op": "kill_switch", "on": on, "by": by, "reason": reason,
                   "cancel_orders": cancel_orders, "flatten": flatten}
        if desk is not None:
            if self.holds(desk):
                return await self.local.set_kill_switch(
                    on, desk=desk, by=by, reason=reason, cancel_orders=cancel_orders,
                    flatten=flatten)
            return dict(await self.ask(desk, {**request, "desk": desk}))
        result = await self.local.set_kill_switch(
            on, desk=None, by=by, reason=reason, cancel_orders=cancel_orders, flatten=flatten)
        leases = await self.leases.leases()
        asked: set[str] = {self.daemon_id}
        for name in self.desks:  # one desk per other daemon: its switch covers all its desks
            lease = leases.get(name)
            if lease is None or not lease.live or lease.holder in asked:
                continue
            asked.add(lease.holder)
            try:
                other = await self.ask(name, {**request, "desk": None})
            except DeskUnreachableError as exc:
                result["failed"].append(f"daemon {lease.holder}: {exc}")
                continue
            for key in ("cancelled", "flattened", "failed"):
                result[key] += other.get(key, [])
        return result

    async def books(self, desk: str, view: str, *, since: date | None = None,
                    open_only: bool = False, period: str = "daily") -> dict[str, Any]:
        """A view of the desk's books, from the daemon that runs it (its marks are live
        there)."""
        if self.holds(desk):
            return await self.local.books(desk, view, since=since, open_only=open_only,
                                          period=period)
        return dict(await self.ask(desk, {
            "op": "books", "view": view, "since": since.isoformat() if since else None,
            "open_only": open_only, "period": period}))

    async def pinned(self, desk: str) -> dict[str, Any]:
        """The desk's standing instructions, from the daemon that runs it."""
        if self.holds(desk):
            return await self.local.pinned(desk)
        return dict(await self.ask(desk, {"op": "pins"}))

    async def pin(self, desk: str, text: str, by: str) -> dict[str, Any]:
        """Pins an instruction on the daemon that runs the desk: it keeps the pin in the
        shared store, measures it against the desk's window and sends it from the desk's
        next request.

        Raises:
            PinRefusedError: Empty, too long, or too large for the desk's window.
        """
        if self.holds(desk):
            return await self.local.pin(desk, text, by)
        return _pin_answer(await self.ask(desk, {"op": "pin", "text": text, "by": by}))

    async def unpin(self, desk: str, pin_id: int, by: str) -> dict[str, Any]:
        """Takes a pin off, on the daemon that runs the desk.

        Raises:
            UnknownPinError: The desk has no pin of that id.
        """
        if self.holds(desk):
            return await self.local.unpin(desk, pin_id, by)
        return _pin_answer(await self.ask(desk, {"op": "unpin", "pin_id": pin_id, "by": by}))

    async def cancel_order(self, desk: str, order_id: str, by: str) -> dict[str, Any]:
        """Cancels one of the desk's open orders, on the daemon that runs it."""
        if self.holds(desk):
            return await self.local.cancel_order(desk, order_id, by)
        return dict(await self.ask(desk, {"op": "cancel_order", "order_id": order_id,
                                          "by": by}))

    def kill_switch_halts(self) -> list[dict[str, str]]:
        """The switches on, as this daemon knows them."""
        return self.local.kill_switch_halts()

    async def reload(self, by: str) -> list[str]:
        """Refused in a fleet, saying why (the supervisor's reloader does)."""
        return await self.local.reload(by)

    async def transcript(self, desk: str, *, before: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]:
        """A page of the desk's messages, from the shared store."""
        self._known(desk)
        return await self.transcripts.transcript(desk, before_seq=before, limit=limit)

    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]:
        """The fleet's kept events after a stream sequence."""
        events = await self.bus.events_between(after_id, limit, desk)
        return [{**event.data, "id": event.seq} for event in events]

    async def event_feed(self, after: int | None = None
                         ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Every desk's events, live, numbered by the fleet's stream."""
        async with contextlib.aclosing(self.bus.events(after)) as events:
            async for event in events:
                yield event.seq, {**event.data, "id": event.seq}


_ANSWER_GRACE = 1.0
"""Seconds a desk handed over (or a daemon stopping) gives the requests being answered to end
(the answers of its last turn, which go out at once); those still waiting are then told that
the desk left."""

_EXPECTED_MAX = 1000
"""The most answers a holder waits for on behalf of senders at once (the oldest go first)."""


def _pin_answer(result: Any) -> dict[str, Any]:
    """The holder's answer to a pin or an unpin, its refusal raised here as it was there."""
    answer = dict(result)
    refused = answer.get("refused")
    if isinstance(refused, dict):
        if refused.get("kind") == "unknown_pin":
            raise UnknownPinError(str(refused.get("message")))
        raise PinRefusedError(str(refused.get("message")), str(refused.get("code")))
    return answer


@dataclass(eq=False)
class _Expected:
    """The answer to a message sent from another daemon, awaited from before it was sent."""

    reply: DeskReply | None = None
    done: anyio.Event = field(default_factory=anyio.Event)


class DeskService:
    """Answers, for a desk this daemon holds, what other daemons ask of it, and takes the
    messages and triggers of its inbox.

    Args:
        local: This daemon's supervisor.
        bus: The fleet's NATS.
        inbox: The shared store's operator messages (to know a message already taken).
        approvals: This daemon's approval book (the calls its desks hold), which operators
            on other daemons list and answer.
    """

    def __init__(self, local: Supervisor, bus: FleetBus, inbox: TakenMessages,
                 approvals: ApprovalBook | None = None) -> None:
        self.local = local
        self.bus = bus
        self.inbox = inbox
        self.approvals = approvals
        self._expected: dict[str, _Expected] = {}
        self._inboxes: dict[str, DeskInbox] = {}
        self._serving: set[str] = set()
        self._handing_over: set[str] = set()

    async def run(self, desk: str) -> None:
        """Serves ``desk`` until cancelled (its lease lost or handed over)."""
        self._serving.add(desk)
        try:
            # Pins made while another daemon held the desk are in the shared store, not here.
            await self.local.pins.reload(self.local.desk(desk))
            async with anyio.create_task_group() as waiting:
                served = await self.bus.serve_control(
                    desk, lambda request: self._answer(desk, request, waiting))
                try:
                    await self._take_inbox(desk)
                    if desk in self._handing_over:
                        await anyio.sleep_forever()  # the requests, until the desk stopped
                finally:
                    grace = _ANSWER_GRACE if desk in self._handing_over else 0.0
                    with anyio.CancelScope(shield=True):
                        await served.stop(grace)
                    waiting.cancel_scope.cancel()
        finally:  # a desk taken again later starts afresh
            self._serving.discard(desk)
            self._handing_over.discard(desk)

    async def _take_inbox(self, desk: str) -> None:
        """Takes the desk's inbox messages until the inbox closes (:meth:`stop_taking`, or
        the bus closing)."""
        inbox = self._inboxes[desk] = await self.bus.inbox(desk)
        try:
            if desk in self._handing_over:
                await inbox.close()  # asked before the inbox was open
            async for message in inbox:
                await self._take(desk, message)
        finally:
            self._inboxes.pop(desk, None)
            with anyio.CancelScope(shield=True):
                await inbox.close()

    async def stop_taking(self, desk: str) -> None:
        """A graceful hand-over's first step: the desk's inbox is closed (a message sent from
        now waits there for the next holder) while its requests are still answered. When
        :meth:`run` is then cancelled (the desk's last turn ended), the requests being
        answered get :data:`_ANSWER_GRACE` seconds to end: a ``send --wait`` whose turn ended
        here gets its answer, not word that the desk left."""
        if desk not in self._serving:
            return  # nothing runs for it here (a service between two attempts)
        self._handing_over.add(desk)
        inbox = self._inboxes.get(desk)
        if inbox is not None:
            await inbox.close()

    def stopping(self) -> None:
        """The daemon is stopping (a supervisor's ``on_shutdown``): when each desk's
        :meth:`run` is cancelled, once the desks have stopped, the requests being answered
        get the same grace, so a ``send --wait`` gets the outcome of the turn the shutdown
        stopped."""
        self._handing_over.update(self._serving)

    def _expect(self, desk: str, message_id: str, waiting: anyio.abc.TaskGroup) -> None:
        """Starts waiting for the answer to a message before it is sent, so that a turn
        that ends before the sender asks for the answer still gives it."""
        if message_id in self._expected:
            return
        while len(self._expected) >= _EXPECTED_MAX:
            self._expected.pop(next(iter(self._expected)))
        expected = self._expected[message_id] = _Expected()

        async def wait() -> None:
            expected.reply = await self.local.wait_for_reply(desk, message_id)
            expected.done.set()

        waiting.start_soon(wait)

    async def _reply(self, desk: str, message_id: str) -> DeskReply:
        expected = self._expected.get(message_id)
        if expected is None:
            return await self.local.wait_for_reply(desk, message_id)
        await expected.done.wait()
        self._expected.pop(message_id, None)
        assert expected.reply is not None
        return expected.reply

    async def _take(self, desk: str, message: InboxMessage) -> None:
        payload = message.payload
        try:
            check_inbox_message(desk, payload)
        except SealRefused as exc:
            self.bus.refusals.refused("inbox message", f"{desk} {message.message_id}", exc)
            await message.ack()  # refused for good: it never comes again
            return
        if message.delivered > 1 and await self.inbox.has_operator_message(
                desk, message.message_id):
            pass  # a daemon stored it and died before acknowledging: it is the store's now
        elif payload.get("op") == "message":
            await self.local.desk(desk).send_message(
                payload["text"], payload.get("source", "operator"),
                decode_images(payload.get("images", [])), message_id=message.message_id)
        else:
            _log.warning("fleet_inbox_unknown", desk=desk, op=payload.get("op"))
        await message.ack()  # stored: a holder that dies now leaves it to the store

    async def _pin(self, desk: str, request: dict[str, Any]) -> dict[str, Any]:
        """A pin or an unpin asked by another daemon; a refusal is an answer, not a failure."""
        try:
            if request["op"] == "pin":
                if not isinstance(request.get("text"), str):
                    return {"refused": {"kind": "pin_refused", "code": "invalid_pin",
                                        "message": "text: not a string"}}
                return await self.local.pin(desk, request["text"], str(request["by"]))
            return await self.local.unpin(desk, int(request["pin_id"]), str(request["by"]))
        except PinRefusedError as exc:
            return {"refused": {"kind": "pin_refused", "code": exc.code, "message": str(exc)}}
        except UnknownPinError as exc:
            return {"refused": {"kind": "unknown_pin", "message": str(exc)}}

    async def _answer(self, desk: str, request: dict[str, Any],
                      waiting: anyio.abc.TaskGroup) -> dict[str, Any]:
        try:
            check_request(desk, request)
        except SealRefused as exc:
            self.bus.refusals.refused("control request", desk, exc)
            return {"error": f"the request was refused: {exc}"}
        op = request.get("op")
        local = self.local
        result: Any
        if op == "status":
            status = await local.desk_status(desk)
            result = status.model_copy(update={"daemon": self.bus.daemon_id}).model_dump()
        elif op == "expect":
            self._expect(desk, str(request["message_id"]), waiting)
            result = {"limit": local.message_limit(desk),
                      "in_turn": local.desk(desk).mailbox.in_turn}
        elif op == "reply":
            result = (await self._reply(desk, str(request["message_id"]))).model_dump()
        elif op == "pause":
            result = await local.pause(desk, str(request["by"]), str(request["reason"]))
        elif op == "resume":
            result = await local.resume(desk, str(request["by"]))
        elif op == "reduce_only":
            result = await local.set_reduce_only(bool(request["on"]), desk=desk,
                                                 by=str(request["by"]),
                                                 reason=str(request.get("reason", "")))
        elif op == "cancel":
            result = local.cancel_turn(desk, str(request["by"]), now=bool(request["now"]))
        elif op == "retry":
            result = await local.retry(desk, str(request["by"]))
        elif op == "compact":
            result = await local.compact(desk)
        elif op == "kill_switch":
            result = await local.set_kill_switch(
                bool(request["on"]), desk=request.get("desk"), by=str(request["by"]),
                reason=str(request.get("reason", "")),
                cancel_orders=bool(request.get("cancel_orders")),
                flatten=bool(request.get("flatten")))
        elif op == "books":
            since = request.get("since")
            result = await local.books(
                desk, str(request["view"]),
                since=date.fromisoformat(since) if isinstance(since, str) else None,
                open_only=bool(request.get("open_only")),
                period=str(request.get("period", "daily")))
        elif op == "cancel_order":
            result = await local.cancel_order(desk, str(request["order_id"]),
                                              str(request["by"]))
        elif op == "pins":
            result = await local.pinned(desk)
        elif op in ("pin", "unpin"):
            result = await self._pin(desk, request)
        elif op in ("approvals", "decide") and self.approvals is not None:
            result = await answer_approval(self.approvals, request)
        else:
            return {"error": f"unknown request {op!r}"}
        return {"result": result}
