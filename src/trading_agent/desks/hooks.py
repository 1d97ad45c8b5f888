"""The hooks a desk's config names (``[desks.<name>] hooks``), made when the desk is built.

Each entry is ``package.module:factory`` or the name of an entry point in the group
``trading_agent.hooks`` (:data:`~trading_agent.plugins.HOOK_GROUP`); its factory is called
with no arguments and returns a hook (see :mod:`trading_agent.agent.hooks`). They run in
the order listed, before the approval gate, which stays the last before a tool call.
"""

from __future__ import annotations

from collections.abc import Sequence

from trading_agent.errors import ConfigError
from trading_agent.plugins import HOOK_GROUP, find_factory

__all__ = ["load_hooks"]


def load_hooks(desk: str, names: Sequence[str]) -> list[object]:
    """Makes desk ``desk``'s hooks, in order.

    Args:
        desk: The desk's name, for the error.
        names: Its ``hooks`` setting.

    Returns:
        One hook per name.

    Raises:
        ConfigError: A name does not resolve to a factory, or its factory failed; the
            message names the desk, the key and what was wrong.
    """
    hooks = []
    for index, name in enumerate(names):
        key = f"desks.{desk}.hooks[{index}] ({name!r})"
        try:
            factory = find_factory(name, HOOK_GROUP)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None
        try:
            hooks.append(factory())
        except Exception as exc:  # the hook's own code: a config error of this desk
            raise ConfigError(f"{key}: its factory failed ({type(exc).__name__}: "
                              f"{exc})") from None
    return hooks
