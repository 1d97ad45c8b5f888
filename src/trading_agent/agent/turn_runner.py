"""What one turn produced, and the small per-turn state the loop carries."""

from __future__ import annotations

from dataclasses import dataclass, field

from trading_agent.agent.backend import Usage
from trading_agent.agent.ids import random_hex
from trading_agent.agent.trigger import Trigger

__all__ = ["TurnResult", "TurnState", "new_turn_id"]


def new_turn_id() -> str:
    """A random turn id, 12 hex digits."""
    return random_hex(12)


@dataclass(frozen=True)
class TurnResult:
    """How a turn ended.

    Attributes:
        text: The model's final text (or, at the round limit, a note saying so).
        rounds: How many model calls the turn made.
        hit_round_limit: True when ``maximum_rounds`` ended the turn, not the model.
        usage: Tokens (and cost) of every model call of the turn, subagents included.
        stopped: True when the turn stopped early at a safe point because a stop was
            requested (shutdown).
        turn_id: The turn's id, as on its events.
    """

    text: str
    rounds: int
    hit_round_limit: bool
    usage: Usage
    stopped: bool = False
    turn_id: str = ""


@dataclass
class TurnState:
    """The loop's running state for one turn."""

    trigger: Trigger
    silent: bool = False
    id: str = field(default_factory=new_turn_id)
    rounds: int = 0
    usage: Usage = field(default_factory=Usage)
