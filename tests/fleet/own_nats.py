"""A NATS server of a test's own, for what the machine's server cannot show: JetStream off,
or authorization on."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


@contextmanager
def own_nats_server(*arguments: str, jetstream: bool = True) -> Iterator[int]:
    """``nats-server`` on a free loopback port, with ``arguments`` (``--user``, ``--auth``);
    yields its port once it listens, and stops it. Skips the test where it is not installed.
    """
    if not os.access(NATS_SERVER, os.X_OK):
        pytest.skip(f"nats-server is not installed ({NATS_SERVER})")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as store_dir:
        stored = ["-js", "-sd", store_dir] if jetstream else []
        process = subprocess.Popen(
            [NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), *stored, *arguments],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        told = process.stderr.read() if process.stderr else b""
                        raise AssertionError(f"nats-server did not start: {told!r}") from None
                    time.sleep(0.02)
            yield port
        finally:
            process.terminate()
            process.wait(10)
            if process.stderr is not None:
                process.stderr.close()
