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
    "desk_cache_key",
]


def desk_cache_key(desk: str) -> str:
    """The prompt-cache key of a desk's requests: one per desk, so that each desk's requests,
    which share their prefix with one another and with nothing else, go to the same cache.

    Args:
        desk: The desk's name.

    Returns:
        ``trading-agent:<desk>``.
    """
    return f"trading-agent:{desk}"


@dataclass(frozen=True)
class Pricing:
    """Prices in currency units per million tokens.

    Attributes:
        input_per_million: The price of a prompt token the server computed.
        output_per_million: The price of a completion token.
        cached_input_per_million: The price of a prompt token served from the server's prompt
            cache, or None to charge it as any other prompt token.
    """

    input_per_million: float
    output_per_million: float
    cached_input_per_million: float | None = None

    def cost(self, input_tokens: int, output_tokens: int, cached_input_tokens: int = 0) -> float:
        """The cost of one request.

        Args:
            input_tokens: Prompt tokens, the cached ones included (as servers count them).
            output_tokens: Completion tokens.
            cached_input_tokens: How many of the prompt tokens were served from cache; they
                are charged at the cached price instead of the input price.

        Returns:
            The cost in currency units.
        """
        cached = max(0, min(cached_input_tokens, input_tokens))
        cached_price = (self.input_per_million if self.cached_input_per_million is None
                        else self.cached_input_per_million)
        return ((input_tokens - cached) * self.input_per_million
                + cached * cached_price
                + output_tokens * self.output_per_million) / 1_000_000


@dataclass(frozen=True)
class Usage:
    """Tokens used, and their cost when prices are known.

    Attributes:
        input_tokens: Prompt tokens, the cached ones included.
        output_tokens: Completion tokens.
        estimated: True when the server did not report usage and these are estimates.
        cost: The cost, or None when no prices are configured.
        cached_input_tokens: How many of the prompt tokens the server served from its prompt
            cache (0 when it reported none).
    """

    input_tokens: int = 0
    output_tokens: int = 0
    estimated: bool = False
    cost: float | None = None
    cached_input_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        cost = None if self.cost is None and other.cost is None else (
            (self.cost or 0.0) + (other.cost or 0.0))
        return Usage(self.input_tokens + other.input_tokens,
                     self.output_tokens + other.output_tokens,
                     self.estimated or other.estimated, cost,
                     self.cached_input_tokens + other.cached_input_tokens)


@dataclass(frozen=True)
class ModelRequestSpec:
    """What one model call sends.

    Attributes:
        system_prompt: The system prompt.
        messages: The messages, already repaired and pruned.
        tools: Function-calling definitions.
        max_output_tokens: A cap on the answer, or None for the server's default.
        cache_key: Which prompt cache the request should go to (``trading-agent:<desk>``),
            for servers that route by one (OpenAI's ``prompt_cache_key``); None for none. It
            travels with the request because one backend serves several desks.
    """

    system_prompt: str
    messages: Sequence[Message]
    tools: Sequence[dict[str, Any]]
    max_output_tokens: int | None = None
    cache_key: str | None = None


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
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        """Sends one request and streams the answer.

        Args:
            request: What to send.
            on_text: Called with each piece of text as it arrives.
            on_thinking: Called with each piece of the model's reasoning as it arrives
                (where the server streams it apart from the answer).

        Returns:
            The whole answer, only once the stream completed.

        Raises:
            TransientBackendError: A failure worth retrying.
            ContextOverflowError: The prompt is longer than the model's window.
            BackendError: Any other failure.
        """
        ...
