"""Reading the settings loads data only: no agent loop, no tool, no backend, no HTTP client.

``check-config``, the operator's CLI and a fleet's tooling read the settings; a settings
module that imports a runtime part drags its import cost (and its import circles) into every
one of them. Each check runs in a fresh interpreter, so nothing another test imported counts.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_ALLOWED_OF_OURS = {
    # The agent package's __init__ imports its names on first use; the settings check a
    # context table with the compressor's window rule, which is plain arithmetic.
    "trading_agent.agent": {"trading_agent.agent", "trading_agent.agent.context_budget"},
    # The tools' settings and names, apart from the tools.
    "trading_agent.tools": {"trading_agent.tools", "trading_agent.tools.config"},
    # The backends' settings and the providers' registry (settings models and names); the
    # llama.cpp chat handler holds the name of its chat format, with stdlib imports only.
    "trading_agent.backends": {"trading_agent.backends", "trading_agent.backends.config",
                               "trading_agent.backends.llama_chat_handler",
                               "trading_agent.backends.providers"},
}
_PROVIDER_MODULES = "trading_agent.backends.providers."
_THIRD_PARTY = ("openai", "anthropic", "aiohttp", "httpx", "ccxt", "PIL", "mcp", "llama_cpp")
"""Packages that only a backend, a tool or an exchange needs."""


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    return set(json.loads(done.stdout))


@pytest.mark.parametrize("statement", [
    "import trading_agent.settings",
    "from trading_agent.settings import load_settings",
    "from trading_agent.backends.providers import providers; providers()",
])
def test_reading_the_settings_imports_no_agent_loop_tool_or_backend(statement: str) -> None:
    modules = _modules_after(statement)
    assert "trading_agent.settings" in modules or "settings" not in statement
    for package, allowed in _ALLOWED_OF_OURS.items():
        loaded = {m for m in modules if m == package or m.startswith(package + ".")}
        if package == "trading_agent.backends":
            loaded = {m for m in loaded if not m.startswith(_PROVIDER_MODULES)}
        assert loaded <= allowed, f"{statement!r} imports {sorted(loaded - allowed)}"
    assert "trading_agent.agent.agent_loop" not in modules
    heavy = sorted(name for name in _THIRD_PARTY
                   if name in modules or any(m.startswith(name + ".") for m in modules))
    assert heavy == [], f"{statement!r} imports {heavy}"


def test_the_provider_modules_are_found_and_stay_light() -> None:
    modules = _modules_after("import trading_agent.settings")
    found = {m for m in modules if m.startswith(_PROVIDER_MODULES)}
    assert {_PROVIDER_MODULES + name for name in ("openai", "anthropic", "local")} <= found
    for backend in ("openai_compatible", "anthropic", "local_server", "sse_transport"):
        assert f"trading_agent.backends.{backend}" not in modules


def test_a_daemon_alone_on_sqlite_loads_no_fleet_telegram_or_postgresql_client() -> None:
    """Each is a tenth of a second or more of every daemon's start (and of every test that
    starts one): they load with a fleet, a [telegram] table or a PostgreSQL store only."""
    modules = _modules_after("import trading_agent.app.services, trading_agent.cli")
    assert "trading_agent.app.services" in modules
    loaded = sorted(name for name in ("nats", "telegram", "psycopg") if name in modules)
    assert loaded == []
