"""The model backend protocol: one request in, one streamed response out.

A backend translates the conversation's content blocks to its wire format, streams the
answer (text deltas go to a callback as they arrive), assembles tool calls, and reports
usage: the server's figures when it sends them, an estimate when it does not. It raises
:class:`TransientBackendError` for failures worth retrying (the loop retries them),
:class:`ContextOverflowError` when the prompt is too long, and :class:`BackendError` else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trading_agent.agent.conversation import ContentBlock, Message, TextBlock, ToolUseBlock
from trading_agent.errors import (
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    TransientBackendError,
)

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "ContextOverflowError",
    "ModelBackend",
    "ModelReply",
    "ModelRequestSpec",
    "Pricing",
    "TransientBackendError",
    "Usage",
]


@dataclass(frozen=True)
class Pricing:
    """Prices in currency units per million tokens."""

    input_per_million: float
    output_per_million: float

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """The cost of one request."""
        return (input_tokens * self.input_per_million
                + output_tokens * self.output_per_million) / 1_000_000


@dataclass(frozen=True)
class Usage:
    """Tokens used, and their cost when prices are known.

    Attributes:
        input_tokens: Prompt tokens.
        output_tokens: Completion tokens.
        estimated: True when the server did not report usage and these are estimates.
        cost: The cost, or None when no prices are configured.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    estimated: bool = False
    cost: float | None = None

    def __add__(self, other: Usage) -> Usage:
        cost = None if self.cost is None and other.cost is None else (
            (self.cost or 0.0) + (other.cost or 0.0))
        return Usage(self.input_tokens + other.input_tokens,
                     self.output_tokens + other.output_tokens,
                     self.estimated or other.estimated, cost)


@dataclass(frozen=True)
class ModelRequestSpec:
    """What one model call sends.

    Attributes:
        system_prompt: The system prompt.
        messages: The messages, already repaired and pruned.
        tools: Function-calling definitions.
        max_output_tokens: A cap on the answer, or None for the server's default.
    """

    system_prompt: str
    messages: Sequence[Message]
    tools: Sequence[dict[str, Any]]
    max_output_tokens: int | None = None


@dataclass(frozen=True)
class ModelReply:
    """A complete answer.

    Attributes:
        content: Text and tool_use blocks, in order.
        usage: What the request used.
        stop_reason: Why the model stopped (``stop``, ``tool_calls``, ``length``...).
    """

    content: tuple[ContentBlock, ...]
    usage: Usage
    stop_reason: str = "stop"

    @property
    def text(self) -> str:
        """The answer's text."""
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def tool_calls(self) -> list[ToolUseBlock]:
        """The tool calls the model asked for."""
        return [b for b in self.content if isinstance(b, ToolUseBlock)]


class ModelBackend(Protocol):
    """A model server the loop can ask.

    Attributes:
        model: The model's name.
        context_window: The model's window in tokens, from config.
    """

    model: str
    context_window: int

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None) -> ModelReply:
        """Sends one request and streams the answer.

        Args:
            request: What to send.
            on_text: Called with each piece of text as it arrives.

        Returns:
            The whole answer, only once the stream completed.

        Raises:
            TransientBackendError: A failure worth retrying.
            ContextOverflowError: The prompt is longer than the model's window.
            BackendError: Any other failure.
        """
        ...
