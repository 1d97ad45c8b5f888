"""``pyproject.toml`` declares what the code imports, at versions that really work.

Every third-party module ``src/`` imports must come from a direct dependency (``httpx2``
once arrived only through ``openai``), and every dependency's lower bound must be a release
the code works with: the slow test installs exactly the lowest versions allowed (pip
``--constraint`` with ``name==floor`` for each) into a scratch virtualenv from the configured
package index, then runs ``check-config`` on the demo and the tests of each adapter that
leans on a dependency (the OpenAI SDK and httpx2, pydantic-settings, starlette and uvicorn,
prometheus-client, OpenTelemetry, ccxt, croniter, structlog, pillow; psycopg and nats-py
against the machine's PostgreSQL and NATS) against their local stand-ins. Nothing reaches
the internet beyond the package index; without one, the test is skipped and says so.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

TEST_TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist", "hypothesis")
"""The dev dependencies the lowest-versions run needs, themselves at their floors."""

ADAPTER_TESTS = (
    "tests/backends/test_openai_compatible.py",  # openai, aiohttp (scripted server)
    "tests/backends/test_wire_identity.py",      # the SDK's headers, byte-identical bodies
    "tests/test_settings.py",                    # pydantic, pydantic-settings
    "tests/operator/test_api.py",                # starlette, uvicorn, httpx (Unix socket)
    "tests/operator/test_tcp.py",                # the same on TCP, with the bearer token
    "tests/operator/test_metrics.py",            # prometheus-client
    "tests/telemetry/test_traces.py",            # opentelemetry
    "tests/trading/test_ccxt_exchange.py",       # ccxt (FakeBinance)
    "tests/test_event_loop.py",                  # uvloop (a turn's I/O on it)
    "tests/daemon/test_schedules.py",            # croniter, tzdata
    "tests/test_logging.py",                     # structlog
    "tests/agent/test_image_preparer.py",        # pillow
    # mcp, jsonschema (stdio and HTTP servers): what goes through the library (listing,
    # calls, content, errors, headers, capping); the file's tests of how the desk restarts a
    # server that died or never came (our supervision, the same at any version) are left out.
    *(f"tests/tools/test_mcp.py::{name}" for name in (
        "test_tools_are_listed_under_the_prefix_with_their_schemas",
        "test_a_call_gives_the_servers_text", "test_calls_of_one_round_share_the_connection",
        "test_a_picture_reaches_the_model_as_an_image", "test_bad_arguments_come_back_readable",
        "test_the_servers_error_text_reaches_the_model",
        "test_an_http_server_that_dies_gives_readable_errors",
        "test_a_malformed_answer_is_a_readable_error",
        "test_the_header_reaches_the_server_and_never_the_model",
        "test_a_wrong_key_fails_the_start_without_showing_it",
        "test_a_servers_huge_descriptions_schemas_tool_counts_and_errors_are_capped")),
    "tests/store/test_postgres.py",              # psycopg (the machine's PostgreSQL)
    "tests/fleet/test_bus.py",                   # nats-py (the machine's NATS)
    "tests/fleet/test_nats_auth.py",             # nats-py signing in (a nats-server's own)
    "tests/telegram/test_conversation.py",       # python-telegram-bot (the Bot API stand-in)
)
"""The tests of the code that leans on each dependency; each takes seconds."""

NOT_ABOUT_VERSIONS = "not reused_connection"
"""Left out of that run: a latency bound, which a busy machine breaks, whatever the versions."""

_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name",
                "Name or service not known", "Network is unreachable", "ConnectTimeout",
                "ProxyError", "Connection refused", "Could not fetch URL")


def _requirements() -> list[Requirement]:
    """The runtime dependencies, then the test tools from the ``dev`` extra."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        project: dict[str, Any] = tomllib.load(file)["project"]
    runtime = [Requirement(text) for text in project["dependencies"]]
    dev = [Requirement(text) for text in project["optional-dependencies"]["dev"]]
    return runtime + [req for req in dev if req.name in TEST_TOOLS]


def lowest_pins(requirements: list[Requirement]) -> list[str]:
    """``name==floor`` for each requirement, from its ``>=`` (or ``==``) bound.

    Args:
        requirements: The declared requirements.

    Returns:
        One constraint line per requirement.

    Raises:
        AssertionError: A requirement has no lower bound.
    """
    pins = []
    for req in requirements:
        floors = [spec.version for spec in req.specifier if spec.operator in (">=", "==")]
        assert len(floors) == 1, f"{req}: declare one lower bound (>=) the code is tested with"
        pins.append(f"{req.name}=={floors[0]}")
    return pins


