"""Prompt caching on the wire: the per-desk ``prompt_cache_key``, the bytes when it is off,
and the cached tokens a server reports, read and priced (against the scripted server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.scripted_server import Reply, ScriptedServer, SSEChunks
from trading_agent.agent.backend import ModelRequestSpec, Pricing, Usage, desk_cache_key
from trading_agent.agent.conversation import Message
from trading_agent.backends import openai_compatible
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend

MODEL = "test-model"
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_ticker", "description": "Last price of a market.",
                 "parameters": {"type": "object",
                                "properties": {"symbol": {"type": "string"}},
                                "required": ["symbol"]}},
}


def _config(server: ScriptedServer, **overrides: Any) -> OpenAIBackendConfig:
    return OpenAIBackendConfig(**{"base_url": server.base_url, "model": MODEL,
                                  "context_window": 8192, "request_timeout": 5.0,
                                  **overrides})


def _request(desk: str | None, text: str = "What is BTC doing?") -> ModelRequestSpec:
    return ModelRequestSpec("You run a trading desk.", [Message.user_text(text)], [TOOL],
                            cache_key=desk_cache_key(desk) if desk else None)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------- the key


async def test_each_desk_sends_its_own_key_through_one_shared_backend(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("a"), Reply("b"), Reply("c"))

    async with OpenAICompatibleBackend(_config(scripted_server)) as backend:
        await backend.complete(_request("alpha"))
        await backend.complete(_request("beta"))
        await backend.complete(_request(None))  # a request without a key (a test, a tool)

    alpha, beta, keyless = (r.json for r in scripted_server.requests)
    assert alpha["prompt_cache_key"] == "trading-agent:alpha"
    assert beta["prompt_cache_key"] == "trading-agent:beta"
    assert "prompt_cache_key" not in keyless
    # The key goes before tools and messages: the body's growing tail stays at its end.
    body = scripted_server.requests[0].body
    assert body.index(b'"prompt_cache_key"') < body.index(b'"tools"') < body.index(
        b'"messages"')
    scripted_server.assert_complete()


async def test_a_key_of_ones_own_replaces_the_desks(scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("a"), Reply("b"))

    async with OpenAICompatibleBackend(_config(scripted_server,
                                               prompt_cache_key="acme-desks")) as backend:
        await backend.complete(_request("alpha"))
        await backend.complete(_request(None))

    assert [r.json["prompt_cache_key"] for r in scripted_server.requests] == [
        "acme-desks", "acme-desks"]


async def test_with_the_key_off_the_body_is_byte_for_byte_what_it_was(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("a"), Reply("b"))
    config = _config(scripted_server, prompt_cache_key=False, max_output_tokens=256)

    async with OpenAICompatibleBackend(config) as backend:
        await backend.complete(_request("alpha"))
        await backend.complete(_request(None))

    with_key, without_key = (r.body for r in scripted_server.requests)
    # The body the backend sent before prompt caching existed, spelled out.
    expected = (
        '{"model":"test-model","stream":true,"stream_options":{"include_usage":true},'
        '"max_tokens":256,"tools":[' + _dump(TOOL) + '],"messages":['
        '{"role":"system","content":"You run a trading desk."},'
        '{"role":"user","content":"What is BTC doing?"}]}').encode()
    assert with_key == without_key == expected


def test_the_key_setting_reads_booleans_from_text_and_refuses_nonsense() -> None:
    base = {"base_url": "http://127.0.0.1:1/v1", "model": "m", "context_window": 10}
    # An environment variable is text: "false" is the boolean, not a key named "false".
    assert OpenAIBackendConfig.model_validate(
        {**base, "prompt_cache_key": "FALSE"}).prompt_cache_key is False
    assert OpenAIBackendConfig.model_validate(
        {**base, "prompt_cache_key": "true"}).prompt_cache_key is True
    assert OpenAIBackendConfig(**base).cache_key_for("trading-agent:alpha") == (
        "trading-agent:alpha")
    with pytest.raises(ValueError, match="may not be empty"):
        OpenAIBackendConfig.model_validate({**base, "prompt_cache_key": "  "})
    with pytest.raises(ValueError, match=r"true .* false .* or a key"):
        OpenAIBackendConfig.model_validate({**base, "prompt_cache_key": 5})
    with pytest.raises(ValueError, match="prompt_cache_key"):
        OpenAIBackendConfig.model_validate({**base, "extra_body": {"prompt_cache_key": "x"}})


# --------------------------------------------------------------------------- cached tokens


async def test_cached_tokens_are_read_and_priced_at_their_own_price(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("ok", usage=(4000, 100), cached_tokens=3072))
    config = _config(scripted_server, price_input_per_million=2.0,
                     price_cached_input_per_million=0.5, price_output_per_million=10.0)

    async with OpenAICompatibleBackend(config) as backend:
        reply = await backend.complete(_request("alpha"))

    # Cached tokens are part of prompt_tokens: 928 at the input price, 3,072 at the cached.
    assert reply.usage == Usage(4000, 100, estimated=False,
                                cost=(928 * 2.0 + 3072 * 0.5 + 100 * 10.0) / 1e6,
                                cached_input_tokens=3072)


async def test_without_a_cached_price_cached_tokens_cost_the_input_price(
        scripted_server: ScriptedServer) -> None:
    scripted_server.add(Reply("ok", usage=(2048, 10), cached_tokens=1024))
    config = _config(scripted_server, price_input_per_million=2.0,
                     price_output_per_million=10.0)

    async with OpenAICompatibleBackend(config) as backend:
        reply = await backend.complete(_request("alpha"))

    assert reply.usage.cached_input_tokens == 1024
    assert reply.usage.cost == pytest.approx((2048 * 2.0 + 10 * 10.0) / 1e6)


@pytest.mark.parametrize(("usage", "expected"), [
    # llama.cpp style: on the finishing chunk, no details at all.
    ({"prompt_tokens": 900, "completion_tokens": 3}, 0),
    ({"prompt_tokens": 900, "completion_tokens": 3, "prompt_tokens_details": None}, 0),
    ({"prompt_tokens": 900, "completion_tokens": 3,
      "prompt_tokens_details": {"cached_tokens": "lots"}}, 0),
    # A server that claims more than the prompt: no more than the prompt is cached.
    ({"prompt_tokens": 900, "completion_tokens": 3,
      "prompt_tokens_details": {"cached_tokens": 5000}}, 900),
    # No prompt count: the prompt is estimated, and nothing is known to be cached.
    ({"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 512}}, 0),
])
async def test_odd_usage_reports_give_a_sane_cached_count(
        scripted_server: ScriptedServer, usage: dict[str, Any], expected: int) -> None:
    scripted_server.add(SSEChunks([
        {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage},
    ]))

    async with OpenAICompatibleBackend(_config(scripted_server)) as backend:
        reply = await backend.complete(_request("alpha"))

    assert reply.usage.cached_input_tokens == expected


def test_usage_adds_cached_tokens_and_pricing_charges_them_apart() -> None:
    total = Usage(1000, 10, cost=0.5, cached_input_tokens=600) + Usage(
        2000, 20, cost=0.25, cached_input_tokens=1500)
    assert total == Usage(3000, 30, False, 0.75, 2100)
    pricing = Pricing(input_per_million=3.0, output_per_million=15.0,
                      cached_input_per_million=0.3)
    assert pricing.cost(1_000_000, 0, cached_input_tokens=1_000_000) == pytest.approx(0.3)
    assert pricing.cost(1_000_000, 0, cached_input_tokens=250_000) == pytest.approx(
        0.75 * 3.0 + 0.25 * 0.3)
    assert Pricing(3.0, 15.0).cost(1_000_000, 1_000_000, 999) == pytest.approx(18.0)


def test_a_cached_price_needs_the_other_prices() -> None:
    base = {"base_url": "http://127.0.0.1:1/v1", "model": "m", "context_window": 10}
    with pytest.raises(ValueError, match="price_cached_input_per_million needs"):
        OpenAIBackendConfig(**base, price_cached_input_per_million=0.1)
    config = OpenAIBackendConfig(**base, price_input_per_million=1.0,
                                 price_output_per_million=2.0,
                                 price_cached_input_per_million=0.1)
    assert openai_compatible.pricing(config) == Pricing(1.0, 2.0, 0.1)
