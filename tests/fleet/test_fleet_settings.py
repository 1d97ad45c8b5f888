"""The config of a fleet, ``[store]`` and ``[fleet]``, as ``check-config`` and ``run`` load it:
what a fleet's file gives, and what each mistake is told as (file, key, what is allowed)."""

from __future__ import annotations

import os
import socket
import textwrap
from pathlib import Path

import pytest

from trading_agent import cli
from trading_agent.errors import ConfigError
from trading_agent.fleet.config import NatsSignIn
from trading_agent.settings import load_settings, missing_secrets

ONE_DAEMON = """
[model]
provider = "openai"
base_url = "http://127.0.0.1:8080/v1"
model = "small"
api_key_env = "TEST_MODEL_KEY"
context_window = 32000

[desks.alpha]
system_prompt = "You trade."
symbols = ["BTC/USDT"]
"""

FLEET = """
[store]
url = "postgresql://trading@db.internal:5432/trading"
password_env = "TEST_DB_PASSWORD"

[fleet]
nats_url = "nats://nats.internal:4222"
daemon_id = "host-a"
lease_seconds = 20
key_env = "TEST_FLEET_KEY"
trusted_network = true
""" + ONE_DAEMON

FLEET_KEY = "k" * 32
"""A fleet key just long enough."""


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TRADING_AGENT_* variable of the machine leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("TRADING_AGENT_") or name in (
                "STATE_DIRECTORY", "CACHE_DIRECTORY", "TEST_DB_PASSWORD", "TEST_MODEL_KEY",
                "TEST_NATS_PASSWORD", "TEST_FLEET_KEY"):
            monkeypatch.delenv(name)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _one_error(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    errors = str(caught.value).splitlines()
    assert len(errors) == 1, errors
    return errors[0]


# --- what a valid file gives -----------------------------------------------------------------


def test_a_fleets_file_loads_and_makes_the_daemon_one_of_a_fleet(tmp_path: Path) -> None:
    settings = load_settings(_write(tmp_path, FLEET))
    assert settings.in_fleet
    assert settings.store.url == "postgresql://trading@db.internal:5432/trading"
    assert settings.store.password_env == "TEST_DB_PASSWORD"
    assert settings.fleet.nats_url == "nats://nats.internal:4222"
    assert settings.fleet.resolved_daemon_id() == "host-a"
    assert settings.fleet.lease_seconds == 20


def test_without_a_store_url_the_daemon_is_alone_on_sqlite(tmp_path: Path) -> None:
    settings = load_settings(_write(tmp_path, ONE_DAEMON))
    assert not settings.in_fleet
    assert (settings.store.url, settings.fleet.nats_url) == (None, None)
    assert settings.fleet.lease_seconds == 15


def test_the_default_daemon_id_is_the_host_name_and_the_process_id(tmp_path: Path) -> None:
    settings = load_settings(_write(tmp_path, FLEET.replace('daemon_id = "host-a"\n', "")))
    assert settings.fleet.daemon_id is None
    host = socket.gethostname().split(".")[0]
    assert settings.fleet.resolved_daemon_id() == f"{host}-{os.getpid()}"


def test_the_environment_names_the_daemon_over_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every daemon reads the same file; each unit gives its own id.
    path = _write(tmp_path, FLEET)
    monkeypatch.setenv("TRADING_AGENT_FLEET__DAEMON_ID", "host-b")
    assert load_settings(path).fleet.resolved_daemon_id() == "host-b"
    monkeypatch.setenv("TRADING_AGENT_FLEET__DAEMON_ID", "host b")
    error = _one_error(path)
    assert error.startswith("environment variable TRADING_AGENT_FLEET__DAEMON_ID: "
                            "fleet.daemon_id: must be 1 to 64 letters, digits"), error


# --- the database password, a secret ---------------------------------------------------------


def test_the_password_variable_is_a_secret_required_with_a_store_url(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, FLEET)
    settings = load_settings(path)
    assert settings.secret_env_vars()["TEST_DB_PASSWORD"] == "store.password_env"
    lines = missing_secrets(settings, path, environ={"TEST_MODEL_KEY": "sk-1",
                                                    "TEST_FLEET_KEY": FLEET_KEY})
    assert lines == [
        f"{path}: store.password_env: the environment variable TEST_DB_PASSWORD is not set or "
        "empty (got 'TEST_DB_PASSWORD'; allowed: the name of a variable set in the daemon's "
        "environment, such as in /etc/trading-agent/env)"]
    monkeypatch.setenv("TEST_MODEL_KEY", "sk-1")
    monkeypatch.setenv("TEST_FLEET_KEY", FLEET_KEY)
    with pytest.raises(ConfigError, match=r"store\.password_env: the environment "
                                          r"variable TEST_DB_PASSWORD is not set"):
        load_settings(path, check_environment=True)
    monkeypatch.setenv("TEST_DB_PASSWORD", "hunter2")
    load_settings(path, check_environment=True)


def test_the_nats_password_is_a_secret_read_from_its_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, FLEET.replace(
        '"nats://nats.internal:4222"',
        '"nats://trading@nats-a.internal:4222,nats://trading@nats-b.internal:4222"\n'
        'nats_password_env = "TEST_NATS_PASSWORD"'))
    settings = load_settings(path)
    assert settings.secret_env_vars()["TEST_NATS_PASSWORD"] == "fleet.nats_password_env"
    lines = missing_secrets(settings, path, environ={"TEST_MODEL_KEY": "sk-1",
                                                    "TEST_DB_PASSWORD": "pw",
                                                    "TEST_FLEET_KEY": FLEET_KEY})
    assert lines == [
        f"{path}: fleet.nats_password_env: the environment variable TEST_NATS_PASSWORD is not "
        "set or empty (got 'TEST_NATS_PASSWORD'; allowed: the name of a variable set in the "
        "daemon's environment, such as in /etc/trading-agent/env)"]
    # The servers go without the user; the user and the password are given beside them.
    assert settings.fleet.nats_sign_in({"TEST_NATS_PASSWORD": "p@ss:w/rd"}) == NatsSignIn(
        "nats://nats-a.internal:4222,nats://nats-b.internal:4222", user="trading",
        password="p@ss:w/rd")


