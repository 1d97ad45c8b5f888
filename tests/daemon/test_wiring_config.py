"""What the wiring takes from a desk's settings: context, images, tools; and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripted_server import ScriptedServer
from trading_agent.daemon.wiring import open_daemon
from trading_agent.errors import ConfigError
from trading_agent.settings import DESK_TOOL_NAMES, load_settings


def _config(folder: Path, base_url: str) -> Path:
    path = folder / "daemon.toml"
    path.write_text(f"""
[daemon]
state_dir = "{folder / 'state'}"

[model]
provider = "openai"
base_url = "{base_url}"
model = "scripted-model"
context_window = 32000

[desks.alpha]
system_prompt = "You are alpha."
symbols = ["BTC/USDT"]

[desks.beta]
system_prompt = "You are beta."
symbols = ["BTC/USDT"]
[desks.beta.context]
keep_recent_tokens = 4000
summary_max_tokens = 800
tool_result_max_tokens = 1500
flush_max_rounds = 5
[desks.beta.images]
keep = 2
max_side = 1024
""")
    return path


async def test_context_and_image_settings_reach_the_desk(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, scripted_server.base_url))

    async with open_daemon(settings) as daemon:
        alpha, beta = (runtime.desk.loop for runtime in daemon.supervisor.runtimes)
        compressor = beta._compressor
        assert compressor is not None
        assert (compressor.context_window, compressor.keep_recent_tokens,
                compressor.summary_max_tokens, compressor.tool_result_max_tokens,
                compressor.flush_max_rounds) == (32000, 4000, 800, 1500, 5)
        assert (beta._image_preparer.limits.keep,
                beta._image_preparer.limits.max_side) == (2, 1024)
        # alpha has every default, and every tool: exactly the names the settings accept.
        assert alpha._compressor is not None and alpha._compressor.flush_max_rounds == 3
        assert alpha._image_preparer.limits.keep == 4
        assert sorted(d["function"]["name"] for d in alpha.tool_definitions()) == sorted(
            DESK_TOOL_NAMES)


async def test_context_settings_that_do_not_fit_the_window_are_a_config_error(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, scripted_server.base_url))
    # Past the check at load time (tests/test_settings.py): the wiring refuses it too.
    settings.desks["beta"].context.keep_recent_tokens = 20_000

    with pytest.raises(ConfigError) as caught:
        async with open_daemon(settings):
            pass
    message = str(caught.value)
    assert message.startswith("desks.beta.context: keep_recent_tokens (20000) plus "
                              "summary_max_tokens (800) must be at most half the context "
                              "window (32000 tokens)")
    assert "desks.beta.context.keep_recent_tokens (now 20000)" in message
    assert "desks.beta.context.summary_max_tokens (now 800)" in message
