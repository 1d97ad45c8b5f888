"""Which way the imports run, read from the source with ``ast`` (nothing is imported).

An import under ``if TYPE_CHECKING:`` is for the type checker only and is left out; an
import inside a function is counted apart, and only the lazy imports listed in
:data:`LAZY_IMPORTS`, each with its reason, may be one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "src" / "trading_agent"
PACKAGE = "trading_agent"

LAZY_IMPORTS: dict[tuple[str, str], str] = {
    # The command line loads only what the command run needs.
    ("cli", "app.running"): "run: the daemon's services (NATS, telemetry, the API server)",
    ("cli", "app.event_loop"): "run: the event loop the daemon runs on (uvloop)",
    ("cli", "desks.building"): "check-config: the tools, the agent loop, the model clients",
    ("cli", "operator.cli"): "the operator's commands: their HTTP client",
    ("cli", "operator.control_cli"): "the operator's commands: their HTTP client",
    ("cli", "operator.books_cli"): "the operator's commands: their HTTP client",
    ("cli", "operator.audit_cli"): "the operator's commands: their HTTP client",
    ("cli", "backtest.cli"): "backtest: the engine and its report (pillow)",
    ("cli", "backtest.fetch"): "data fetch: its ccxt client",
    ("cli", "trading.ccxt_exchange"): "check-config of a live desk: which protective orders "
                                      "its exchange holds (ccxt's has flags)",
    ("cli", "trading.protection"): "check-config of a live desk: the notice of a protection "
                                   "the daemon watches",
    ("backtest.cli", "backtest.engine"): "the engine builds a whole desk; --help needs none",
    ("backtest.cli", "backtest.audit"): "only an audit compares runs",
    ("backtest.cli", "backtest.metrics"): "only an audit computes figures itself",
    ("backtest.cli", "backtest.parallel"): "only a sweep runs windows in workers",
    ("backtest.cli", "backtest.scorecard"): "only a sweep scores windows",
    ("backtest.cli", "backtest.scorecard_report"): "only a sweep writes a scorecard",
    ("backtest.cli", "backtest.sweep"): "only a sweep runs windows",
    ("backtest.cli", "backtest.windows"): "only a sweep chooses windows",
    ("backtest.cli", "trading.exchange"): "a sweep's candle step, with the engine loaded",
    ("backtest.cli", "backtest.mask"): "the mask wraps a running engine's venue",
    ("backtest.cli", "backtest.progress"): "only a running backtest draws progress",
    ("backtest.cli", "backtest.record"): "only a running backtest records",
    ("backtest.cli", "backtest.report"): "the report draws with pillow",
    ("backtest.cli", "backtest.replay_cli"): "only --from-desk replays a stored day",
    ("backtest.cli", "logging_setup"): "only a running backtest logs",
    ("backtest.cli", "settings"): "every desk's schema, needed only with a config",
    ("backtest.fetch", "trading.ccxt_exchange"): "ccxt takes a second to import",
    ("backtest.fetch", "settings"): "every desk's schema, needed only with --config",
    ("operator.cli", "settings"): "every desk's schema, needed only with --config",
    ("trading.factory", "trading.ccxt_exchange"): "ccxt: only a live venue needs it",
    ("trading.factory", "trading.ccxt_feed"): "ccxt: only a live venue needs it",
    ("trading.factory", "trading.reconciliation"): "ccxt: only a live venue reconciles",
    ("tools.charts", "trading.config"): "the README's chart script, not the tool",
    ("tools.charts", "trading.feed"): "the README's chart script, not the tool",
    ("tools.charts", "trading.replay"): "the README's chart script, not the tool",
    ("backends.providers.openai", "backends.openai_compatible"): "the openai SDK",
    ("backends.providers.anthropic", "backends.anthropic"): "the anthropic SDK",
    ("backends.providers.local", "backends.local_server"): "llama.cpp's bindings",
    ("backends.providers.local", "backends.local_tokenizer"): "llama.cpp's bindings",
    ("backends.llama_chat_handler", "backends.llama_contexts"): (
        "the model server's process only: the settings read names from the handler"),
    ("fleet.control", "fleet.bus"): "the NATS client, for a request to another daemon",
    ("app.services", "fleet.node"): "the NATS client, for a daemon in a fleet only",
    ("app.services", "telegram.bot"): "python-telegram-bot, with a [telegram] table only",
    ("store.database", "store.postgres_engine"): "psycopg, for a PostgreSQL store only",
}
"""Imports of ours inside a function: (importer, imported) without the ``trading_agent.``
prefix, and why each waits. No other is allowed, least of all one dodging a circle."""

SETTINGS_SCHEMAS = {"fleet.config", "operator.config", "telegram.config", "telemetry.config"}
"""Parts' settings that the settings embed; each imports nothing else of its package, so a
backtest reading its settings loads no fleet, operator API or telemetry code."""


@dataclass
class Imports:
    """Our modules and the modules of ours each imports."""

    at_load: dict[str, set[str]] = field(default_factory=dict)
    in_functions: dict[str, set[str]] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return set(self.at_load)

    def reached_from(self, start: str) -> set[str]:
        """Every module importing ``start`` loads (``start`` included)."""
        seen, todo = {start}, [start]
        while todo:
            for found in self.at_load[todo.pop()]:
                if found not in seen:
                    seen.add(found)
                    todo.append(found)
        return seen


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _nodes_under(nodes: Iterable[ast.AST]) -> set[int]:
    return {id(inner) for node in nodes for inner in ast.walk(node) if inner is not node}


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: set[str]) -> Iterator[str]:
    """The modules of ours an import statement loads, by their names under the package."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if module else []
            up = here if is_package else here[:-1]
            up = up[: len(up) - (node.level - 1)]
            base = ".".join([PACKAGE, *up, *([base] if base else [])])
        names = [f"{base}.{alias.name}" for alias in node.names] + [base]
    for name in names:
        if name != PACKAGE and not name.startswith(PACKAGE + "."):
            continue
        name = name.removeprefix(PACKAGE).removeprefix(".")
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name != module:
            yield name


