"""Model backends: one module per provider, each implementing
:class:`trading_agent.agent.backend.ModelBackend`.

- :mod:`.config`: the settings a backend is built from (embedded by the daemon's settings).
- :mod:`.openai_compatible`: any OpenAI-compatible chat-completions server (OpenAI, vLLM,
  llama.cpp, Ollama, OpenRouter), streamed, with each message encoded to wire JSON once.
"""

from __future__ import annotations

__all__: list[str] = []
