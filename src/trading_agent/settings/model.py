"""A ``[model]`` table: one of the registered providers' settings, by ``provider``."""

from __future__ import annotations

from datetime import date
from typing import TYPE_CHECKING

from trading_agent.backends.providers import ModelTable, model_settings

__all__ = ["ModelSettings", "knowledge_cutoff", "priced"]

if TYPE_CHECKING:
    ModelSettings = ModelTable
else:
    ModelSettings = model_settings()
"""One model: one of the registered providers' tables, by ``provider``
(:mod:`trading_agent.backends.providers`)."""


def priced(model: ModelSettings) -> bool:
    """Whether a model's cost can be counted (its prices are configured).

    Args:
        model: A desk's model settings.

    Returns:
        Whether its input price is configured (the output price comes with it).
    """
    return getattr(model, "price_input_per_million", None) is not None


def knowledge_cutoff(model: ModelSettings) -> date | None:
    """The first day of the month after a model's ``knowledge_cutoff``: a span starting
    before it may be in the model's training data.

    Args:
        model: A desk's model settings.

    Returns:
        That day; None when the model's cutoff is not configured (or its provider has no
        such key).
    """
    month = getattr(model, "knowledge_cutoff", None)
    if not isinstance(month, str):
        return None
    year, number = (int(part) for part in month.split("-"))
    return date(year + number // 12, number % 12 + 1, 1)
