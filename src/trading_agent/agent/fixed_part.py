"""The part of every request a desk cannot compact: its system prompt, its tool definitions
and the room kept for the answer.

When that alone does not fit the model's window, no turn can ever be answered. It is
measured with the model's own tokenizer where there is one (a server's tokenize route, or
a counter given by the caller, such as the local model's vocabulary read in-process);
otherwise estimated at :data:`CHARS_PER_TOKEN_ESTIMATE` characters a token, which errs on
the large side (JSON schemas and prompts run at 3.5 to 4.5 characters a token in the
tokenizers we know). Tools are measured as JSON with spaces after separators, as chat
templates tend to render them, plus :data:`FRAMING_TOKENS` for the turn markers.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHARS_PER_TOKEN_ESTIMATE",
    "DEFAULT_ANSWER_RESERVE",
    "FRAMING_TOKENS",
    "FixedPart",
    "TokenCounter",
    "answer_reserve",
    "measure_fixed_part",
]

CHARS_PER_TOKEN_ESTIMATE = 3
"""Characters a token when no tokenizer answers: fewer than real text has, so the estimate
comes out larger than the truth."""

DEFAULT_ANSWER_RESERVE = 512
"""Tokens kept for the answer when the model config sets no ``max_output_tokens``."""

FRAMING_TOKENS = 32
"""The chat template's own tokens around the system prompt, the tools and one message."""

TokenCounter = Callable[[str], Awaitable[int | None]]
"""How many tokens a text is, by the model's tokenizer; None when it cannot say."""


@dataclass(frozen=True)
class FixedPart:
    """A desk's fixed part, against its window.

    Attributes:
        prompt_tokens: The system prompt.
        tool_count: How many tool definitions.
        tool_tokens: The tool definitions.
        reserve: The room kept for the answer (``model.max_output_tokens``).
        window: The model's context window.
        measured: True when the model's tokenizer counted; False for an estimate.
    """

    prompt_tokens: int
    tool_count: int
    tool_tokens: int
    reserve: int
    window: int
    measured: bool

    @property
    def need(self) -> int:
        """Tokens every request needs before any message."""
        return self.prompt_tokens + self.tool_tokens + FRAMING_TOKENS + self.reserve

    @property
    def fits(self) -> bool:
        """Whether the window holds it (a message still has to fit beside it)."""
        return self.need <= self.window

    @property
    def how(self) -> str:
        return ("by the model's tokenizer" if self.measured else
                f"estimated at {CHARS_PER_TOKEN_ESTIMATE} characters a token")

    def describe(self, desk: str, pinned: int = 0) -> str:
        """The numbers and what to change, for an error or a pause's reason.

        Args:
            desk: The desk's name.
            pinned: How many pinned instructions the system prompt ends with.
        """
        verdict = (f"more than the model's context_window ({self.window:,})" if not self.fits
                   else f"of the model's context_window ({self.window:,}) before any message, "
                        "and the server counts more than that")
        prompt = ("the system prompt" if not pinned else
                  f"the system prompt with its {pinned} pinned instruction(s)")
        pins = ", unpin an instruction" if pinned else ""
        return (
            f"desks.{desk}: {prompt} ({self.prompt_tokens:,} tokens) and the "
            f"{self.tool_count} tool definitions ({self.tool_tokens:,} tokens), {self.how}, "
            f"plus {FRAMING_TOKENS} tokens of chat framing and {self.reserve:,} tokens for the "
            f"answer (model.max_output_tokens) need {self.need:,} tokens: {verdict}; shorten "
            f"the system prompt{pins}, narrow desks.{desk}.tools, lower "
            "model.max_output_tokens, or use a larger window")


def answer_reserve(backend: object) -> int:
    """The room a backend keeps for each answer: its config's ``max_output_tokens``."""
    config = getattr(backend, "config", None)
    reserve = getattr(config, "max_output_tokens", None)
    return reserve if isinstance(reserve, int) and reserve > 0 else DEFAULT_ANSWER_RESERVE


async def measure_fixed_part(system_prompt: str, tools: Sequence[Mapping[str, Any]], *,
                             window: int, reserve: int,
                             count: TokenCounter | None = None) -> FixedPart:
    """Measures the fixed part.

    Args:
        system_prompt: The desk's system prompt.
        tools: Its tool definitions.
        window: The model's window.
        reserve: The room kept for the answer.
        count: The model's tokenizer, if there is one.

    Returns:
        The numbers.
    """
    tools_text = json.dumps(list(tools)) if tools else ""
    if count is not None:
        prompt_tokens, tool_tokens = await count(system_prompt), await count(tools_text)
        if prompt_tokens is not None and tool_tokens is not None:
            return FixedPart(prompt_tokens, len(tools), tool_tokens, reserve, window, True)
    return FixedPart(-(-len(system_prompt) // CHARS_PER_TOKEN_ESTIMATE), len(tools),
                     -(-len(tools_text) // CHARS_PER_TOKEN_ESTIMATE), reserve, window, False)
