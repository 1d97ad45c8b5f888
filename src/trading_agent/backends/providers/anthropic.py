"""``provider = "anthropic"``: Anthropic's Messages API, spoken natively."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from trading_agent.backends.config import AnthropicBackendConfig
from trading_agent.backends.providers import Provider, ProviderContext, register
from trading_agent.blocking import import_module

if TYPE_CHECKING:
    from trading_agent.agent.backend import ModelBackend

__all__ = ["AnthropicModelSettings"]


class AnthropicModelSettings(AnthropicBackendConfig):
    """A model on Anthropic's Messages API (``provider = "anthropic"``).

    The other keys are those of :class:`~trading_agent.backends.config.AnthropicBackendConfig`
    (the key is read from ``ANTHROPIC_API_KEY`` unless ``api_key_env`` names another
    variable)::

        [model]
        provider = "anthropic"
        model = "claude-sonnet-4-5"
        context_window = 200000
        price_input_per_million = 3.0
        price_output_per_million = 15.0
        price_cache_read_per_million = 0.3
        price_cache_write_per_million = 3.75
    """

    provider: Literal["anthropic"]

    def backend_config(self) -> AnthropicBackendConfig:
        """The backend's own config (these settings without ``provider``)."""
        return AnthropicBackendConfig(**self.model_dump(exclude={"provider"}))


async def _open(settings: AnthropicModelSettings, context: ProviderContext) -> ModelBackend:
    # Imported here, when a backend is opened: reading the settings imports this module, and
    # must not load the backend's HTTP client. Off the loop: it takes CPU.
    await import_module("trading_agent.backends.anthropic")
    from trading_agent.backends.anthropic import AnthropicBackend

    config = settings.backend_config()

    async def make() -> AnthropicBackend:
        backend = AnthropicBackend(config, environ=context.environ)
        context.stack.push_async_callback(backend.aclose)
        return backend

    return await context.shared("anthropic:" + config.model_dump_json(), make)


register(Provider("anthropic", AnthropicModelSettings,
                  "Anthropic's Messages API, natively: prompt caching, extended thinking",
                  _open))
