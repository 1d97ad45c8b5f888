"""Whether a backtest's span may be in the model's training data.

A model that read about a period can know what came next: "Profit Mirage" measured LLM
trading agents' Sharpe ratios falling by half after their models' training cutoffs. A
model's ``[model] knowledge_cutoff = "YYYY-MM"`` is the last month its training data covers;
a span starting before the end of that month may have been seen, and is flagged on the
terminal and in the report, or refused with ``--require-unseen``. A masked run
(``--mask``, :mod:`.mask`) is still flagged, with what the mask does about it.
"""

from __future__ import annotations

from datetime import UTC, date, datetime

__all__ = ["UNSEEN_HINT", "seen_notice"]

UNSEEN_HINT = "the model may have seen this period; run with --mask"
"""What the notice advises, in the words the README quotes."""


def seen_notice(start: datetime, unseen_from: date | None, cutoff: str | None, *,
                masked: bool) -> str | None:
    """The notice for a span starting at ``start``, or None when it is after the cutoff.

    Args:
        start: The span's start.
        unseen_from: The first day after the model's knowledge cutoff
            (:func:`~trading_agent.settings.model.knowledge_cutoff`); None when unknown.
        cutoff: The configured cutoff month (``2024-08``), named in the notice.
        masked: Whether the model reads the run through the mask.

    Returns:
        One sentence, or None.
    """
    if unseen_from is None:
        return None
    if start >= datetime(unseen_from.year, unseen_from.month, unseen_from.day, tzinfo=UTC):
        return None
    when = f"the span starts {start:%Y-%m-%d}, before the end of the model's knowledge cutoff " \
           f"({cutoff})"
    if masked:
        return (f"{when}: the model may have seen this period; it read it masked (times, "
                "prices and the symbol disguised), which hides the dates, not the shape of "
                "the moves")
    return f"{when}: {UNSEEN_HINT}"
