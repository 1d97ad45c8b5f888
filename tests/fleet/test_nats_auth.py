"""A NATS server that asks who connects: a daemon joins its fleet with the user of
``fleet.nats_url`` and the password from the variable ``fleet.nats_password_env`` names, or
with the token from ``fleet.nats_token_env``; a wrong one is refused with an error that names
the server and never the secret.

Real parts: ``nats-server`` started by the test on a free loopback port, with JetStream and
its authorization on; the leases on a PostgreSQL database of the test's own; the config read
from a file as ``run`` reads it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.fleet.own_nats import own_nats_server
from tests.postgres import fresh_database
from trading_agent.errors import ConfigError
from trading_agent.fleet.node import open_node
from trading_agent.settings import load_settings

PASSWORD = "p@ss:w/rd 1"  # characters a URL could not carry as they are
TOKEN = "t0ken-s3cret"
STORE_URL = "postgresql://root@127.0.0.1:5432/unused"
"""The file's store URL: a fleet needs one; the test's own database is given instead."""


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


@pytest.mark.parametrize(("server", "fleet_table", "variable", "secret"), [
    (("--user", "trading", "--pass", PASSWORD), 'nats_url = "nats://trading@127.0.0.1:{port}"\n'
     'nats_password_env = "TEST_NATS_PASSWORD"', "TEST_NATS_PASSWORD", PASSWORD),
    (("--auth", TOKEN), 'nats_url = "nats://127.0.0.1:{port}"\n'
     'nats_token_env = "TEST_NATS_TOKEN"', "TEST_NATS_TOKEN", TOKEN),
], ids=["user-and-password", "token"])
async def test_a_daemon_signs_in_with_the_secret_from_its_variable(
        tmp_path: Path, server: tuple[str, ...], fleet_table: str, variable: str,
        secret: str) -> None:
    with own_nats_server(*server) as port:
        path = _config(tmp_path, STORE_URL,
                       fleet_table.format(port=port) + '\nnats_prefix = "auth"')
        assert await _join(path, {variable: secret})

        with pytest.raises(ConfigError) as refused:
            await _join(path, {variable: "not the secret"})
        message = str(refused.value)
        assert message.startswith(f"fleet: cannot reach NATS at nats://127.0.0.1:{port}: ")
        assert "authorization" in message.lower()
        assert "not the secret" not in message and secret not in message
