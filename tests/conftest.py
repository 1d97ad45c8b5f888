"""Fixtures shared by every test.

- No network by default: any connection (or name lookup) beyond loopback and Unix sockets
  fails the test.
- ``scripted_server``: a started :class:`~tests.scripted_server.ScriptedServer` on
  ``127.0.0.1``.
- The longest tests run first (``make test`` hands out one test at a time to each of its
  workers, ``--dist load --maxschedchunk 1``), so no long end-to-end test starts last and
  keeps one worker busy while the others have nothing left.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

from tests.scripted_server import ScriptedServer

# Property tests are judged by their properties, not by how fast one example runs: the suite
# runs on a loaded machine (and inside the lowest-versions run), where an example that takes
# 0.1 s when quiet took 0.43 s and failed hypothesis' 0.2 s deadline.
settings.register_profile("loaded_machine", deadline=None)
settings.load_profile("loaded_machine")

_LONGEST_FIRST = (
    # Each worker starts with two tests: the first two go to one, the next two to the other.
    "tests/test_lowest_versions.py",
    "tests/daemon/test_kill_anywhere.py::test_kill_9_at_20_moments",
    "tests/e2e/test_demo_daemon.py",
    "tests/e2e/test_local_backtest.py",
    "tests/e2e/test_local_overflow.py",
    "tests/e2e/test_local_never_wedges.py",
    "tests/daemon/test_kill_anywhere.py",
    "tests/e2e/",
    "tests/fleet/test_fleet_daemons.py",
    "tests/backtest/test_no_lookahead.py",
    "tests/operator/test_books_live.py",
    "tests/operator/test_prompt_cache_share.py",
    "tests/daemon/test_daemon_process.py",
    "tests/operator/test_web_cache_share.py",
)
"""Where the longest tests are (measured with ``--durations``), about longest first."""


def _running_order(item: pytest.Item) -> tuple[int, int]:
    """Known long tests by how long, then the other slow ones, then the rest as collected."""
    for rank, prefix in enumerate(_LONGEST_FIRST):
        if item.nodeid.startswith(prefix) and item.get_closest_marker("slow") is not None:
            return (0, rank)
    return (1, 0) if item.get_closest_marker("slow") is not None else (2, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Runs the long tests first (a stable sort: each group keeps the collection order)."""
    items.sort(key=_running_order)


_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


class NetworkBlockedError(RuntimeError):
    """A test tried to reach beyond loopback.

    Deliberately not an ``OSError``: network code would take that for a network failure and
    retry, hiding the attempt.
    """


def _is_local(host: Any) -> bool:
    if host is None:
        return True  # getaddrinfo(None, port): the local wildcard
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return False
    if host.lower() in _LOOPBACK_NAMES or host == "":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified  # 0.0.0.0 is this machine


class NetworkGuard:
    """Patches ``socket`` so only loopback and Unix sockets can be reached.

    Attributes:
        attempts: What was refused, for the report.
    """

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> NetworkGuard:
        """Patches ``connect``, ``connect_ex`` and ``getaddrinfo`` until the test ends."""
        real_connect = socket.socket.connect
        real_connect_ex = socket.socket.connect_ex
        real_getaddrinfo = socket.getaddrinfo

        def check(sock: socket.socket, address: Any) -> None:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
                self.attempts.append(f"connect to {address!r}")
                raise NetworkBlockedError(f"tests may not reach {address!r}: no network")

        def connect(sock: socket.socket, address: Any) -> None:
            check(sock, address)
            real_connect(sock, address)

        def connect_ex(sock: socket.socket, address: Any) -> int:
            check(sock, address)
            return real_connect_ex(sock, address)

        def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
            if not _is_local(host):
                self.attempts.append(f"look up {host!r}")
                raise NetworkBlockedError(f"tests may not resolve {host!r}: no network")
            return real_getaddrinfo(host, *args, **kwargs)

        monkeypatch.setattr(socket.socket, "connect", connect)
        monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        return self


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Refuses connections and lookups beyond loopback, and fails the test that tried."""
    guard = NetworkGuard().install(monkeypatch)
    yield
    if guard.attempts:
        pytest.fail("the test tried to use the network: " + "; ".join(guard.attempts))


@pytest.fixture
def scripted_server() -> Iterator[ScriptedServer]:
    """A scripted OpenAI-compatible server on ``127.0.0.1``; ``.base_url`` ends in ``/v1``.

    Give it steps with ``scripted_server.add(...)`` (or a ``responder``), run the code under
    test against ``scripted_server.base_url``, then check ``scripted_server.requests`` and
    call ``scripted_server.assert_complete()``. Failures inside the server fail the test.
    """
    with ScriptedServer() as server:
        yield server
        if server.errors:
            pytest.fail(f"the scripted server failed: {server.errors!r}")
