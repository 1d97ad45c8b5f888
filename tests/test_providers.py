"""The model providers come from one registry: the settings accept exactly its providers,
and the README shows each with a config example."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from trading_agent.agent.backend import ModelBackend
from trading_agent.backends import providers as registry
from trading_agent.backends.providers import Provider, ProviderContext, providers, register
from trading_agent.errors import ConfigError

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_built_in_providers_in_their_order() -> None:
    assert [p.name for p in providers()] == ["openai", "anthropic", "local"]


def test_the_readme_lists_every_provider_with_a_config_example() -> None:
    text = README.read_text()
    listed = re.search(r"The providers: (.+?)\.\s*A desk may", text, re.S)
    assert listed is not None
    for provider in providers():
        assert f"`{provider.name}`" in listed.group(1), provider.name
        assert f'provider = "{provider.name}"' in text, (
            f"no [model] example with provider = {provider.name!r}")


def test_an_unknown_provider_names_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="unknown model provider 'mistral'; the providers: "
                                          "openai, anthropic, local"):
        registry.provider("mistral")


def test_two_providers_may_not_share_a_name() -> None:
    class Settings(BaseModel):
        provider: Literal["openai"]

    async def open_backend(settings: Settings, context: ProviderContext) -> ModelBackend:
        raise NotImplementedError

    with pytest.raises(ValueError, match="two providers are named 'openai'"):
        register(Provider("openai", Settings, "a second openai", open_backend))