def read_imports(root: Path = ROOT) -> Imports:
    """Parses every module under ``root``."""
    paths = _module_names(root)
    known = set(paths)
    imports = Imports()
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = _nodes_under(
            node for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
        in_function = _nodes_under(
            node for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef))
        at_load, later = imports.at_load.setdefault(module, set()), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in typing_only:
                found = set(_targets(node, module, path.name == "__init__.py", known))
                (later if id(node) in in_function else at_load).update(found)
        imports.in_functions[module] = later
    return imports


def _package(module: str) -> str:
    return module.partition(".")[0] or "(root)"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package_graph(imports: Imports) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in imports.at_load.items():
        edges = graph.setdefault(_package(module), set())
        edges.update(_package(t) for t in targets if _package(t) != _package(module))
    return graph


@pytest.fixture(scope="module")
def imports() -> Imports:
    return read_imports()


def test_the_reader_sees_a_circle_hidden_in_a_function(tmp_path: Path) -> None:
    package = tmp_path / "trading_agent"
    (package / "daemon").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "daemon" / "__init__.py").write_text("")
    (package / "daemon" / "supervisor.py").write_text(
        "def run():\n    from trading_agent.daemon.wiring import open_daemon\n")
    (package / "daemon" / "wiring.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import supervisor\n"
        "if TYPE_CHECKING:\n    from trading_agent import cli\n")
    (package / "cli.py").write_text("")
    found = read_imports(package)
    assert found.at_load["daemon.wiring"] == {"daemon", "daemon.supervisor"}
    assert found.in_functions["daemon.supervisor"] == {"daemon.wiring"}
    graph = {**found.at_load, "daemon.supervisor": {"daemon.wiring"}}
    assert _cycles(graph) == [["daemon.supervisor", "daemon.wiring"]]


def test_no_module_imports_another_in_a_circle(imports: Imports) -> None:
    assert _cycles(imports.at_load) == []


def test_no_package_imports_another_in_a_circle(imports: Imports) -> None:
    assert _cycles(_package_graph(imports)) == []


def test_only_the_listed_lazy_imports_wait_inside_a_function(imports: Imports) -> None:
    found = {(module, target) for module, targets in imports.in_functions.items()
             for target in targets}
    assert sorted(found - set(LAZY_IMPORTS)) == []
    assert sorted(set(LAZY_IMPORTS) - found) == []  # the list says what the code does


def test_the_agent_core_imports_nothing_of_ours_but_errors(imports: Imports) -> None:
    assert _package_graph(imports)["agent"] <= {"errors"}


@pytest.mark.parametrize("package", ["daemon", "trading"])
def test_the_runtime_never_climbs_to_the_services(imports: Imports, package: str) -> None:
    assert _package_graph(imports)[package] & {"app", "operator", "fleet", "telemetry",
                                               "telegram", "cli", "desks", "settings"} == set()


def test_only_the_command_line_imports_the_application_layer(imports: Imports) -> None:
    importers = {module for module, targets in imports.at_load.items()
                 if any(_package(t) == "app" for t in targets)}
    importers |= {module for module, targets in imports.in_functions.items()
                  if any(_package(t) == "app" for t in targets)}
    assert {_package(module) for module in importers} <= {"cli", "app"}


def test_a_backtest_loads_no_fleet_operator_api_or_telemetry(imports: Imports) -> None:
    loaded = imports.reached_from("backtest.engine") - SETTINGS_SCHEMAS
    assert sorted(m for m in loaded
                  if _package(m) in {"app", "fleet", "operator", "telegram",
                                     "telemetry"}) == []


@pytest.mark.parametrize("schema", sorted(SETTINGS_SCHEMAS))
def test_a_parts_settings_import_nothing_else_of_the_part(imports: Imports,
                                                          schema: str) -> None:
    part = _package(schema)
    assert {t for t in imports.at_load[schema] if _package(t) == part} <= {part}
