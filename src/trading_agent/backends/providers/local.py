"""``provider = "local"``: the embedded model, served by llama.cpp on a Unix socket only the
daemon reaches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, field_validator

from trading_agent.backends.config import MAX_CONTEXT_WINDOW, LocalModelConfig, OpenAIBackendConfig
from trading_agent.backends.providers import Provider, ProviderContext, register
from trading_agent.backends.providers.openai import open_openai_compatible

if TYPE_CHECKING:
    from trading_agent.agent.backend import ModelBackend
    from trading_agent.agent.fixed_part import TokenCounter

__all__ = ["LocalModelSettings"]


def _default_cache_dir() -> Path:
    """``$CACHE_DIRECTORY/models`` under systemd (``CacheDirectory=``), else the user's cache."""
    from_systemd = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if from_systemd:
        return Path(from_systemd) / "models"
    return Path.home() / ".cache" / "trading-agent" / "models"


class LocalModelSettings(LocalModelConfig):
    """The embedded local model (``provider = "local"``).

    The other keys are those of :class:`~trading_agent.backends.config.LocalModelConfig`;
    ``cache_dir`` defaults to ``$CACHE_DIRECTORY/models`` under systemd (the unit's home is
    not writable there), else ``~/.cache/trading-agent/models``.

    Prompt caching needs no key here: llama-cpp-python's server reuses, for each request, the
    longest prefix it shares with the tokens already in its KV cache (``Llama.generate``), and
    it ignores llama.cpp's ``cache_prompt`` field, which only ``llama-server`` (C++) reads.

    Attributes:
        max_output_tokens: A cap on each answer. The small base model rarely stops on its
            own: without a cap it writes until the context window is full.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    provider: Literal["local"]
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    max_output_tokens: int = Field(default=512, gt=0, le=MAX_CONTEXT_WINDOW)

    @field_validator("context_window")
    @classmethod
    def _check_context_window(cls, value: int) -> int:
        if value > MAX_CONTEXT_WINDOW:
            raise ValueError(f"at most {MAX_CONTEXT_WINDOW} tokens")
        return value

    def server_config(self) -> LocalModelConfig:
        """The local server's own config (these settings without the request-side keys)."""
        return LocalModelConfig(**self.model_dump(exclude={"provider", "max_output_tokens"}))


async def _open(settings: LocalModelSettings, context: ProviderContext) -> ModelBackend:
    """The server is started once per server config, and spoken to as any OpenAI-compatible
    one."""
    # Imported here, when a backend is opened: reading the settings imports this module, and
    # must not load the server's HTTP client.
    from trading_agent.backends.local_server import LocalModelServer

    server_config = settings.server_config()

    async def start() -> LocalModelServer:
        return await context.stack.enter_async_context(LocalModelServer(server_config))

    server = await context.shared("local:" + server_config.model_dump_json(), start)
    return await open_openai_compatible(OpenAIBackendConfig(
        base_url=server.base_url, model=server.model, context_window=server.context_window,
        max_output_tokens=settings.max_output_tokens), context, unix_socket=server.unix_socket)


async def _offline_counter(settings: LocalModelSettings) -> TokenCounter | None:
    """The model's vocabulary read in-process, when its file is in the cache already."""
    from trading_agent.backends.local_tokenizer import vocabulary_counter

    return await vocabulary_counter(settings.server_config())


register(Provider("local", LocalModelSettings,
                  "the embedded model (Gemma 3 270M on llama.cpp), started by the daemon",
                  _open, model_name=lambda settings: str(settings.model_alias),
                  key_variable=lambda settings: None, offline_counter=_offline_counter))
