"""Operator messages that arrive while a desk works.

The loop takes them before each model call of a turn (so after the tool round in flight,
never in the middle of it: a tool call that started always finishes) and adds them to the
conversation as operator messages, marked for the model as a person's words sent while it
was working. Each delivery is published as a ``SteeringDelivered`` event. A silent
memory-flush turn delivers nothing; the messages wait for the real turn.

The loop reads them through :class:`Steering`, one method: the desk's mailbox
(:class:`trading_agent.daemon.mailbox.Mailbox`) is one, :class:`SteeringInbox` (for a loop
without a daemon) another; a subagent has none.

**A message that arrives while the model writes its final answer** is not lost, and not
answered inside that call: :meth:`AgentLoop.run_turn` runs one turn, and the message waits.
Its owner opens the next turn with it at once, ``message.to_trigger(after_answer=True)``:
the loop then publishes ``SteeringDelivered`` with ``started_turn=True``, and any other
waiting message is delivered before that turn's first model call.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from trading_agent.agent.conversation import ImageBlock, Message, TextBlock
from trading_agent.agent.ids import random_hex
from trading_agent.agent.trigger import Trigger

__all__ = ["Steering", "SteeringInbox", "SteeringMessage"]


@dataclass(frozen=True)
class SteeringMessage:
    """One operator message waiting for the desk.

    Attributes:
        text: What the operator wrote.
        source: Who wrote it.
        images: Pictures the operator attached (already sized by the ImagePreparer).
        queued_at: When it was put in, seconds since the epoch.
        id: A unique id (the store keeps it, so a restart neither loses nor repeats it); the
            message added to the conversation carries it.
    """

    text: str
    source: str = "operator"
    images: tuple[ImageBlock, ...] = ()
    queued_at: float = field(default_factory=time.time)
    id: str = field(default_factory=random_hex)

    def to_message(self) -> Message:
        """The message the model reads, marked as coming from a human operator mid-turn."""
        text = f"[Message from {self.source}, a human operator, sent while you were working]\n"
        return Message(role="user", content=(TextBlock(text + self.text), *self.images),
                       kind="steering", id=self.id, created_at=self.queued_at)

    def to_trigger(self, *, after_answer: bool = False) -> Trigger:
        """The trigger of a turn this message starts; ``after_answer`` when it came while
        the last turn's answer was written (too late for it)."""
        return Trigger(kind="operator", text=self.text, source=self.source, images=self.images,
                       id=self.id, at=self.queued_at, after_answer=after_answer)


class Steering(Protocol):
    """What the loop needs of whoever holds a desk's mid-turn messages."""

    def take_all(self) -> list[SteeringMessage]:
        """Removes and returns every message to deliver now, oldest first."""
        ...


class SteeringInbox:
    """A desk's queue of mid-turn operator messages; putting never blocks."""

    def __init__(self) -> None:
        self._pending: deque[SteeringMessage] = deque()
        self._arrived: anyio.Event | None = None

    def put(self, message: SteeringMessage) -> None:
        """Queues a message."""
        self._pending.append(message)
        if self._arrived is not None:
            self._arrived.set()

    def put_back(self, message: SteeringMessage) -> None:
        """Returns a taken message to the front of the queue (its delivery failed), so it is
        the next one taken."""
        self._pending.appendleft(message)
        if self._arrived is not None:
            self._arrived.set()

    def take_all(self) -> list[SteeringMessage]:
        """Removes and returns every waiting message, oldest first."""
        taken = list(self._pending)
        self._pending.clear()
        return taken

    def take_next(self) -> SteeringMessage | None:
        """Removes and returns the oldest waiting message, or None."""
        return self._pending.popleft() if self._pending else None

    @property
    def pending(self) -> int:
        """How many messages wait."""
        return len(self._pending)

    async def wait(self) -> None:
        """Returns once at least one message waits."""
        while not self._pending:
            if self._arrived is None or self._arrived.is_set():
                self._arrived = anyio.Event()
            await self._arrived.wait()
