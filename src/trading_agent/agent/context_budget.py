"""How a model's window is shared out at a compaction: the newest messages kept whole, the
summary, the summary request's instructions and the chunk of older messages it reads.

Plain arithmetic, so that the settings check a desk's ``[context]`` table against its
model's window by the very rule the
:class:`~trading_agent.agent.context_compressor.ContextCompressor` applies, without
importing the compressor.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "MIN_SUMMARY_TOKENS",
    "SUMMARY_CHARS_PER_TOKEN",
    "SUMMARY_INSTRUCTIONS",
    "SUMMARY_OVERHEAD_TOKENS",
    "SUMMARY_SECTIONS",
    "ContextBudget",
    "context_budget",
]

SUMMARY_SECTIONS = (
    "Goal",
    "Positions and open orders",
    "Decisions and why",
    "Risks",
    "Next steps",
)
"""The headings of every summary, in order."""

SUMMARY_INSTRUCTIONS = (
    "You maintain the running summary of a trading desk's conversation. Write it under "
    "exactly these headings, in this order, as short bullet points: "
    + "; ".join(f"## {name}" for name in SUMMARY_SECTIONS)
    + ". Keep every number that matters (prices, sizes, order ids, limits, times). When a "
    "previous summary is given, update it with the new messages: keep what still holds, "
    "change what changed, drop what is finished. Answer with the summary only."
)
"""The summary request's system prompt."""

SUMMARY_OVERHEAD_TOKENS = len(SUMMARY_INSTRUCTIONS) // 4 + 64
"""The summary request's fixed part: instructions, the prompt's own words, message framing."""

MIN_SUMMARY_TOKENS = 64
"""The shortest summary budget a window may leave (below it, the settings are refused)."""

SUMMARY_CHARS_PER_TOKEN = 5
"""A summary longer than ``summary_max_tokens`` times this is cut (a server that ignores the
output cap must not break the size bounds; a real model's tokens rarely run longer)."""


class ContextBudget(NamedTuple):
    """A window's shares.

    Attributes:
        keep_recent_tokens: The newest messages kept verbatim after a compaction.
        summary_max_tokens: The longest summary asked for.
        chunk_tokens: The most tokens of older messages one summary request reads.
    """

    keep_recent_tokens: int
    summary_max_tokens: int
    chunk_tokens: int


def context_budget(context_window: int, *, flush_threshold: float, hard_threshold: float,
                   keep_recent_tokens: int | None, summary_max_tokens: int,
                   flush_max_rounds: int) -> ContextBudget:
    """The shares of a window, or why the settings cannot work for it.

    Args:
        context_window: The model's window, in tokens.
        flush_threshold: The share of the window at which a turn starts with a compaction.
        hard_threshold: The share past which the loop compacts between tool rounds.
        keep_recent_tokens: The recent budget; None for a fifth of the window.
        summary_max_tokens: The longest summary wanted; it shrinks to what the window leaves.
        flush_max_rounds: The most model calls of the memory-flush turn.

    Returns:
        The budget.

    Raises:
        ValueError: The thresholds are out of order, a budget is not positive, or the
            summary and the recent budget leave no room in this window.
    """
    if not 0 < flush_threshold < hard_threshold < 1:
        raise ValueError("need 0 < flush_threshold < hard_threshold < 1")
    keep = keep_recent_tokens if keep_recent_tokens is not None else context_window // 5
    if keep <= 0 or summary_max_tokens <= 0 or flush_max_rounds < 1:
        raise ValueError("keep_recent_tokens, summary_max_tokens and flush_max_rounds "
                         "must be positive")
    if keep + MIN_SUMMARY_TOKENS > context_window // 2:
        raise ValueError(
            f"keep_recent_tokens ({keep}) plus a summary of at least "
            f"{MIN_SUMMARY_TOKENS} tokens must be at most half the context window "
            f"({context_window} tokens), or a compaction could leave the conversation as "
            "full as it found it")
    # The summary gets what is left of half the window after the recent messages: a
    # small window shrinks it instead of refusing the desk.
    summary_max_tokens = min(
        summary_max_tokens, context_window // 2 - keep,
        # and leave a summary request room for a chunk of 256 tokens or more
        int((context_window * 0.9 - SUMMARY_OVERHEAD_TOKENS - 256)
            / (1 + SUMMARY_CHARS_PER_TOKEN / 4)))
    chunk_tokens = (int(context_window * 0.9) - summary_max_tokens
                    - summary_max_tokens * SUMMARY_CHARS_PER_TOKEN // 4
                    - SUMMARY_OVERHEAD_TOKENS)
    if chunk_tokens < 256:
        raise ValueError(f"summary_max_tokens ({summary_max_tokens}) is too large for a "
                         f"{context_window}-token window: the summary request would not fit")
    return ContextBudget(keep, summary_max_tokens, chunk_tokens)
