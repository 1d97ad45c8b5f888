"""The backtest's files are the operator's alone: folders it creates are 0700, files 0600.

A response cache holds every prompt a desk sent and every answer (strategies, notes, the
operator's messages); a report holds the transcripts. Neither is for other users of the
machine, whatever the umask says.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

__all__ = ["PRIVATE_FILE", "PRIVATE_FOLDER", "append_private", "private_folder",
           "write_private"]

PRIVATE_FOLDER = 0o700
PRIVATE_FILE = 0o600


def private_folder(path: Path) -> Path:
    """Creates ``path`` and its missing parents, each 0700 (folders that exist are left
    as they are).

    Raises:
        OSError: It cannot be created.
    """
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_FOLDER)
        except FileExistsError:
            continue
        os.chmod(folder, PRIVATE_FOLDER)  # the umask may have taken bits away, never added
    return path


def write_private(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path``, created 0600 (or truncated)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def append_private(path: Path) -> BinaryIO:
    """``path`` opened for appending, unbuffered, created 0600 when new."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE)
    return os.fdopen(descriptor, "ab", buffering=0)
