"""Operator messages that arrive while a desk works.

The loop takes them after each tool round, before the next model call, and adds them to the
conversation as operator messages. Nothing put in is lost: a message that arrives while the
model writes its final answer stays here and starts the desk's next turn.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import anyio

from trading_agent.agent.conversation import ImageBlock, Message, TextBlock

__all__ = ["SteeringInbox", "SteeringMessage"]


@dataclass(frozen=True)
class SteeringMessage:
    """One operator message waiting for the desk.

    Attributes:
        text: What the operator wrote.
        source: Who wrote it.
        images: Pictures the operator attached.
        queued_at: When it was put in, seconds since the epoch.
        id: A unique id (the store keeps it, so a restart neither loses nor repeats it).
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


class SteeringInbox:
    """A desk's queue of mid-turn operator messages."""

    def __init__(self) -> None:
        self._pending: deque[SteeringMessage] = deque()
        self._arrived = anyio.Event()

    def put(self, message: SteeringMessage) -> None:
        """Queues a message; never blocks."""
        self._pending.append(message)
        self._arrived.set()

    def take_all(self) -> list[SteeringMessage]:
        """Removes and returns every waiting message, oldest first."""
        taken = list(self._pending)
        self._pending.clear()
        if not self._pending:
            self._arrived = anyio.Event()
        return taken

    @property
    def pending(self) -> int:
        """How many messages wait."""
        return len(self._pending)

    async def wait(self) -> None:
        """Returns once at least one message waits."""
        while not self._pending:
            await self._arrived.wait()
