"""Where the store lives: a SQLite file (the embedded default) or a PostgreSQL database.

A :class:`PostgresTarget` is the config's ``[store] url`` and the password read from the
environment; it never shows the password (``str``, ``repr``, error messages), and the URL
may not hold one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from trading_agent.errors import ConfigError

__all__ = ["PostgresTarget", "StoreTarget"]

_SCHEMES = ("postgresql", "postgres")
_HIDDEN = "***"


@dataclass(frozen=True)
class PostgresTarget:
    """A PostgreSQL database to keep the store in.

    Args:
        url: ``postgresql://USER@HOST:PORT/DB`` (libpq's URL form; query parameters such as
            ``sslmode`` allowed), without a password.
        password: The password (from the environment), or None (trust, peer or a
            ``.pgpass`` file).

    Raises:
        ConfigError: The URL is not a PostgreSQL URL, or it holds a password.
    """

    url: str
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            parts = urlsplit(self.url)
            has_password = parts.password is not None
        except ValueError as exc:
            raise ConfigError(f"[store] url is not a PostgreSQL URL: {exc}") from exc
        if parts.scheme not in _SCHEMES:
            raise ConfigError(f"[store] url must start with postgresql://, not "
                              f"{parts.scheme or 'nothing'}://")
        if has_password:
            raise ConfigError("[store] url must not hold a password (it would be shown "
                              "wherever the URL is): give it in the environment variable "
                              "named by [store] password_env")

    def redact(self, text: str) -> str:
        """``text`` with the password (should a driver's message quote it) hidden."""
        return text.replace(self.password, _HIDDEN) if self.password else text

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        password = None if self.password is None else _HIDDEN
        return f"PostgresTarget({self.url!r}, password={password!r})"


StoreTarget = Path | str | PostgresTarget
"""A SQLite file (``:memory:`` for a database of the caller's own) or a PostgreSQL database."""

