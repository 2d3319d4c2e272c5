"""Locks through Redis Sentinel (issue 16): a real primary, a replica and three sentinels.

django-redis' ``SentinelClient`` carries the locks. A failover (the primary SIGKILLed, the
replica promoted by the sentinels) is followed by the lock manager, the lean command path and
the renewal thread without a restart. A failover that forgets a lock (replication held back by
a black-holed proxy between primary and replica) makes the heartbeat declare it LOST, and the
fence refuses the stale holder's late write; the same write without the fence gets through
(the negative control). ``REPLICA_ACKS`` makes an acquire wait for the replica and refuse a
lock only the primary has.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from django_joblock import LockBackendUnavailable, StaleFence, fenced_update, lock
from django_joblock.testing.redis_server import free_port
from django_joblock.testing.topologies import SentinelGroup
from tests.harness import Proxy, wait_for
from tests.testapp.models import Account

pytestmark = pytest.mark.django_db(transaction=True)
_NAMES = itertools.count()


def sentinel_cache(group: SentinelGroup) -> dict[str, Any]:
    """The django-redis cache of docs/topologies.md for ``group``."""
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://{group.master_name}/0",
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.SentinelClient",
            "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
            "SENTINELS": group.addresses,
            "SOCKET_CONNECT_TIMEOUT": 1,
            "SOCKET_TIMEOUT": 2,
        },
    }


class Setup:
    def __init__(self, group: SentinelGroup, link: Proxy) -> None:
        self.group, self.link = group, link

    def primary(self) -> redis.Redis:
        return self.group.server(self.group.primary_port()).client()


@pytest.fixture
def sentinel(settings: Any) -> Iterator[Setup]:
    """A fresh Sentinel setup, replicating through a proxy the test can black-hole, as the
    locks' Redis (cache alias ``sentinel``)."""
    links: list[Proxy] = []

    def via(primary_port: int) -> int:
        links.append(Proxy(free_port(), primary_port))
        return links[0].listen_port

    # A service name of its own: django-redis keeps a pool per LOCATION for the process's
    # life, and one of an earlier test would ask that test's (stopped) sentinels.
    group = SentinelGroup(replicate_via=via, master_name=f"joblock{next(_NAMES)}")
    group.start()
    settings.CACHES = {**settings.CACHES, "sentinel": sentinel_cache(group)}
    settings.JOBLOCK = {**getattr(settings, "JOBLOCK", {}), "REDIS_ALIAS": "sentinel"}
    yield Setup(group, links[0])
    group.stop()
    links[0].close()


def renewals(client: redis.Redis, resource: str) -> int:
    return int(client.hget(f"joblock:{{{resource}}}:lock", "renewals") or 0)


def test_locks_and_their_heartbeat_follow_a_failover(sentinel):
    held = lock("order:1", ttl=6)
    assert held.acquire()
    sentinel.group.wait_replicated()
    old = sentinel.group.primary_port()
    new = sentinel.group.fail_over()
    assert new != old
    # The renewal thread renews on the new primary: no restart, no lost lock.
    wait_for(lambda: renewals(sentinel.primary(), "order:1") > 0, timeout=15)
    assert not held.lost
    assert held.renew()
    other = lock("order:2", ttl=5)
    assert other.acquire() and other.fence > held.fence  # type: ignore[operator]
    other.release()
    held.release()
    assert not sentinel.primary().exists("joblock:{order:1}:lock")


def test_a_lock_the_failover_forgot_is_lost_and_its_late_write_refused(sentinel):
    Account.objects.create(name="acct")
    rows = Account.objects.filter(name="acct")
    sentinel.link.set("blackhole")  # the replica hears nothing from now on
    stale = lock("acct:1", ttl=6)
    assert stale.acquire()
    assert not sentinel.group.replicas[0].client().exists("joblock:{acct:1}:lock")
    sentinel.group.fail_over()
    # Negative control: the new primary really forgot the lock.
    assert not sentinel.primary().exists("joblock:{acct:1}:lock")
    fresh = lock("acct:1", ttl=6)
    assert fresh.acquire(), "the failover forgot the lock: a second holder gets in"
    assert fresh.fence > stale.fence  # type: ignore[operator]
    fenced_update(rows, fresh.fence, balance=10)
    # The heartbeat sees the key gone (or no longer its token) and declares the lock lost...
    wait_for(lambda: stale.lost, timeout=15)
    # ... and the database refuses the stale holder's late write.
    with pytest.raises(StaleFence):
        fenced_update(rows, stale.fence, balance=666)
    assert rows.get().balance == 10
    # Without the fence the same late write gets through: the damage the fence prevents.
    rows.update(balance=666)
    assert rows.get().balance == 666
    fresh.release()


def test_replica_acks_wait_for_the_replica(sentinel, settings):
    settings.JOBLOCK = {**settings.JOBLOCK, "REPLICA_ACKS": 1, "REPLICA_ACK_TIMEOUT": 0.3}
    held = lock("order:9", ttl=5)
    assert held.acquire()
    # The acquire returned after the replica had the lock.
    assert sentinel.group.replicas[0].client().exists("joblock:{order:9}:lock")
    held.release()
    sentinel.link.set("blackhole")
    refused = lock("order:10", ttl=5)
    started = time.monotonic()
    with pytest.raises(LockBackendUnavailable, match=r"REPLICA_ACKS.*not acquired"):
        refused.acquire()
    assert time.monotonic() - started >= 0.3
    # Given back, not left to block the resource for its TTL.
    assert not sentinel.primary().exists("joblock:{order:10}:lock")
    # Negative control: without REPLICA_ACKS the same acquire succeeds on the primary alone.
    settings.JOBLOCK = {**settings.JOBLOCK, "REPLICA_ACKS": 0}
    alone = lock("order:10", ttl=5)
    assert alone.acquire()
    alone.release()
