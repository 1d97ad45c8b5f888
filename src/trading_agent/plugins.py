"""Objects a config names by an import path or an entry point.

A name is either ``package.module:attribute`` (an import path with the attribute after the
colon, dots allowed for a nested one) or the name of an entry point in a given group (an
installed package's ``[project.entry-points."<group>"]``). :func:`find_factory` resolves it
to something callable, or says plainly what was wrong; it imports the named module, nothing
more, and calls nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

__all__ = ["HOOK_GROUP", "find_factory"]

HOOK_GROUP = "trading_agent.hooks"
"""The entry point group a desk's hook is looked up in by its bare name."""


def find_factory(name: str, group: str) -> Callable[..., object]:
    """The callable ``name`` stands for.

    Args:
        name: ``package.module:attribute``, or an entry point's name in ``group``.
        group: The entry point group a bare name is looked up in.

    Returns:
        The callable (a class or a function).

    Raises:
        ValueError: The module cannot be imported, has no such attribute, the attribute is
            not callable, or no entry point has that name; the message says which.
    """
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        if not module_name or not attribute:
            raise ValueError("an import path is written package.module:factory")
        try:
            found: object = importlib.import_module(module_name)
        except Exception as exc:  # a user's module: any error of theirs is a config error
            raise ValueError(f"module {module_name!r} cannot be imported "
                             f"({type(exc).__name__}: {exc})") from None
        for part in attribute.split("."):
            try:
                found = getattr(found, part)
            except AttributeError:
                raise ValueError(f"module {module_name!r} has no {attribute!r}") from None
    else:
        matching = entry_points(group=group, name=name)
        if not matching:
            raise ValueError(f"no entry point {name!r} in group {group!r}, and it is not an "
                             "import path (package.module:factory)")
        try:
            found = next(iter(matching)).load()
        except Exception as exc:  # an installed package's code: report it, do not crash
            raise ValueError(f"entry point {name!r} of group {group!r} cannot be loaded "
                             f"({type(exc).__name__}: {exc})") from None
    if not callable(found):
        raise ValueError(f"{name!r} is a {type(found).__name__}, not a factory to call")
    return found
