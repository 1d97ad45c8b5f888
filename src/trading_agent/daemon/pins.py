"""Standing instructions: what operators pin to a desk, sent in every request it makes.

A pin is sent verbatim at the end of the desk's system prompt, in one clearly delimited
block (:func:`pinned_prompt`). The end of the system prompt, rather than a message of its
own: the system prompt is the part of every request a compaction never touches (the
compressor counts it as the request's fixed part, and summarises only messages), so a pin
cannot be summarised away; and the prompt cache's prefix (the tool definitions and the
desk's own prompt, which come first) stays the same when a pin is added or removed, while
between two changes the whole block is byte for byte the same (pins in the order they were
pinned, no clock in it). A change costs one cache miss from the block on, as any change
before the messages would.

Pins live in the store (:class:`PinRecords`, ``store.pinned_instructions``) so they survive
restarts and reloads; :class:`DeskPins` holds every desk's in memory for the desks to read.
A desk's config may pin instructions too (``desks.<name>.pinned``): they come first in the
block, and are changed by editing the config, not by an operator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import anyio

from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.fixed_part import FRAMING_TOKENS
from trading_agent.daemon.events import PinsChanged
from trading_agent.errors import TradingAgentError
from trading_agent.store.pinned_instructions import Pin

if TYPE_CHECKING:
    from trading_agent.daemon.desk import Desk

__all__ = [
    "MAX_PIN_CHARS",
    "PIN_BLOCK_END",
    "PIN_BLOCK_START",
    "DeskPins",
    "Pin",
    "PinControl",
    "PinRecords",
    "PinRefusedError",
    "UnknownPinError",
    "pinned_prompt",
]

MAX_PIN_CHARS = 4000
"""The longest one pin may be, in characters (the window's room is checked as well)."""

PIN_BLOCK_START = "--- Standing instructions from the operators (they hold until an operator " \
                  "removes them) ---"
"""The line that opens the pinned block in the system prompt."""

PIN_BLOCK_END = "--- End of standing instructions ---"
"""The line that closes it."""


class PinRefusedError(TradingAgentError):
    """A pin cannot be added: empty, too long, or too large for the desk's window (the
    message has the numbers).

    Args:
        message: Why, for an operator.
        code: ``invalid_pin`` (empty, too long) or ``pin_too_large`` (the window).
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class UnknownPinError(TradingAgentError):
    """The desk has no pin of that id (the message names those it has)."""


@runtime_checkable
class PinControl(Protocol):
    """What the operator side may ask about pins (the supervisor answers; a fleet's control
    asks the daemon holding the desk)."""

    async def pinned(self, desk: str) -> dict[str, Any]:
        """A desk's pins (``pins``) and its config's (``configured``)."""
        ...

    async def pin(self, desk: str, text: str, by: str) -> dict[str, Any]:
        """Pins an instruction to a desk."""
        ...

    async def unpin(self, desk: str, pin_id: int, by: str) -> dict[str, Any]:
        """Takes a pin off a desk."""
        ...


class PinRecords(Protocol):
    """Where pins are kept (``store.pinned_instructions.SqlitePins``)."""

    async def load(self) -> list[Pin]:
        """Every desk's pins, oldest first."""
        ...

    async def add(self, desk: str, text: str, by: str, at: datetime) -> Pin:
        """Keeps a new pin; returns it with its id."""
        ...

    async def remove(self, desk: str, pin_id: int) -> bool:
        """Forgets a pin of the desk; False when it had none of that id."""
        ...

    async def close(self) -> None:
        """Lets go of the store."""
        ...


def pinned_prompt(system_prompt: str, pins: Sequence[str]) -> str:
    """The system prompt with the pinned block at its end (the prompt alone without pins).

    Args:
        system_prompt: The desk's own prompt.
        pins: The instructions, in order, each sent verbatim.

    Returns:
        What the model is told before every request.
    """
    if not pins:
        return system_prompt
    lines = [PIN_BLOCK_START, *(f"[{number}] {text}" for number, text in
                                enumerate(pins, start=1)), PIN_BLOCK_END]
    return f"{system_prompt}\n\n" + "\n".join(lines)


def checked_text(text: str) -> str:
    """The instruction as it will be sent (outer blank space off), or why not.

    Raises:
        PinRefusedError: Empty, or longer than :data:`MAX_PIN_CHARS`.
    """
    text = text.strip()
    if not text:
        raise PinRefusedError("nothing to pin: the instruction is empty", "invalid_pin")
    if len(text) > MAX_PIN_CHARS:
        raise PinRefusedError(f"the instruction is {len(text):,} characters; a pin may be at "
                              f"most {MAX_PIN_CHARS:,}", "invalid_pin")
    return text


class DeskPins:
    """Every desk's pins, in memory and in the store; pinning and unpinning apply them to
    the desk at once (from its next request) and publish :class:`PinsChanged`.

    Args:
        records: The store; None keeps them in memory only.
        clock: The time a pin is stamped with.
        bus: Where the changes are published; None publishes nothing.
    """

    def __init__(self, records: PinRecords | None, clock: Callable[[], datetime],
                 bus: EventBus | None = None) -> None:
        self._records = records
        self._clock = clock
        self.bus = bus
        self._pins: dict[str, list[Pin]] = {}
        self._next_id = 1
        self._changing = anyio.Lock()
        """One pin measured and kept at a time: two made at once cannot both take the
        window's last room."""

    @classmethod
    async def restore(cls, records: PinRecords, clock: Callable[[], datetime],
                      bus: EventBus | None = None) -> DeskPins:
        """The pins the store holds."""
        pins = cls(records, clock, bus)
        for pin in await records.load():
            pins._pins.setdefault(pin.desk, []).append(pin)
        return pins

    async def reload(self, desk: Desk) -> None:
        """Reads the desk's pins from the store again and applies them: a daemon of a fleet
        taking a desk over sends the pins made on the daemon that held it before.
        """
        if self._records is None:
            return
        async with self._changing:
            self._pins[desk.name] = [pin for pin in await self._records.load()
                                     if pin.desk == desk.name]
            desk.set_pinned(self.texts(desk.name))

    def of(self, desk: str) -> list[Pin]:
        """The desk's pins, oldest first."""
        return list(self._pins.get(desk, ()))

    def texts(self, desk: str) -> list[str]:
        """What the desk is sent of them."""
        return [pin.text for pin in self._pins.get(desk, ())]

    async def pin(self, desk: Desk, text: str, by: str) -> Pin:
        """Pins an instruction to a desk, if its window holds it beside everything else a
        request cannot do without; the desk sends it from its next request on.

        Raises:
            PinRefusedError: Empty, too long, or too large for the window (with the
                numbers).
        """
        text = checked_text(text)
        async with self._changing:
            return await self._pin(desk, text, by)

    async def _pin(self, desk: Desk, text: str, by: str) -> Pin:
        before = await desk.fixed_part_with(self.texts(desk.name))
        after = await desk.fixed_part_with([*self.texts(desk.name), text])
        if not after.fits:
            raise PinRefusedError(
                f"not pinned: the instruction is {after.prompt_tokens - before.prompt_tokens:,}"
                f" tokens ({after.how}); with it desk {desk.name}'s system prompt and pins "
                f"({after.prompt_tokens:,} tokens), its {after.tool_count} tool definitions "
                f"({after.tool_tokens:,}), {FRAMING_TOKENS} tokens of chat framing and "
                f"{after.reserve:,} for the answer need {after.need:,} tokens in every request,"
                f" more than the model's context window ({after.window:,}); shorten it or "
                "remove a pin", "pin_too_large")
        pin = await self.add(desk.name, text, by)
        desk.set_pinned(self.texts(desk.name))
        self._publish(desk.name, "pinned", pin)
        return pin

    async def unpin(self, desk: Desk, pin_id: int, by: str) -> Pin:
        """Takes a pin off a desk; its next request goes without it.

        Raises:
            UnknownPinError: The desk has no pin of that id.
        """
        async with self._changing:
            pin = await self.remove(desk.name, pin_id)
        desk.set_pinned(self.texts(desk.name))
        self._publish(desk.name, "unpinned", pin, by)
        return pin

    def _publish(self, desk: str, action: Literal["pinned", "unpinned"], pin: Pin,
                 by: str | None = None) -> None:
        if self.bus is None:
            return
        who = by or pin.by
        count = len(self._pins.get(desk, ()))
        line = (f"{who} pinned #{pin.id}: {pin.text}" if action == "pinned"
                else f"{who} unpinned #{pin.id} (pinned by {pin.by}): {pin.text}")
        self.bus.publish(PinsChanged(desk=desk, action=action, by=who, pin_id=pin.id,
                                     pin_text=pin.text, pins=count,
                                     text=f"{line} ({count} pin{'s' if count != 1 else ''})"))

    async def add(self, desk: str, text: str, by: str) -> Pin:
        """Keeps a pin (in the store first, so an answer means it is kept)."""
        at = self._clock()
        if self._records is not None:
            pin = await self._records.add(desk, text, by, at)
        else:
            pin = Pin(self._next_id, desk, text, by, at)
            self._next_id += 1
        self._pins.setdefault(desk, []).append(pin)
        return pin

    async def remove(self, desk: str, pin_id: int) -> Pin:
        """Takes a pin off.

        Raises:
            UnknownPinError: The desk has no pin of that id.
        """
        pins = self._pins.get(desk, [])
        found = next((pin for pin in pins if pin.id == pin_id), None)
        if found is None:
            have = ", ".join(str(pin.id) for pin in pins) or "none"
            raise UnknownPinError(f"desk {desk!r} has no pin {pin_id}; its pins: {have}")
        if self._records is not None:
            await self._records.remove(desk, pin_id)
        pins.remove(found)
        return found

    async def close(self) -> None:
        """Lets go of the store."""
        if self._records is not None:
            await self._records.close()