def test_a_password_variable_without_a_store_url_is_not_required(tmp_path: Path) -> None:
    path = _write(tmp_path, '[store]\npassword_env = "TEST_DB_PASSWORD"\n' + ONE_DAEMON)
    settings = load_settings(path)
    assert settings.secret_env_vars()["TEST_DB_PASSWORD"] == "store.password_env"
    assert missing_secrets(settings, path, environ={"TEST_MODEL_KEY": "sk-1"}) == []


def test_check_config_warns_of_the_missing_password(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, FLEET)
    assert cli.main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: 1 desk (alpha)")
    assert (f"warning: {path}: store.password_env: the environment variable TEST_DB_PASSWORD "
            "is not set") in out


# --- what each mistake is told as ------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('[fleet]\nnats_url = "nats://nats.internal:4222"\n', "[fleet]\n",
         "(top level): store.url puts the state on PostgreSQL, which makes this daemon one of "
         "a fleet: set fleet.nats_url (nats://HOST:PORT) too, or leave store.url out for the "
         "embedded SQLite file"),
        ('url = "postgresql://trading@db.internal:5432/trading"\n', "",
         "(top level): fleet.nats_url needs the desks' state shared: set store.url "
         "(postgresql://USER@HOST:PORT/DB), or leave [fleet] out for one daemon"),
        ("postgresql://trading@db.internal", "postgresql://trading:hunter2@db.internal",
         "store.url: must not hold a password: put it in an environment variable and name "
         "that variable in store.password_env"),
        ("postgresql://trading@db.internal:5432/trading", "mysql://trading@db.internal/trading",
         "store.url: must be a PostgreSQL URL, postgresql://USER@HOST:PORT/DB (leave it out "
         "for the embedded SQLite file) (got 'mysql://trading@db.internal/trading')"),
        ("postgresql://trading@db.internal:5432/trading", "sqlite:///var/lib/state.db",
         "store.url: must be a PostgreSQL URL, postgresql://USER@HOST:PORT/DB"),
        ("postgresql://trading@db.internal:5432/trading", "postgresql://trading@db.internal",
         "store.url: needs a host and a database: postgresql://USER@HOST:PORT/DB (got "
         "'postgresql://trading@db.internal')"),
        ('password_env = "TEST_DB_PASSWORD"', 'password_env = ""',
         "store.password_env: String should have at least 1 character (got ''; allowed: a "
         "string, or leave the key out)"),
        ("nats://nats.internal:4222", "http://nats.internal:4222",
         "fleet.nats_url: must be a NATS URL, nats://HOST:PORT (got 'http://nats.internal:4222')"),
        ("nats://nats.internal:4222", "nats.internal:4222",
         "fleet.nats_url: must be a NATS URL, nats://HOST:PORT"),
        ('daemon_id = "host-a"', 'daemon_id = "host a/1"',
         "fleet.daemon_id: must be 1 to 64 letters, digits, '.', '_', ':' or '-', starting "
         "with a letter or digit (got 'host a/1')"),
        ('daemon_id = "host-a"', f'daemon_id = "{"h" * 65}"',
         "fleet.daemon_id: must be 1 to 64 letters"),
        ("lease_seconds = 20", "lease_seconds = 0.5",
         "fleet.lease_seconds: Input should be greater than or equal to 1 (got 0.5; allowed: "
         "a number >= 1, <= 600)"),
        ("lease_seconds = 20", "lease_second = 20",
         "fleet.lease_second: unknown key (got 20; did you mean lease_seconds?"),
        ("nats://nats.internal:4222", "nats://ops:hunter2@nats.internal:4222",
         "fleet.nats_url: must not hold a password: put it in an environment variable and "
         "name that variable in fleet.nats_password_env (got 'nats://ops:<hidden>@"),
        ("nats://nats.internal:4222", "nats://ops@nats.internal:4222",
         "fleet: fleet.nats_url names a user but fleet.nats_password_env is not set (a name "
         "alone would be sent as a token: put a token in an environment variable named by "
         "fleet.nats_token_env)"),
        ("lease_seconds = 20", 'lease_seconds = 20\nnats_password_env = "TEST_NATS_PASSWORD"',
         "fleet: fleet.nats_password_env needs the user in fleet.nats_url: "
         "nats://USER@HOST:PORT"),
        ("lease_seconds = 20", 'lease_seconds = 20\nnats_password_env = "A"\n'
                               'nats_token_env = "B"',
         "fleet: give fleet.nats_password_env (a user's password) or fleet.nats_token_env "
         "(a token), not both"),
        ('key_env = "TEST_FLEET_KEY"\n', "",
         "(top level): fleet.key_env is required in a fleet: name the environment variable "
         "that holds the fleet's shared key (at least 32 bytes"),
        ("trusted_network = true", "trusted_network = false",
         "(top level): fleet.nats_url signs in to NATS with nothing, so whoever reaches the "
         "server may use it: set fleet.nats_password_env (with the user in the URL), "
         "fleet.nats_token_env, fleet.nats_creds_file or a client certificate "
         "(fleet.nats_cert_file), or say fleet.trusted_network = true"),
        ("trusted_network = true", 'nats_cert_file = "client.pem"',
         "fleet: fleet.nats_cert_file and fleet.nats_key_file go together"),
        ("trusted_network = true", 'nats_ca_file = "ca.pem"\ntrusted_network = true',
         "fleet: fleet.nats_ca_file and fleet.nats_cert_file need tls:// URLs in "
         "fleet.nats_url"),
    ],
    ids=["store-without-nats", "nats-without-store", "password-in-url", "mysql", "sqlite",
         "no-database", "empty-password-env", "http-nats", "nats-without-scheme",
         "daemon-id-space", "daemon-id-too-long", "lease-too-short", "unknown-key",
         "password-in-nats-url", "nats-user-without-password", "nats-password-without-user",
         "nats-password-and-token", "no-fleet-key", "no-sign-in-untrusted",
         "cert-without-key", "ca-without-tls"],
)
def test_each_fleet_mistake_is_reported_at_its_place(tmp_path: Path, old: str, new: str,
                                                     expected: str) -> None:
    assert old in FLEET
    path = _write(tmp_path, FLEET.replace(old, new))
    assert _one_error(path).startswith(f"{path}: {expected}")


