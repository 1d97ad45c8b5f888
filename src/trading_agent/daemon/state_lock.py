"""One daemon per state directory: an exclusive lock on ``STATE_DIR/daemon.lock``.

Two daemons on the same state directory would run the same desks on the same SQLite file
(twice the turns, twice the orders), even with different socket paths. The daemon holds an
exclusive, non-blocking :func:`fcntl.flock` on ``daemon.lock`` for as long as it runs, with
its pid written in the file so a second one can say who holds it. The kernel releases the
lock when the holder's file is closed, and so when the process dies (even by ``kill -9``):
a stale lock file never blocks a restart.

Example::

    with hold_state_lock(state_dir):
        ...  # run the daemon
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from trading_agent.errors import ConfigError

__all__ = ["LOCK_NAME", "hold_state_lock"]

LOCK_NAME = "daemon.lock"
"""The lock file's name in the state directory."""


@contextlib.contextmanager
def hold_state_lock(state_dir: Path | str) -> Iterator[Path]:
    """Holds the state directory's daemon lock until the block ends (or the process dies).

    The folder is created if missing. The lock file is left in place on exit (emptied):
    removing it would let a second daemon lock a new file while a third still holds the
    old one.

    Args:
        state_dir: The daemon's state directory.

    Yields:
        The lock file's path.

    Raises:
        ConfigError: Another process holds the lock (its pid is named when it wrote one),
            or the lock file cannot be opened.
    """
    folder = Path(state_dir)
    path = folder / LOCK_NAME
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Not O_TRUNC: the holder's pid must still be there to read when the lock is taken.
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot open the daemon lock {path}: {exc.strerror or exc}") from exc
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            who = f" (pid {holder})" if holder else ""
            raise ConfigError(
                f"another trading-agent daemon{who} is already running on state directory "
                f"{folder}; stop it first or use another state_dir") from None
        except OSError as exc:
            raise ConfigError(f"cannot lock {path}: {exc.strerror or exc}") from exc
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(descriptor, 0)
            fcntl.flock(descriptor, fcntl.LOCK_UN)
    finally:
        os.close(descriptor)


def _holder(descriptor: int) -> int | None:
    """The pid the lock's holder wrote, or None when unreadable."""
    try:
        text = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
