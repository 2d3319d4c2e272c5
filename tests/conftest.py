from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests import harness, workers

ROOT = Path(__file__).resolve().parent.parent


# The fast tier (`./scripts/test -m "not slow"`) is the tests without the ``slow`` marker. A test
# that starts a process (a worker, a redis-server, a browser, a wheel build, manage.py) must carry
# it, explicitly: a test that uses one of these fixtures without it is a collection error, and a
# test without it that starts a process fails (the ``_fast_tier`` fixture below).
SLOW_FIXTURES = {"crew", "server", "proxy", "live_server", "built_wheel", "built_wheel_site"}


# Fixtures that give a test the database (pytest-django's, and those built on them).
DATABASE_FIXTURES = {
    "db",
    "transactional_db",
    "django_db_reset_sequences",
    "django_db_serialized_rollback",
    "admin_client",
    "admin_user",
    "django_user_model",
    "live_server",
}


def _uses_the_database(item: pytest.Item) -> bool:
    """Can the test, or a process it starts, touch the test database? Without the database
    (no ``django_db`` mark, fixture or Django test case) pytest-django creates none for it."""
    from django.test import TransactionTestCase

    case = getattr(item, "cls", None)
    return (
        item.get_closest_marker("django_db") is not None
        or bool(set(getattr(item, "fixturenames", ())) & DATABASE_FIXTURES)
        or (case is not None and issubclass(case, TransactionTestCase))
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("JOBLOCK_TEST_DATABASE_ONLY"):
        # .ci/run's second database: only the tests whose outcome the database can change.
        kept = [item for item in items if _uses_the_database(item)]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    unmarked = [
        item.nodeid
        for item in items
        if set(getattr(item, "fixturenames", ())) & SLOW_FIXTURES
        and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "These tests start a process or server (by their fixtures) and need "
            f"@pytest.mark.slow: {', '.join(unmarked)}"
        )


class StartsAProcess(AssertionError):
    """A test of the fast tier started a process: mark it ``@pytest.mark.slow``."""


@pytest.fixture(autouse=True)
def _fast_tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests without the ``slow`` marker may not start a process (the fast tier stays fast)."""
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise StartsAProcess(f"{request.node.nodeid} starts a process: mark it slow")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)


@pytest.fixture(scope="session", autouse=True)
def _worker_logs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Worker processes log under pytest's temporary directory, not into the repository."""
    workers.LOG_ROOT = tmp_path_factory.mktemp("worker-logs")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[harness.RedisServer | None]:
    """The throwaway redis-server (None when the suite runs against an external REDIS_URL)."""
    if harness.managed():
        server = harness.RedisServer(int(os.environ[harness.PORT_ENV]))
        server.start()
        yield server
        server.stop()
        return
    client = redis.Redis.from_url(harness.redis_url())
    size = client.dbsize()
    if size:
        pytest.exit(
            f"Refusing to run: the Redis database at {harness.redis_url()} holds {size} keys and "
            "the tests flush it. Point REDIS_URL at an empty database.",
            returncode=3,
        )
    yield None


@pytest.fixture
def server(redis_server: harness.RedisServer | None) -> harness.RedisServer:
    """The managed server, for tests that kill, restart or reconfigure Redis."""
    if redis_server is None:
        raise RuntimeError("This test injects Redis faults and needs redis-server on PATH.")
    return redis_server


@pytest.fixture(scope="session")
def _proxy(redis_server: harness.RedisServer | None) -> Iterator[harness.Proxy]:
    upstream = int(harness.redis_url().rsplit(":", 1)[1].split("/")[0])
    proxy = harness.Proxy(int(os.environ[harness.PROXY_PORT_ENV]), upstream)
    yield proxy
    proxy.close()


@pytest.fixture
def proxy(_proxy: harness.Proxy) -> Iterator[harness.Proxy]:
    """A TCP proxy in front of the test Redis (cache alias "proxied")."""
    _proxy.set("forward")
    yield _proxy
    _proxy.set("forward")
    _proxy.hold_matching = None


def _reset_connections() -> None:
    from django_redis import get_redis_connection

    for alias in ("default", "proxied"):
        get_redis_connection(alias).connection_pool.disconnect()


@pytest.fixture(autouse=True)
def clean_redis(redis_server: harness.RedisServer | None) -> Iterator[None]:
    """Each test starts on an empty Redis, with no lock left over from the previous one."""
    from django_joblock import metrics
    from django_joblock.locks.renewal import renewer

    metrics.take_for_flush(force=True)  # nothing buffered by an earlier test leaks into this one
    client = redis.Redis.from_url(harness.redis_url())
    client.flushdb()
    yield
    for held in renewer().held_locks():
        renewer().remove(held)
    if redis_server is not None and not redis_server.running:
        redis_server.start()  # a test that killed Redis must not break the next one
    client = redis.Redis.from_url(harness.redis_url())
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory-policy", "noeviction")
    client.flushdb()
    _reset_connections()


@pytest.fixture
def rconn() -> Any:
    """The django-redis connection the locks use."""
    from django_redis import get_redis_connection

    return get_redis_connection("default")


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once per run the way a user builds it (``pip wheel``)."""
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("django_joblock-*.whl")
    return wheel


@pytest.fixture(scope="session")
def built_wheel_site(built_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel unpacked as pip would install it: put it first on PYTHONPATH."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(built_wheel) as archive:
        archive.extractall(site)
    return site


@pytest.fixture
def crew(settings: Any) -> Iterator[workers.Workers]:
    """Worker processes on the test's ``JOBLOCK`` with a short requeue backoff (0.5 s doubling
    to 2 s), all stopped after the test."""
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 0.5, "factor": 2, "max": 2}}
    started = workers.Workers(settings.JOBLOCK)
    yield started
    started.stop()


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """Jobs a test decorates leave the ``@locked_job`` registry when it ends (the registered
    test jobs stay)."""
    from django_joblock.jobs.decorator import registry

    before = dict(registry)
    yield
    registry.clear()
    registry.update(before)
