"""Fixtures of the operator tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory with a short path: a Unix socket path holds at most 107 bytes, and
    pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="ta-op-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
