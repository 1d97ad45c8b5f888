"""A provider from another distribution is found by its entry point, with no edit here: the
settings accept it, ``check-config`` shows it, and the error report lists it.

The distribution is installed for real, as far as importlib.metadata can tell: a dist-info
directory with an ``entry_points.txt`` on the path of a fresh interpreter, next to the
provider's package (``tests/fixtures/provider_plugin``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PLUGIN = Path(__file__).resolve().parent / "fixtures" / "provider_plugin"

CONFIG = """
[daemon]
state_dir = "state"

[model]
provider = "{provider}"
context_window = 16000

[desks.alpha]
system_prompt = "You trade."
symbols = ["BTC/USDT"]
"""


def _install(site: Path) -> dict[str, str]:
    """The environment of an interpreter that sees the echo provider's distribution."""
    info = site / "echo_provider-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-provider\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[trading_agent.providers]\necho = echo_provider\n")
    path = os.pathsep.join([str(site), str(PLUGIN), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}


def _run(environ: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          env=environ, timeout=120, check=False)


def _config(tmp_path: Path, provider: str) -> Path:
    path = tmp_path / f"{provider}.toml"
    path.write_text(textwrap.dedent(CONFIG.format(provider=provider)), encoding="utf-8")
    return path


def test_a_provider_of_another_distribution_is_listed_after_the_built_in_ones(
        tmp_path: Path) -> None:
    environ = _install(tmp_path / "site")
    done = _run(environ, "-c", "from trading_agent.backends.providers import providers; "
                               "print(' '.join(p.name for p in providers()))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["openai", "anthropic", "local", "echo"]


def test_check_config_and_load_settings_accept_the_new_provider(tmp_path: Path) -> None:
    environ = _install(tmp_path / "site")
    path = _config(tmp_path, "echo")
    done = _run(environ, "-m", "trading_agent.cli", "check-config", str(path))
    assert done.returncode == 0, done.stderr
    assert "alpha: paper on replay, BTC/USDT; model echo:echo-1" in done.stdout
    loaded = _run(environ, "-c", "import sys; from trading_agent.settings import load_settings; "
                                 "model = load_settings(sys.argv[1]).desks['alpha'].model; "
                                 "print(type(model).__module__, model.context_window)", str(path))
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["echo_provider", "16000"]


def test_the_error_report_lists_the_new_provider_among_the_allowed(tmp_path: Path) -> None:
    environ = _install(tmp_path / "site")
    path = _config(tmp_path, "mistral")
    done = _run(environ, "-m", "trading_agent.cli", "check-config", str(path))
    assert done.returncode == 2
    assert (f"{path}: model.provider: unknown kind (got 'mistral'; allowed: 'openai', "
            "'anthropic', 'local', 'echo')") in done.stderr.splitlines()


def test_without_the_distribution_the_provider_is_unknown(tmp_path: Path) -> None:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(PLUGIN), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = _run(environ, "-m", "trading_agent.cli", "check-config", str(_config(tmp_path, "echo")))
    assert done.returncode == 2
    assert "allowed: 'openai', 'anthropic', 'local')" in done.stderr
