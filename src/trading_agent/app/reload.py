"""``trading-agent reload`` and SIGHUP: the config file read again and applied while the
daemon runs.

The file is read and validated as at start; a config that is not valid changes nothing, and
the operator is told why (the same message ``check-config`` gives). Otherwise, desk by desk:

- a desk whose settings changed (prompt, limits, triggers, model, tools, controls...) is
  built again from them and swapped in once its running turn has finished: the new settings
  apply from its next turn, and the triggers that waited carry over;
- a desk added starts; a desk removed stops at its next safe point;
- the daemon's spend caps apply at once. Other ``[daemon]`` and ``[operator]`` keys (the
  state directory, the API's addresses...) take a restart, and the answer says so.

Every reload, applied or refused, is published as :class:`ConfigReloaded`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import structlog

from trading_agent.agent.event_bus import EventBus
from trading_agent.daemon.events import ConfigReloaded
from trading_agent.daemon.spend import SpendGuard
from trading_agent.daemon.supervisor import DeskRuntime, Supervisor
from trading_agent.errors import ConfigError
from trading_agent.settings import DeskSettings, Settings, load_settings, missing_secrets

__all__ = ["ConfigReloader", "DeskBuilder"]

_log = structlog.get_logger(__name__)

DeskBuilder = Callable[[str, DeskSettings, Settings], Awaitable[DeskRuntime]]
"""Builds a desk from its settings (as the daemon does at start), not yet running."""


class ConfigReloader:
    """Reads the config file again and applies what changed.

    Args:
        path: The config file the daemon started from.
        settings: The settings it runs with now.
        supervisor: The desks.
        build: Builds a desk from new settings.
        spend: The daily spend caps.
        bus: Where the outcome is published.
        environ: Where the daemon reads its secrets (``os.environ`` by default): a new
            config naming a secret that is not there is refused.
    """

    def __init__(self, path: Path, settings: Settings, supervisor: Supervisor,
                 build: DeskBuilder, spend: SpendGuard, bus: EventBus,
                 environ: Mapping[str, str] | None = None) -> None:
        self.path = path
        self._environ = environ
        self.settings = settings
        self._supervisor = supervisor
        self._build = build
        self._spend = spend
        self._bus = bus

    async def __call__(self, by: str) -> list[str]:
        """Reloads, on behalf of ``by``.

        Returns:
            What changed, one line each (empty when nothing did).

        Raises:
            ConfigError: The file is not a valid config; nothing changed.
        """
        try:
            new = await anyio.to_thread.run_sync(load_settings, self.path)
            missing = missing_secrets(new, self.path, self._environ)
            if missing:
                raise ConfigError("\n".join(missing))
        except ConfigError as exc:
            message = str(exc)
            _log.warning("config_reload_refused", by=by, error=message)
            self._bus.publish(ConfigReloaded(desk="*", ok=False, changes=(message,)))
            raise ConfigError(message) from None
        old = self.settings
        changes = self._restart_only(old, new)
        self.settings = new
        self._spend.configure({name: desk.controls for name, desk in new.desks.items()},
                              new.daemon.spend)
        for name in old.desks:
            if name not in new.desks:
                await self._supervisor.remove_desk(name)
                changes.append(f"desk {name} removed: stopped at a safe point")
        for name, desk in new.desks.items():
            if name not in old.desks:
                changes.append(await self._add(name, desk, new))
            elif _dump(old.desks[name]) != _dump(desk):
                changes.append(await self._replace(name, old, new))
        if old.daemon.spend != new.daemon.spend:
            changes.append("daemon.spend changed; applies now")
        _log.info("config_reloaded", by=by, changes=changes)
        self._bus.publish(ConfigReloaded(desk="*", ok=True, changes=tuple(changes)))
        return changes

    async def _add(self, name: str, desk: DeskSettings, new: Settings) -> str:
        try:
            runtime = await self._build(name, desk, new)
        except Exception as exc:
            _log.error("desk_build_failed", desk=name, error=str(exc), exc_info=exc)
            return f"desk {name} NOT added ({type(exc).__name__}: {exc})"
        await self._supervisor.add_desk(runtime)
        return f"desk {name} added and started"

    async def _replace(self, name: str, old: Settings, new: Settings) -> str:
        """Swaps a desk for one built from its new settings once its running turn is done
        (built after, so the two never trade on the same books at once); if the new one
        cannot be built, the desk comes back as it was."""
        keys = _changed_keys(old.desks[name], new.desks[name])
        waiting = await self._supervisor.remove_desk(name, finish_turn=True)
        try:
            runtime = await self._build(name, new.desks[name], new)
        except Exception as exc:
            _log.error("desk_rebuild_failed", desk=name, error=str(exc), exc_info=exc)
            await self._supervisor.add_desk(await self._build(name, old.desks[name], old),
                                            waiting)
            return (f"desk {name}: {', '.join(keys)} NOT applied ({type(exc).__name__}: "
                    f"{exc}); it runs on with its previous settings")
        await self._supervisor.add_desk(runtime, waiting)
        return f"desk {name}: {', '.join(keys)} changed; applies from its next turn"

    @staticmethod
    def _restart_only(old: Settings, new: Settings) -> list[str]:
        """The changes a reload cannot apply: they wait for a restart."""
        found = []
        old_daemon = old.daemon.model_dump(exclude={"spend"})
        new_daemon = new.daemon.model_dump(exclude={"spend"})
        for key in sorted(k for k in old_daemon if old_daemon[k] != new_daemon[k]):
            found.append(f"daemon.{key} changed; applies after a restart")
        for key in ("operator", "telemetry", "webhooks"):
            if getattr(old, key) != getattr(new, key):
                found.append(f"{key} changed; applies after a restart")
        return found


def _dump(desk: DeskSettings) -> dict[str, Any]:
    return desk.model_dump(mode="json")


def _changed_keys(old: DeskSettings, new: DeskSettings) -> list[str]:
    before, after = _dump(old), _dump(new)
    return sorted(key for key in after if before.get(key) != after[key])
