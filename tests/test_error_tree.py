"""The tree drawn in ``errors.py``'s docstring is the project's real exception tree.

Every subclass of :class:`TradingAgentError` defined anywhere in the package appears in the
drawing under its real parent, every name drawn exists, and each mark of the legend
("defined in :mod:`...`") names the module the class is defined in.
"""

from __future__ import annotations

import importlib
import pkgutil
import re

import trading_agent
from trading_agent import errors

_LINE = re.compile(r"^(?P<indent>[ │├└─]*?)(?:[├└]── )?(?P<name>_?[A-Z]\w+)(?: (?P<mark>\S))?\s")
_LEGEND = re.compile(r"``(?P<mark>\S)``\s+in\s+:mod:`(?P<module>[\w.]+)`")


def _all_subclasses(root: type) -> list[type]:
    found: list[type] = []
    for sub in root.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


def _drawn_tree() -> tuple[dict[str, str | None], dict[str, str]]:
    """The parent of each name drawn, and each drawn name's legend mark."""
    doc = errors.__doc__ or ""
    drawing = doc.split("::", 1)[1].split("\n\n")[1]
    parents: dict[str, str | None] = {}
    marks: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in drawing.splitlines():
        body = line[4:]  # the drawing is indented by four
        match = _LINE.match(body + " ")
        assert match, f"cannot read the error tree's line {line!r}"
        name = match["name"]
        depth = len(body) - len(body.lstrip(" │├└─"))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[name] = stack[-1][1] if stack else None
        if match["mark"]:
            marks[name] = match["mark"]
        stack.append((depth, name))
    return parents, marks


def test_every_error_of_the_package_is_drawn_under_its_parent_and_where_it_lives() -> None:
    for module in pkgutil.walk_packages(trading_agent.__path__, "trading_agent."):
        importlib.import_module(module.name)
    parents, marks = _drawn_tree()
    legend = {m["mark"]: m["module"] for m in _LEGEND.finditer(errors.__doc__ or "")}

    real = [cls for cls in _all_subclasses(errors.TradingAgentError)
            if cls.__module__.startswith("trading_agent.")]
    undrawn = sorted(cls.__name__ for cls in real if cls.__name__ not in parents)
    assert undrawn == [], f"errors.py's tree leaves out {undrawn}"
    by_name = {cls.__name__: cls for cls in real} | {"TradingAgentError": errors.TradingAgentError}
    assert sorted(set(parents) - set(by_name)) == [], "the tree draws errors that do not exist"
    for name, parent in parents.items():
        cls = by_name[name]
        if parent is None:
            assert cls is errors.TradingAgentError
            continue
        assert by_name[parent] in cls.__bases__, f"{name} is drawn under {parent}"
        if cls.__module__ == "trading_agent.errors":
            assert name not in marks, f"{name} is defined in errors.py, yet marked"
        else:
            assert legend.get(marks.get(name, "")) == cls.__module__, (
                f"{name} lives in {cls.__module__}; its mark must say so")
