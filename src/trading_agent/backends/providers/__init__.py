"""The model providers: each module of this package registers one.

A provider is what ``provider = "..."`` names in a ``[model]`` table: its settings (a
pydantic model whose ``provider`` field is the name), a line saying what it is, and how its
backend is opened. The settings' ``ModelSettings``, ``check-config``, the desk building
and the README's list of providers (a test holds it to the registry) all read the registry,
so a new provider is one module here (its backend may live in it, or in a module of
``backends/`` that it imports only when a backend is opened, so that reading the settings
loads no HTTP client) plus its tests, and a line in :data:`_BUILT_IN`.

Example::

    class EchoSettings(BaseModel):
        provider: Literal["echo"]
        context_window: int = 8192

    async def open_echo(settings: EchoSettings, context: ProviderContext) -> ModelBackend:
        return EchoBackend(settings)

    register(Provider("echo", EchoSettings, "answers with what it was sent", open_echo))
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeVar, Union

from pydantic import BaseModel, Field

from trading_agent.agent.backend import ModelBackend
from trading_agent.errors import ConfigError

__all__ = ["ModelTable", "Provider", "ProviderContext", "model_settings", "provider",
           "providers", "register"]

_BUILT_IN = ("openai", "anthropic", "local")
"""The provider modules of this package, in the order their names are listed."""

T = TypeVar("T")


class ModelTable(Protocol):
    """What every provider's settings have (their other keys are their own)."""

    @property
    def provider(self) -> str:
        """The provider's name."""
        ...

    @property
    def context_window(self) -> int:
        """The model's window in tokens."""
        ...

    @property
    def max_output_tokens(self) -> int | None:
        """The cap on each answer, or None for the server's default."""
        ...


class ProviderContext:
    """What a provider opens its backend with.

    Args:
        stack: Closes what is opened (a backend's connections, a local server), with the
            daemon.
        environ: Where API keys are read from (``os.environ`` when None).
    """

    def __init__(self, stack: AsyncExitStack, environ: Mapping[str, str] | None) -> None:
        self.stack = stack
        self.environ = environ
        self._shared: dict[str, Any] = {}

    async def shared(self, key: str, make: Callable[[], Awaitable[T]]) -> T:
        """The object made for ``key``, made once (desks on the same model share one
        backend: its HTTP client's TLS setup alone costs ~60 ms of CPU)."""
        if key not in self._shared:
            self._shared[key] = await make()
        made: T = self._shared[key]
        return made


def _model(settings: Any) -> str:
    return str(settings.model)


def _api_key_env(settings: Any) -> str | None:
    variable = getattr(settings, "api_key_env", None)
    return variable if isinstance(variable, str) else None


@dataclass(frozen=True)
class Provider:
    """One provider.

    Attributes:
        name: What ``provider = "..."`` says.
        settings: Its ``[model]`` table: a pydantic model with ``provider: Literal[name]``.
        about: One line on what it reaches (``check-config``, the README).
        open_backend: Opens a backend for settings of this provider.
        model_name: The model's name in those settings, for a person.
        key_variable: The environment variable the settings name for an API key, if any.
    """

    name: str
    settings: type[BaseModel]
    about: str
    open_backend: Callable[[Any, ProviderContext], Awaitable[ModelBackend]]
    model_name: Callable[[Any], str] = _model
    key_variable: Callable[[Any], str | None] = _api_key_env


_REGISTRY: dict[str, Provider] = {}


def register(provider: Provider) -> Provider:
    """Adds a provider (its module calls this when imported).

    Raises:
        ValueError: Another provider has the name already.
    """
    known = _REGISTRY.get(provider.name)
    if known is not None and known is not provider:
        raise ValueError(f"two providers are named {provider.name!r}")
    _REGISTRY[provider.name] = provider
    return provider


def providers() -> tuple[Provider, ...]:
    """Every provider, built-in ones first, in their order."""
    for module in _BUILT_IN:
        importlib.import_module(f"{__name__}.{module}")
    return tuple(_REGISTRY.values())


def provider(name: str) -> Provider:
    """The provider of this name.

    Raises:
        ConfigError: No provider has it.
    """
    for known in providers():
        if known.name == name:
            return known
    raise ConfigError(f"unknown model provider {name!r}; the providers: "
                      f"{', '.join(p.name for p in providers())}")


def model_settings() -> Any:
    """The type of a ``[model]`` table: one of the providers' settings, by ``provider``."""
    members = tuple(p.settings for p in providers())
    return Annotated[Union[members], Field(discriminator="provider")]  # noqa: UP007
