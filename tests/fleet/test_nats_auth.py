"""A NATS server that asks who connects: a daemon joins its fleet with the user of
``fleet.nats_url`` and the password from the variable ``fleet.nats_password_env`` names, or
with the token from ``fleet.nats_token_env``; a wrong one is refused with an error that names
the server and never the secret.

Real parts: ``nats-server`` started by the test on a free loopback port, with JetStream and
its authorization on; the leases on a PostgreSQL database of the test's own; the config read
from a file as ``run`` reads it.
"""

from __future__ import annotations

import ipaddress
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.fleet.own_nats import own_nats_server
from tests.postgres import fresh_database
from trading_agent.errors import ConfigError
from trading_agent.fleet.node import open_node
from trading_agent.settings import load_settings

PASSWORD = "p@ss:w/rd 1"  # characters a URL could not carry as they are
TOKEN = "t0ken-s3cret"
FLEET_KEY = "k" * 32
STORE_URL = "postgresql://root@127.0.0.1:5432/unused"
"""The file's store URL: a fleet needs one; the test's own database is given instead."""


def _config(tmp_path: Path, store_url: str, fleet_table: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(textwrap.dedent(f"""
        [store]
        url = "{store_url}"

        [fleet]
        key_env = "TEST_FLEET_KEY"
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
        assert await _join(path, {variable: secret, "TEST_FLEET_KEY": FLEET_KEY})

        with pytest.raises(ConfigError) as refused:
            await _join(path, {variable: "not the secret", "TEST_FLEET_KEY": FLEET_KEY})
        message = str(refused.value)
        assert message.startswith(f"fleet: cannot reach NATS at nats://127.0.0.1:{port}: ")
        assert "authorization" in message.lower()
        assert "not the secret" not in message and secret not in message


def _certificates(folder: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA of the test's own and a certificate it signed for 127.0.0.1: (CA, cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.now(UTC)

    def certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str,
                    signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - timedelta(minutes=5))
                   .not_valid_after(now + timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), \
        ec.generate_private_key(ec.SECP256R1())
    paths = folder / f"{name}-ca.pem", folder / f"{name}-cert.pem", folder / f"{name}-key.pem"
    paths[0].write_bytes(certificate(f"{name} CA", ca_key, f"{name} CA", ca_key, True)
                         .public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(certificate("127.0.0.1", server_key, f"{name} CA", ca_key, False)
                         .public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return paths


async def test_a_daemon_reaches_nats_over_tls_trusting_the_ca_its_file_names(
        tmp_path: Path) -> None:
    ca, cert, key = _certificates(tmp_path, "fleet")
    stranger_ca, _, _ = _certificates(tmp_path, "stranger")
    with own_nats_server("--tls", "--tlscert", str(cert), "--tlskey", str(key),
                         "--auth", TOKEN) as port:
        def config(ca_file: Path) -> Path:
            return _config(tmp_path, STORE_URL, f'nats_url = "tls://127.0.0.1:{port}"\n'
                           f'nats_ca_file = "{ca_file}"\nnats_token_env = "TEST_NATS_TOKEN"\n'
                           'nats_prefix = "tls"')

        environ = {"TEST_NATS_TOKEN": TOKEN, "TEST_FLEET_KEY": FLEET_KEY}
        assert await _join(config(ca), environ)
        with pytest.raises(ConfigError, match=rf"fleet: cannot reach NATS at tls://127\.0\.0\.1:"
                                              rf"{port}: .*certificate verify failed"):
            await _join(config(stranger_ca), environ)

    # A tls:// URL to a server that speaks plain text (a man in the middle, a server left
    # without TLS): refused before the token is sent, never spoken to in the clear.
    with own_nats_server("--auth", TOKEN) as port:
        with pytest.raises(ConfigError, match=r"does not require TLS although the URL is "
                                              r"tls://") as refused:
            await _join(config(ca), environ)
        assert TOKEN not in str(refused.value)


DAEMON_PERMISSIONS = """
authorization {
  DAEMON = {
    publish   = ["trading_agent.>", "$JS.API.>", "$JS.ACK.trading_agent_inbox.>",
                 "_INBOX.>"]
    subscribe = ["trading_agent.>", "_INBOX.>"]
  }
  users = [
    { user: "host-a", password: "pa", permissions: $DAEMON }
    { user: "host-b", password: "pb", permissions: $DAEMON }
  ]
}
"""
"""The README's per-daemon users (Security), which the fleet's bus must work under."""


async def test_the_readmes_per_daemon_nats_users_let_the_fleets_bus_work(
        tmp_path: Path) -> None:
    from contextlib import aclosing

    import anyio

    from trading_agent.fleet.bus import BusOptions, DeskUnreachable, FleetBus

    config = tmp_path / "nats.conf"
    config.write_text(DAEMON_PERMISSIONS, encoding="utf-8")
    options = BusOptions(request_timeout=2.0, inbox_poll=0.5)
    key = FLEET_KEY.encode()

    async def answer(request: dict[str, object]) -> dict[str, object]:
        return {"result": "served"}

    with own_nats_server("-c", str(config)) as port, anyio.fail_after(20):
        url = f"nats://127.0.0.1:{port}"
        async with FleetBus.connect(url, "a", user="host-a", password="pa", key=key,
                                    options=options) as a, \
                FleetBus.connect(url, "b", user="host-b", password="pb", key=key,
                                 options=options) as b:
            served = await b.serve_control("alpha", answer)
            # What is checked is that these users may serve and ask; on a loaded machine the
            # server may not have b's subscription yet (serve_control's flush waits at most
            # the request timeout), which a daemon answers as "try again": so does the test.
            while True:
                try:
                    reply = await a.request_control("alpha", {"op": "status"})
                    break
                except DeskUnreachable:
                    await anyio.sleep(0.1)
            assert reply == {"result": "served"}
            await served.stop()
            assert await a.send_to_desk("alpha", "m-1", {"n": 1})
            inbox = await b.inbox("alpha")
            message = await anext(inbox)
            await message.ack()
            await inbox.close()
            a.publish_event("alpha", {"id": 1, "desk": "alpha"})
            async with aclosing(b.events(after=0)) as feed:
                event = await anext(feed)
            assert [e.seq for e in await b.events_between(0, 10)] == [event.seq]
            await a.announce_released(["alpha"])
    assert message.payload == {"n": 1}
