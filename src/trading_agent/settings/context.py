"""When a desk's conversation is compacted (``[desks.<name>.context]``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from trading_agent.agent.context_budget import context_budget
from trading_agent.backends.config import MAX_CONTEXT_WINDOW
from trading_agent.errors import ConfigError
from trading_agent.settings.table import Table

__all__ = ["ContextSettings"]


class ContextSettings(Table):
    """When a desk's conversation is compacted (``[desks.<name>.context]``).

    Attributes:
        flush_threshold: The share of the window at which a turn starts with a memory flush
            and a compaction.
        hard_threshold: The share past which the loop summarizes at once between tool rounds.
        keep_recent_tokens: How many tokens of the newest messages stay verbatim after a
            compaction; by default a fifth of the window.
        summary_max_tokens: The longest summary the model may write; it shrinks to what
            the window has left.
        tool_result_max_tokens: Longer messages (tool results, an operator's paste, a
            notice) are cut to this in what the model is sent (the stored text stays
            whole); by default half of ``keep_recent_tokens``.
        flush_max_rounds: The most model calls of the silent memory-flush turn that comes
            before a compaction.
        clear_tool_results: Before any summary, tool results older than the newest
            ``clear_keep_rounds`` tool rounds are first cut to a one-line stub in what is
            sent (the store keeps them whole); the summary runs only when that is not
            enough.
        clear_keep_rounds: How many of the newest tool rounds clearing keeps whole.

    ``keep_recent_tokens`` plus a summary of 64 tokens must be at most half the model's
    ``context_window``, checked when the file is loaded.
    """

    flush_threshold: float = Field(default=0.70, gt=0, lt=1)
    hard_threshold: float = Field(default=0.85, gt=0, lt=1)
    keep_recent_tokens: int | None = Field(default=None, gt=0, le=MAX_CONTEXT_WINDOW)
    summary_max_tokens: int = Field(default=1200, gt=0, le=MAX_CONTEXT_WINDOW)
    tool_result_max_tokens: int | None = Field(default=None, ge=64, le=MAX_CONTEXT_WINDOW)
    flush_max_rounds: int = Field(default=3, ge=1, le=20)
    clear_tool_results: bool = True
    clear_keep_rounds: int = Field(default=3, ge=0, le=1000)

    @model_validator(mode="after")
    def _ordered(self) -> ContextSettings:
        if not self.flush_threshold < self.hard_threshold:
            raise ValueError(f"flush_threshold ({self.flush_threshold}) must be below "
                             f"hard_threshold ({self.hard_threshold})")
        return self

    def check_window(self, context_window: int, *, key: str = "context") -> None:
        """Checks that these settings can work for a model's window.

        Args:
            context_window: The model's window, in tokens.
            key: Where these settings are in the config, for the error message
                (``desks.alpha.context``).

        Raises:
            ConfigError: They cannot; the message names the keys, their values and the
                window.
        """
        try:
            context_budget(context_window, flush_threshold=self.flush_threshold,
                           hard_threshold=self.hard_threshold,
                           keep_recent_tokens=self.keep_recent_tokens,
                           summary_max_tokens=self.summary_max_tokens,
                           flush_max_rounds=self.flush_max_rounds)
        except ValueError as exc:
            keep = (str(self.keep_recent_tokens) if self.keep_recent_tokens is not None
                    else f"{context_window // 5} by default, a fifth of the window")
            raise ConfigError(
                f"{key}: {exc}; lower {key}.keep_recent_tokens (now {keep}), or use a model "
                f"with a larger context_window (now {context_window})") from exc
