"""The locks over TLS: a ``rediss://`` cache (a self-signed certificate, its own CA file) is
what the locks' own clients use too, built from the cache's connection class and arguments."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from django_joblock import LockBackendUnavailable, lock, lock_info
from django_joblock.locks.renewal import renewer
from tests.harness import wait_for
from tests.procs.redis_server import RedisServer, free_port

pytestmark = pytest.mark.slow  # starts processes or servers


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, int, Path]]:
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    server = RedisServer(
        extra_args=[
            *("--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)),
            *("--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"),
        ]
    )
    server.start()  # the plain port answers the harness; the locks use the TLS one
    yield server, port, cert
    server.stop()


def _cache(location: str, **pool: Any) -> dict[str, Any]:
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": location,
        "OPTIONS": {"SOCKET_TIMEOUT": 5, "CONNECTION_POOL_KWARGS": pool},
    }


def test_locks_heartbeat_and_wait_over_tls(settings, tls_server):
    server, port, cert = tls_server
    settings.CACHES = {
        **settings.CACHES,
        "tls": _cache(f"rediss://127.0.0.1:{port}/0", ssl_ca_certs=str(cert)),
        "plain": _cache(f"redis://127.0.0.1:{port}/0"),
    }
    held = lock("tls:1", ttl=1.5, cache="tls")
    assert held.acquire()
    plain = server.client()  # the same server through its plain port: what TLS wrote
    assert plain.hget(held.key, "token").decode() == held.token
    assert wait_for(lambda: int(plain.hget(held.key, "renewals") or 0) >= 2, 5), "renewed"
    info = lock_info("tls:1", cache="tls")
    assert info is not None and info.owner == held.owner
    waiter = lock("tls:1", ttl=5, cache="tls")
    assert not waiter.acquire(wait=0.2), "busy: waits in line over TLS, then gives up"
    assert held.release()
    assert waiter.acquire(wait=1) and waiter.release()
    assert renewer().held_locks() == []
    # Negative control: the port really speaks TLS only.
    with pytest.raises(LockBackendUnavailable):
        lock("tls:2", ttl=5, cache="plain").acquire()


def test_async_locks_over_tls_and_a_unix_socket(settings, tls_server, tmp_path):
    """``alock()``'s asyncio clients are built from the cache's connection class and arguments:
    TLS with its CA file, and a unix socket, as the sync locks' are."""
    import asyncio

    from django_joblock import alock

    server, port, cert = tls_server
    socket_path = tmp_path / "redis.sock"
    unix = RedisServer(extra_args=["--unixsocket", str(socket_path), "--unixsocketperm", "700"])
    unix.start()
    settings.CACHES = {
        **settings.CACHES,
        "tls": _cache(f"rediss://127.0.0.1:{port}/0", ssl_ca_certs=str(cert)),
        "plain": _cache(f"redis://127.0.0.1:{port}/0"),
        "unix": _cache(f"unix://{socket_path}?db=0"),
    }

    async def scenario(cache: str) -> tuple[str, bool]:
        async with alock(f"{cache}:1", ttl=5, cache=cache) as held:
            busy = await alock(f"{cache}:1", cache=cache).aacquire(wait=0.2)
            return held.token, busy

    try:
        for cache, client in (("tls", server.client()), ("unix", unix.client())):
            token, busy = asyncio.run(scenario(cache))
            assert busy is False, "busy: waited in line, then gave up"
            assert client.exists(f"joblock:{{{cache}:1}}:fence"), f"{cache}: written there"
            assert token
        # Negative control: the TLS port refuses plain connections.
        with pytest.raises(LockBackendUnavailable):
            asyncio.run(alock("plain:1", ttl=5, cache="plain").aacquire())
    finally:
        unix.stop()
