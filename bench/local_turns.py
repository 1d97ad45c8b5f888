"""Desks taking turns on the embedded model: a request's time with contexts kept and without.

Two desks, each with its own ~900-token conversation, ask the local model in turn (a, b, a,
b, ...), each request its desk's conversation grown by the answer and a question, as a desk's
rounds grow. With ``kept_contexts_mb`` (the default, 512) the model sets a desk's read
context aside when the other desk asks and brings it back; with 0 (the reference, in the
same run, on the same model file) it reads each desk's whole prompt again. Printed: the
median seconds per request after each desk's first, the tokens not read again, and the ratio.

    .venv/bin/python bench/local_turns.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probes import machine
from trading_agent.backends.config import LocalModelConfig
from trading_agent.backends.local_server import LocalModelServer


def _conversation(name: str, noun: str) -> list[dict[str, Any]]:
    facts = " ".join(f"{noun} {i} was {16500 + i * 7}." for i in range(130))
    return [{"role": "system", "content": f"You are the desk {name}. {facts}"},
            {"role": "user", "content": f"{name}: what changed since your last look?"}]


async def _ask(client: httpx.AsyncClient, model: str,
               messages: list[dict[str, Any]]) -> tuple[str, dict[str, Any], float]:
    started = time.perf_counter()
    answer = await client.post("/chat/completions", json={
        "model": model, "max_tokens": 8, "temperature": 0, "messages": messages,
        "stream": True})
    answer.raise_for_status()
    chunks = [json.loads(line.removeprefix("data: ")) for line in answer.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    return text, chunks[-1]["usage"], time.perf_counter() - started


async def _run(config: LocalModelConfig, rounds: int) -> tuple[list[float], list[int]]:
    desks = [_conversation("alpha", "Price"), _conversation("beta", "Volume")]
    seconds: list[float] = []
    cached: list[int] = []
    async with LocalModelServer(config) as server, httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=server.unix_socket.path),
            base_url=server.base_url, timeout=600, trust_env=False) as client:
        for turn in range(rounds * len(desks)):
            conversation = desks[turn % len(desks)]
            text, usage, took = await _ask(client, server.model, conversation)
            if turn >= len(desks):  # each desk's first request reads everything either way
                seconds.append(took)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            conversation += [{"role": "assistant", "content": text},
                             {"role": "user", "content": f"And after round {turn}?"}]
    return seconds, cached


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as folder:
        config = LocalModelConfig(cache_dir=Path(folder) / "models", context_window=4096,
                                  threads=options.threads)
        reference, reference_cached = await _run(
            config.model_copy(update={"kept_contexts_mb": 0}), options.rounds)
        kept, kept_cached = await _run(config, options.rounds)
    before, after = statistics.median(reference), statistics.median(kept)
    print(f"{options.rounds} rounds of 2 desks in turn, {options.threads} thread(s); "
          "seconds per request after each desk's first:")
    print(f"  reference, kept_contexts_mb = 0: median {before:.2f} s "
          f"({', '.join(f'{s:.2f}' for s in reference)}), tokens not read again "
          f"{reference_cached}")
    print(f"  kept_contexts_mb = 512:          median {after:.2f} s "
          f"({', '.join(f'{s:.2f}' for s in kept)}), tokens not read again {kept_cached}")
    print(f"  ratio: {before / after:.1f}x faster with contexts kept")


if __name__ == "__main__":
    anyio.run(main)
