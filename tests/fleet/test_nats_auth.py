"""A NATS server that asks who connects: a daemon joins its fleet with the user of
``fleet.nats_url`` and the password from the variable ``fleet.nats_password_env`` names, or
with the token from ``fleet.nats_token_env``; a wrong one is refused with an error that names
the server and never the secret.

Real parts: ``nats-server`` started by the test on a free loopback port, with JetStream and
its authorization on; the leases on a PostgreSQL database of the test's own; the config read
from a file as ``run`` reads it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.postgres import fresh_database
from trading_agent.errors import ConfigError
from trading_agent.fleet.node import open_node
from trading_agent.settings import load_settings

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
PASSWORD = "p@ss:w/rd 1"  # characters a URL could not carry as they are
TOKEN = "t0ken-s3cret"
STORE_URL = "postgresql://root@127.0.0.1:5432/unused"
"""The file's store URL: a fleet needs one; the test's own database is given instead."""


@contextmanager
def _nats_server(*authorization: str) -> Iterator[int]:
    """A NATS server of the test's own with JetStream; yields its port."""
    if not os.access(NATS_SERVER, os.X_OK):
        pytest.skip(f"nats-server is not installed ({NATS_SERVER})")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as store_dir:
        process = subprocess.Popen(
            [NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store_dir,
             *authorization], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"nats-server did not start: "
                                             f"{process.stderr.read() if process.stderr else ''!r}"
                                             ) from None
                    time.sleep(0.05)
            yield port
        finally:
            process.terminate()
            process.wait(10)
            if process.stderr is not None:
                process.stderr.close()


def _config(tmp_path: Path, store_url: str, fleet_table: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(textwrap.dedent(f"""
        [store]
        url = "{store_url}"

        [fleet]
        {fleet_table}

        [model]
        provider = "openai"
        base_url = "http://127.0.0.1:9/v1"
        model = "small"
        context_window = 32000

        [desks.alpha]
        system_prompt = "You trade."
        symbols = ["BTC/USDT"]
        """), encoding="utf-8")
    return path


async def _join(path: Path, environ: dict[str, str]) -> bool:
    """Joins the fleet as ``run`` does (the leases on a database of the test's own, not the
    file's store URL); whether NATS took the daemon in."""
    settings = load_settings(path)
    with fresh_database() as target:
        async with open_node(settings, target, environ) as node:
            return node.bus.is_connected


async def test_a_daemon_signs_in_with_the_user_and_the_password_from_its_variable(
        tmp_path: Path) -> None:
    with _nats_server("--user", "trading", "--pass", PASSWORD) as port:
        path = _config(tmp_path, STORE_URL, f"""
            nats_url = "nats://trading@127.0.0.1:{port}"
            nats_password_env = "TEST_NATS_PASSWORD"
            nats_prefix = "auth"
            """)
        assert await _join(path, {"TEST_NATS_PASSWORD": PASSWORD})

        with pytest.raises(ConfigError) as refused:
            await _join(path, {"TEST_NATS_PASSWORD": "not the password"})
        message = str(refused.value)
        assert message.startswith(f"fleet: cannot reach NATS at nats://127.0.0.1:{port}: ")
        assert "authorization" in message.lower()
        assert "not the password" not in message and PASSWORD not in message


async def test_a_daemon_signs_in_with_the_token_from_its_variable(tmp_path: Path) -> None:
    with _nats_server("--auth", TOKEN) as port:
        path = _config(tmp_path, STORE_URL, f"""
            nats_url = "nats://127.0.0.1:{port}"
            nats_token_env = "TEST_NATS_TOKEN"
            nats_prefix = "auth"
            """)
        assert await _join(path, {"TEST_NATS_TOKEN": TOKEN})

        with pytest.raises(ConfigError) as refused:
            await _join(path, {"TEST_NATS_TOKEN": "wrong-token"})
        assert "authorization" in str(refused.value).lower()
        assert "wrong-token" not in str(refused.value)
