"""``provider = "openai"``: any OpenAI-compatible chat-completions server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.providers import Provider, ProviderContext, register
from trading_agent.blocking import import_module

if TYPE_CHECKING:
    from trading_agent.agent.backend import ModelBackend
    from trading_agent.backends.owned_socket import OwnedUnixSocket

__all__ = ["OpenAIModelSettings", "open_openai_compatible"]


class OpenAIModelSettings(OpenAIBackendConfig):
    """A model on an OpenAI-compatible server (``provider = "openai"``).

    The other keys are those of :class:`~trading_agent.backends.config.OpenAIBackendConfig`;
    among them the prompt-cache ones: ``prompt_cache_key`` (``true`` by default: each desk's
    requests carry ``trading-agent:<desk>``; a string for a key of your own; ``false`` for
    none) and ``price_cached_input_per_million`` (what a prompt token served from the
    server's cache costs; by default the input price)::

        [model]
        price_input_per_million = 0.15
        price_cached_input_per_million = 0.075
        price_output_per_million = 0.60

        [desks.alpha.model]
        prompt_cache_key = false
    """

    provider: Literal["openai"]

    def backend_config(self) -> OpenAIBackendConfig:
        """The backend's own config (these settings without ``provider``)."""
        return OpenAIBackendConfig(**self.model_dump(exclude={"provider"}))


async def open_openai_compatible(config: OpenAIBackendConfig, context: ProviderContext, *,
                                 unix_socket: OwnedUnixSocket | None = None) -> ModelBackend:
    """The backend for a config, one per distinct config, closed with the daemon (the
    ``local`` provider opens its server's through this too, with its Unix socket)."""
    # Imported here, when a backend is opened: reading the settings imports this module, and
    # must not load the ``openai`` package. Off the loop: it takes a second of CPU.
    await import_module("trading_agent.backends.openai_compatible")
    from trading_agent.backends.openai_compatible import OpenAICompatibleBackend

    async def make() -> OpenAICompatibleBackend:
        backend = OpenAICompatibleBackend(config, environ=context.environ,
                                          unix_socket=unix_socket)
        context.stack.push_async_callback(backend.aclose)
        return backend

    where = "" if unix_socket is None else f" unix:{unix_socket.path}"
    return await context.shared("openai:" + config.model_dump_json() + where, make)


async def _open(settings: OpenAIModelSettings, context: ProviderContext) -> ModelBackend:
    return await open_openai_compatible(settings.backend_config(), context)


register(Provider("openai", OpenAIModelSettings,
                  "any OpenAI-compatible server: OpenAI, vLLM, llama.cpp, Ollama, OpenRouter",
                  _open))