def _third_party_imports() -> dict[str, Path]:
    """Every module ``src/`` imports that is neither ours nor the standard library (for
    ``from package import name``, ``package.name`` too, in case it is a module), with a
    file that imports it."""
    found: dict[str, Path] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top != "trading_agent" and top not in sys.stdlib_module_names:
                    found.setdefault(name, path)
    return found


@functools.cache
def _top_level_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _distribution_of(module: str) -> str | None:
    """The installed distribution that provides ``module``: by its file, for namespace
    packages such as ``opentelemetry`` that several distributions share.

    Returns:
        Its canonical name; ``""`` for a name that is no module (an attribute imported with
        ``from package import name``, or a namespace package's directory); None for a
        module no installed distribution provides.
    """
    candidates = set(_top_level_distributions().get(module.partition(".")[0], []))
    if len(candidates) == 1:
        return canonicalize_name(candidates.pop())
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.origin or spec.origin == "namespace":
        return "" if candidates else None
    origin = Path(spec.origin).resolve()
    for name in candidates:
        dist = importlib.metadata.distribution(name)
        if any(Path(str(dist.locate_file(file))).resolve() == origin
               for file in dist.files or []):
            return canonicalize_name(name)
    return None


def test_every_third_party_import_is_a_direct_dependency_with_a_floor() -> None:
    declared = {canonicalize_name(req.name) for req in _requirements()}
    lowest_pins(_requirements())  # every one has a lower bound
    missing: dict[str, str] = {}
    for module, where in sorted(_third_party_imports().items()):
        distribution = _distribution_of(module)
        if distribution == "":
            continue  # not a module of its own: the package it is in was checked
        if distribution is None or distribution not in declared:
            missing.setdefault(distribution or module,
                               f"{distribution or 'no installed distribution'}, for {module} "
                               f"(imported in {where.relative_to(ROOT)})")
    assert not missing, ("not a direct dependency in pyproject.toml:\n"
                         + "\n".join(missing.values()))


def _run(command: list[str], *, timeout: float,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _pip(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                timeout=timeout)


_BOUND = 420
"""Seconds for the whole test: 83 s alone on a slow machine, and more than twice that inside
a loaded suite (its adapter tests went past a fixed 150 s there)."""


@pytest.mark.slow
@pytest.mark.timeout(_BOUND)
def test_the_lowest_declared_versions_install_and_work(tmp_path: Path) -> None:
    started = time.monotonic()
    requirements = _requirements()
    pins = lowest_pins(requirements)
    constraints = tmp_path / "lowest.txt"
    constraints.write_text("\n".join(pins) + "\n")

    probe = _pip("download", "--no-deps", "--dest", str(tmp_path / "probe"), "--timeout",
                 "15", "--retries", "1", next(p for p in pins if p.startswith("openai==")),
                 timeout=60)
    if probe.returncode != 0 and any(word in probe.stdout + probe.stderr
                                     for word in _UNREACHABLE):
        pytest.skip("the package index cannot be reached, so the lowest versions cannot be "
                    f"installed: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    assert probe.returncode == 0, probe.stderr[-3000:]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    # --no-compile: byte-compiling every module of every package (ccxt alone has thousands)
    # is no part of "installs and works"; Python compiles what the run imports.
    installed = _pip("--python", python, "install", "--quiet", "--no-compile",
                     "--constraint", str(constraints),
                     *[str(req) for req in requirements])
    assert installed.returncode == 0, (
        f"the lowest versions ({', '.join(pins)}) do not install together:\n"
        f"{installed.stderr[-4000:]}")
    listed = _pip("--python", python, "list", "--format", "json")
    versions = {canonicalize_name(row["name"]): row["version"]
                for row in json.loads(listed.stdout)}
    for pin in pins:
        name, _, version = pin.partition("==")
        assert versions.get(canonicalize_name(name)) in (version, f"{version}.0"), (
            f"{pin} was asked for, {versions.get(canonicalize_name(name))} installed")

    env = {key: value for key, value in os.environ.items()
           if not key.startswith("TRADING_AGENT_")}
    env.pop("STATE_DIRECTORY", None)
    env["PYTHONPATH"] = str(ROOT / "src")
    check = _run([python, "-W", "error", "-m", "trading_agent.cli", "check-config",
                  "config/demo.toml"], timeout=60, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith("OK: 2 desks"), check.stdout + check.stderr

    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    # Two workers: these tests mostly wait on their servers (MCP children, NATS, PostgreSQL),
    # so the run takes half the time and hardly more of the machine.
    tests = _run([python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2",
                  "-m", "not slow", "-k", NOT_ABOUT_VERSIONS, *ADAPTER_TESTS],
                 timeout=_BOUND - 15 - (time.monotonic() - started), env=env)
    assert tests.returncode == 0, (f"with {', '.join(pins)}:\n"
                                   f"{tests.stdout[-6000:]}{tests.stderr[-2000:]}")
