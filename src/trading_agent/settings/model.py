"""A ``[model]`` table: one of the registered providers' settings, by ``provider``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trading_agent.backends.providers import ModelTable, model_settings

__all__ = ["ModelSettings", "priced"]

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
