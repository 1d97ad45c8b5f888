"""The model providers: each module of this package registers one.

A provider is what ``provider = "..."`` names in a ``[model]`` table: its settings (a
pydantic model whose ``provider`` field is the name), a line saying what it is, and how its
backend is opened. The settings' ``ModelSettings``, ``check-config``, the desk building
and the README's list of providers (a test holds it to the registry) all read the registry,
so a new provider is one module here, found by a scan of this package, plus its tests. A
provider from another distribution names its module (or its :class:`Provider`) as an entry
point in the group :data:`ENTRY_POINT_GROUP`::

    [project.entry-points."trading_agent.providers"]
    echo = "echo_provider"

Reading the settings imports every provider module, so a module holds the settings and only
refers to its backend: the backend's module (and its HTTP client) is imported when a backend
is opened.

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
import importlib.metadata
import pkgutil
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Protocol, TypeVar, Union

from pydantic import BaseModel, Field

from trading_agent.errors import ConfigError

if TYPE_CHECKING:
    from trading_agent.agent.backend import ModelBackend
    from trading_agent.agent.fixed_part import TokenCounter

__all__ = ["ENTRY_POINT_GROUP", "ModelTable", "Provider", "ProviderContext", "model_settings",
           "provider", "providers", "register"]

ENTRY_POINT_GROUP = "trading_agent.providers"
"""The entry-point group of providers from other distributions: each entry point names a
module that registers its provider when imported, or a :class:`Provider`."""

_LISTED_FIRST = ("openai", "anthropic", "local")
"""The order in which this package's modules are listed (in ``check-config``'s messages and
the README); any other module of the package follows them by name, then the entry points by
name. Only the order: every module of the package is found by the scan."""

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


async def _no_counter(settings: Any) -> TokenCounter | None:
    return None


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
        offline_counter: The model's tokenizer without its server (``check-config``), if
            the provider has one at hand; None where it has not.
    """

    name: str
    settings: type[BaseModel]
    about: str
    open_backend: Callable[[Any, ProviderContext], Awaitable[ModelBackend]]
    model_name: Callable[[Any], str] = _model
    key_variable: Callable[[Any], str | None] = _api_key_env
    offline_counter: Callable[[Any], Awaitable[TokenCounter | None]] = _no_counter


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


def _package_modules() -> list[str]:
    """This package's modules, those of :data:`_LISTED_FIRST` first."""
    found = sorted(info.name for info in pkgutil.iter_modules(__path__)
                   if not info.name.startswith("_"))
    first = [name for name in _LISTED_FIRST if name in found]
    return [f"{__name__}.{name}" for name in [*first, *(n for n in found if n not in first)]]


def _load(entry_point: importlib.metadata.EntryPoint) -> None:
    """Imports an entry point's module (which registers its provider), or registers the
    :class:`Provider` it names."""
    try:
        loaded = entry_point.load()
    except Exception as exc:  # a broken plug-in is named, whatever it raised
        raise ConfigError(f"the model provider entry point {entry_point.name!r} "
                          f"({entry_point.value}) cannot be loaded: {exc}") from exc
    if isinstance(loaded, Provider):
        register(loaded)
    elif not isinstance(loaded, ModuleType):
        raise ConfigError(f"the model provider entry point {entry_point.name!r} "
                          f"({entry_point.value}) names neither a module nor a Provider")


_ORDER: list[str] = []
"""The modules that define providers, in the order their providers are listed; filled by
the first :func:`providers`."""


def _discover() -> None:
    if _ORDER:
        return
    modules = _package_modules()
    for module in modules:
        importlib.import_module(module)
    entry_points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
                          key=lambda entry_point: (entry_point.name, entry_point.value))
    for entry_point in entry_points:
        _load(entry_point)
    _ORDER.extend([*modules, *(entry_point.module for entry_point in entry_points)])


def providers() -> tuple[Provider, ...]:
    """Every provider: this package's, then those of entry points, in a fixed order.

    Raises:
        ConfigError: An entry point of :data:`ENTRY_POINT_GROUP` cannot be loaded.
    """
    _discover()
    rank = {module: index for index, module in enumerate(_ORDER)}
    # By the module that defines the provider's settings, whichever module was imported
    # first; a provider registered otherwise (a test's) comes last.
    return tuple(sorted(_REGISTRY.values(),
                        key=lambda known: rank.get(known.settings.__module__, len(rank))))


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
