"""The memorisation audit: the same span run plain and masked, and what differs.

A model that recognises a period trades it better than it trades the same moves disguised
(:mod:`.mask`); a model that reads only the numbers trades both alike. ``--audit`` runs the
span both ways and compares them with pure functions of the two records:

- ``return_difference``: the plain run's total return minus the masked run's (0.02: the
  plain run made two points more).
- ``trades``: each run's closed round trips.
- ``agreement``: over the decision times of either run, the share where both runs took the
  same action. A decision's action is the sides of the orders it placed (``buy``,
  ``sell``, ``buy+sell``) or ``hold`` when it placed none; a time where one run decided and
  the other did not counts as a disagreement.
- ``verdict``: one sentence on what the difference suggests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from trading_agent.backtest.metrics import Figures
from trading_agent.backtest.record import BacktestRecord

__all__ = ["Audit", "audit", "decision_actions"]

_CLOSE_RETURN = 0.005
"""Returns within half a point of each other are "about the same"."""
_HIGH_AGREEMENT = 0.8


@dataclass(frozen=True)
class Audit:
    """The plain and masked runs of one span compared.

    Attributes:
        plain_return: The plain run's total return.
        masked_return: The masked run's.
        return_difference: Plain minus masked.
        plain_trades: The plain run's closed round trips.
        masked_trades: The masked run's.
        decisions: Decision times of either run.
        agreement: The share of them where both took the same action; None without any.
        verdict: What it suggests, in one sentence.
    """

    plain_return: float
    masked_return: float
    return_difference: float
    plain_trades: int
    masked_trades: int
    decisions: int
    agreement: float | None
    verdict: str

    def to_json(self) -> dict[str, Any]:
        """The audit as ``report.json`` holds it."""
        return {"plain_return": self.plain_return, "masked_return": self.masked_return,
                "return_difference": self.return_difference,
                "plain_trades": self.plain_trades, "masked_trades": self.masked_trades,
                "decisions": self.decisions, "agreement": self.agreement,
                "verdict": self.verdict}


def decision_actions(record: BacktestRecord) -> dict[datetime, str]:
    """Each decision time's action: the sides of the orders placed, or ``hold``.

    Several decisions at one time (a trigger and an operator message) are merged.
    """
    actions: dict[datetime, set[str]] = {}
    for decision in record.decisions:
        sides = actions.setdefault(decision.at, set())
        for entry in decision.transcript:
            if entry.kind == "tool_call" and entry.text.startswith("place_order("):
                try:
                    arguments = json.loads(entry.text.removeprefix("place_order(")[:-1])
                except ValueError:
                    continue
                side = arguments.get("side") if isinstance(arguments, dict) else None
                if side in ("buy", "sell"):
                    sides.add(side)
    return {at: "+".join(sorted(sides)) or "hold" for at, sides in actions.items()}


def agreement(plain: Mapping[datetime, str], masked: Mapping[datetime, str]) -> float | None:
    """The share of decision times of either run where both took the same action."""
    times = set(plain) | set(masked)
    if not times:
        return None
    return sum(1 for at in times if plain.get(at) == masked.get(at)) / len(times)


def audit(plain: BacktestRecord, masked: BacktestRecord, plain_figures: Figures,
          masked_figures: Figures) -> Audit:
    """Compares the plain and masked runs of one span.

    Args:
        plain: The plain run.
        masked: The masked run.
        plain_figures: The plain run's figures.
        masked_figures: The masked run's.
    """
    plain_actions, masked_actions = decision_actions(plain), decision_actions(masked)
    share = agreement(plain_actions, masked_actions)
    difference = plain_figures.total_return - masked_figures.total_return
    return Audit(
        plain_return=plain_figures.total_return, masked_return=masked_figures.total_return,
        return_difference=difference, plain_trades=plain_figures.trades,
        masked_trades=masked_figures.trades,
        decisions=len(set(plain_actions) | set(masked_actions)), agreement=share,
        verdict=verdict(difference, share, plain_figures.trades + masked_figures.trades))


def verdict(difference: float, share: float | None, trades: int) -> str:
    """One sentence on what a plain-minus-masked return ``difference`` and a decision
    ``share`` in agreement suggest."""
    agree = "no decision to compare" if share is None else f"{share:.0%} of decisions agree"
    if share is None:
        return ("Neither run decided anything, so the audit cannot tell whether the model "
                "remembers the period.")
    if trades == 0 and abs(difference) <= _CLOSE_RETURN:
        return (f"Neither run closed a trade ({agree}): the audit shows that both held, not "
                "whether the model remembers the period; audit a span where it trades.")
    if abs(difference) <= _CLOSE_RETURN and share >= _HIGH_AGREEMENT:
        return (f"The masked run decided alike ({agree}) and returned about the same: no sign "
                "that the model recognised the period.")
    if difference > _CLOSE_RETURN:
        return (f"The plain run returned {difference * 100:.1f} points more than the masked "
                f"one ({agree}): the model may be using what it remembers of the period; "
                "trust the masked figures.")
    if difference < -_CLOSE_RETURN:
        return (f"The masked run returned {-difference * 100:.1f} points more ({agree}): no "
                "sign that memory helped, but the gap shows how much the result moves with "
                "the numbers the model reads.")
    return (f"Returns are close but only {agree}: the model's choices change with the "
            "numbers it reads, so one run's figures are as much chance as skill.")
