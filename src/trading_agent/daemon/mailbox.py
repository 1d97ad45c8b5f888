"""A desk's one mailbox: what wakes it and what its operators write, in one owner.

Triggers (ticks and candles coalesced, operators' and commands' first, see
:class:`~trading_agent.daemon.trigger_queue.TriggerQueue`) and operator messages arrive here.
A message that comes while the desk is idle becomes a trigger; one that comes during a turn
waits to be delivered before the turn's next model call (the loop takes it through
:meth:`take_all`, the :class:`~trading_agent.agent.steering_inbox.Steering` protocol). When
a turn ends with messages still waiting (they came while the model wrote its final answer),
the oldest opens the next turn, ahead of every other trigger, and the others are delivered
before its first model call. Each message is taken once, by its id, whichever way it came
(sent, or found undelivered in the store by a restore), and the mailbox is the one that
says how it was taken (:meth:`Mailbox.delivery`): the operator API answers with that.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Literal

from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.daemon.trigger_queue import TriggerQueue

__all__ = ["Delivery", "Mailbox"]

Delivery = Literal["steering", "turn"]
"""How a message was taken: for the running turn (``steering``, read before its next model
call) or as a trigger of a turn of its own (``turn``)."""


class Mailbox:
    """One desk's triggers and operator messages.

    Attributes:
        triggers: The triggers waiting for a turn.
        in_turn: Whether a turn runs now (a message then waits for its next model call).
        on_take: Told of the messages each :meth:`take_all` hands the loop (a paper desk's
            journal notes where in the turn they were delivered, for a replay).
    """

    def __init__(self) -> None:
        self.triggers = TriggerQueue()
        self.in_turn = False
        self._steering: deque[SteeringMessage] = deque()
        self._taken: dict[str, Delivery] = {}
        self.on_take: Callable[[list[SteeringMessage]], None] | None = None

    def put_message(self, message: SteeringMessage) -> bool:
        """Takes an operator's message: for the running turn, else as a trigger.

        Returns:
            False when the message was taken before (its id seen since :meth:`forget`).
        """
        if message.id in self._taken:
            return False
        if self.in_turn:
            self._steering.append(message)
            self._taken[message.id] = "steering"
        else:
            self.triggers.put(message.to_trigger())
            self._taken[message.id] = "turn"
        return True

    def delivery(self, message_id: str) -> Delivery | None:
        """How a message was taken when it was put; None when it was not (or before the
        last :meth:`forget`)."""
        return self._taken.get(message_id)

    def take_all(self) -> list[SteeringMessage]:
        """Removes and returns the messages to deliver now, oldest first."""
        taken = list(self._steering)
        self._steering.clear()
        if taken and self.on_take is not None:
            self.on_take(taken)
        return taken

    def turn_ended(self) -> None:
        """After a turn: the oldest message still waiting opens the next turn, first of all
        triggers; the others wait for its first model call."""
        self.in_turn = False
        if self._steering:
            self.triggers.put_first(self._steering.popleft().to_trigger(after_answer=True))

    def to_triggers(self) -> None:
        """Every waiting message becomes a trigger of its own (the desk failed, or reads its
        conversation back): none is lost, whatever runs next."""
        while self._steering:
            self.triggers.put(self._steering.popleft().to_trigger())

    def forget(self) -> None:
        """Forgets which messages were taken (a restore reads them back from the store)."""
        self._taken.clear()
