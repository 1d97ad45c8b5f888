"""Why a turn runs: a tick, a schedule, an operator's message, a command, a subagent task."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from trading_agent.agent.conversation import ImageBlock, Message, MessageKind, TextBlock
from trading_agent.agent.ids import random_hex

__all__ = ["Trigger", "TriggerKind"]

TriggerKind = Literal["tick", "candle", "schedule", "operator", "command", "subagent", "resume"]

_MESSAGE_KINDS: dict[TriggerKind, MessageKind] = {
    "tick": "trigger",
    "candle": "trigger",
    "schedule": "trigger",
    "operator": "operator",
    "command": "trigger",
    "subagent": "trigger",
    "resume": "notice",
}


@dataclass(frozen=True)
class Trigger:
    """The reason for a turn, and what the desk is told about it.

    Attributes:
        kind: What woke the desk.
        text: What the desk is told (the operator's words, the price move, the schedule).
        source: Who or what sent it (an operator's name, a schedule's name, a symbol).
        images: Pictures sent with it (an operator's screenshot).
        merged: For coalesced ticks, how many ticks this one stands for.
        id: A unique id.
        at: When it fired, seconds since the epoch.
        after_answer: An operator's message that came while the last turn's final answer was
            written, too late for it: it opens this turn (the loop says so in a
            ``SteeringDelivered`` event with ``started_turn``).
    """

    kind: TriggerKind
    text: str
    source: str = ""
    images: tuple[ImageBlock, ...] = ()
    merged: int = 1
    id: str = field(default_factory=random_hex)
    at: float = field(default_factory=time.time)
    after_answer: bool = False

    def to_message(self) -> Message:
        """The user message that opens the turn; an operator's words are marked as such."""
        if self.kind == "operator":
            who = self.source or "operator"
            text = f"[Message from {who}, a human operator]\n{self.text}"
        elif self.kind == "command":
            text = self.text
        else:
            label = self.kind if self.merged <= 1 else f"{self.kind}, {self.merged} merged"
            text = f"[{label}{': ' + self.source if self.source else ''}]\n{self.text}"
        return Message(
            role="user",
            content=(TextBlock(text), *self.images),
            kind=_MESSAGE_KINDS[self.kind],
            id=self.id,
            created_at=self.at,
        )
