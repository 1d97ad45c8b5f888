"""The settings of an OpenAI-compatible model backend.

Kept apart from the backend itself so the daemon's settings can embed it without importing
the ``openai`` package. The API key is never a field: only the *name* of the environment
variable holding it is, so no config file, repr or log line can carry the secret.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trading_agent.agent.backend import Pricing

__all__ = ["OpenAIBackendConfig"]

_RESERVED_BODY_KEYS = frozenset(
    {"model", "messages", "tools", "stream", "stream_options", "max_tokens",
     "max_completion_tokens", "temperature"}
)


class OpenAIBackendConfig(BaseModel):
    """How to reach one model on an OpenAI-compatible chat-completions server.

    Attributes:
        base_url: The API root, ending in ``/v1`` (``http://127.0.0.1:8080/v1``).
        model: The model's name, as the server knows it.
        api_key_env: The name of the environment variable holding the API key, or None for a
            server that needs no key (a placeholder is sent then).
        context_window: The model's window in tokens.
        max_output_tokens: A cap on each answer, or None for the server's default. A request's
            own cap wins over this one.
        max_tokens_field: The body field the cap goes in: ``max_tokens`` (understood by every
            compatible server) or ``max_completion_tokens`` (OpenAI's reasoning models).
        request_timeout: Seconds to wait for the server to connect, or for the next bytes of
            an answer.
        price_input_per_million: Price per million prompt tokens; with the output price it
            enables cost reporting.
        price_output_per_million: Price per million completion tokens.
        temperature: Sampling temperature, or None for the server's default.
        extra_headers: Headers sent with every request (not for secrets: they show in reprs).
        extra_body: Fields merged into every request body (``{"cache_prompt": true}`` for
            llama.cpp, ``{"top_p": 0.9}``...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(min_length=1)
    model: str = Field(min_length=1)
    api_key_env: str | None = None
    context_window: int = Field(gt=0)
    max_output_tokens: int | None = Field(default=None, gt=0)
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    request_timeout: float = Field(default=120.0, gt=0)
    price_input_per_million: float | None = Field(default=None, ge=0)
    price_output_per_million: float | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    extra_headers: dict[str, str] = Field(default_factory=dict)
    extra_body: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> OpenAIBackendConfig:
        if (self.price_input_per_million is None) != (self.price_output_per_million is None):
            raise ValueError("set both price_input_per_million and price_output_per_million, "
                             "or neither")
        reserved = sorted(_RESERVED_BODY_KEYS & set(self.extra_body))
        if reserved:
            raise ValueError(f"extra_body may not set {', '.join(reserved)}: they have their own "
                             "settings or are set by the backend")
        if self.api_key_env is not None and not self.api_key_env.strip():
            raise ValueError("api_key_env must name an environment variable, or be left out")
        return self

    @property
    def pricing(self) -> Pricing | None:
        """The prices, when both are configured."""
        if self.price_input_per_million is None or self.price_output_per_million is None:
            return None
        return Pricing(self.price_input_per_million, self.price_output_per_million)
