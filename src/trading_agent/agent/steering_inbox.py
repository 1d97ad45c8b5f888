"""Operator messages that arrive while a desk works.

The loop takes them before each model call of a turn (so after the tool round in flight,
never in the middle of it: a tool call that started always finishes) and adds them to the
conversation as operator messages, marked for the model as a person's words sent while it
was working. Each delivery is published as a ``SteeringDelivered`` event. A silent
memory-flush turn delivers nothing; the messages wait for the real turn.

**A message that arrives while the model writes its final answer** is not lost: when
:meth:`AgentLoop.run_turn` gets a final answer (or ends at the round limit) and the inbox
is not empty, it ends that turn (``TurnEnded``) and, inside the same call, starts the next
one (``TurnStarted``, trigger kind ``operator``) with the oldest waiting message as its
trigger (``SteeringDelivered`` with ``started_turn=True``); any others are delivered before
that turn's first model call. ``run_turn`` returns the last turn's result. It does not
follow up after a stop request (shutdown) or when it raises; a message it took but could
not add to the conversation before raising (the compaction before the next turn failed) is
put back at the front of the inbox.

So for the daemon: while ``run_turn`` runs, put the operator's messages in the inbox; once it
returns or raises, the desk is idle again, and any message still in the inbox (put after the
loop's last look, or left by a stop or an error) must start a turn:
``inbox.take_next().to_trigger()``. A loop without an inbox (a subagent) runs the same code
and never follows up.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import anyio

from trading_agent.agent.conversation import ImageBlock, Message, TextBlock
from trading_agent.agent.trigger import Trigger

__all__ = ["SteeringInbox", "SteeringMessage"]


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
    id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_message(self) -> Message:
        """The message the model reads, marked as coming from a human operator mid-turn."""
        text = f"[Message from {self.source}, a human operator, sent while you were working]\n"
        return Message(role="user", content=(TextBlock(text + self.text), *self.images),
                       kind="steering", id=self.id, created_at=self.queued_at)

    def to_trigger(self) -> Trigger:
        """The trigger of a turn this message starts (it came too late for the last one)."""
        return Trigger(kind="operator", text=self.text, source=self.source, images=self.images,
                       id=self.id, at=self.queued_at)


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