def test_a_password_in_the_store_url_is_refused_without_being_repeated(
        tmp_path: Path) -> None:
    path = _write(tmp_path, FLEET.replace("postgresql://trading@db.internal",
                                          "postgresql://trading:hunter2@db.internal"))
    error = _one_error(path)
    assert error.startswith(f"{path}: store.url: must not hold a password")
    assert "hunter2" not in error


def test_a_fleet_without_a_store_is_refused_by_check_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, '[fleet]\nnats_url = "nats://nats.internal:4222"\n' + ONE_DAEMON)
    assert cli.main(["check-config", str(path)]) == cli.EXIT_CONFIG
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"{path}: (top level): fleet.nats_url needs the desks' state shared" in captured.err



def test_a_fleet_signing_in_with_nothing_is_refused_by_check_config_unless_trusted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, FLEET.replace("trusted_network = true\n", ""))
    assert cli.main(["check-config", str(path)]) == cli.EXIT_CONFIG
    assert f"{path}: (top level): fleet.nats_url signs in to NATS with nothing" \
        in capsys.readouterr().err
    signed = _write(tmp_path, FLEET.replace(
        "trusted_network = true", 'nats_token_env = "TEST_NATS_TOKEN"'))
    assert cli.main(["check-config", str(signed)]) == 0


def test_a_short_fleet_key_stops_run_naming_its_variable_never_its_value(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, FLEET)
    for name, value in (("TEST_MODEL_KEY", "sk-1"), ("TEST_DB_PASSWORD", "pw"),
                        ("TEST_FLEET_KEY", "short-secret")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        load_settings(path, check_environment=True)
    assert str(refused.value) == (
        f"{path}: fleet.key_env: the environment variable TEST_FLEET_KEY holds 12 bytes; "
        "allowed: at least 32 (openssl rand -hex 32 makes one)")
    assert "short-secret" not in str(refused.value)
    monkeypatch.setenv("TEST_FLEET_KEY", FLEET_KEY)
    assert load_settings(path, check_environment=True).fleet.fleet_key(os.environ) \
        == FLEET_KEY.encode()


def test_a_nats_ca_file_that_cannot_be_used_is_refused_by_check_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, FLEET.replace(
        'nats_url = "nats://nats.internal:4222"',
        'nats_url = "tls://nats.internal:4222"\nnats_ca_file = "missing-ca.pem"'))
    assert cli.main(["check-config", str(path)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"{path}: fleet.nats_ca_file: cannot use {tmp_path / 'missing-ca.pem'} (" in err
    assert "allowed: a readable PEM file of CA certificates" in err
    (tmp_path / "missing-ca.pem").write_text("not a certificate", encoding="utf-8")
    assert cli.main(["check-config", str(path)]) == cli.EXIT_CONFIG
    assert "fleet.nats_ca_file: cannot use" in capsys.readouterr().err
