"""Acquire / contend / release, owner-token checks, TTL replacement and expiry (real Redis)."""

from __future__ import annotations

import threading
import time

import pytest

from django_joblock import (
    Lock,
    LockBackendUnavailable,
    LockLost,
    LockNotAcquired,
    LockState,
    current_lock,
    lock,
    lock_info,
)
from django_joblock.locks import scripts
from tests.harness import wait_expired


def test_acquire_contend_release(rconn):
    first = lock("order:1", ttl=10)
    assert first.acquire()
    assert first.held and first.fence is not None
    stored = rconn.hgetall(first.key)
    assert stored[b"token"].decode() == first.token
    assert int(stored[b"fence"]) == first.fence

    second = lock("order:1", ttl=10)
    assert second.acquire() is False, "a held lock must not be given to a second owner"
    with pytest.raises(LockNotAcquired) as info:
        with lock("order:1", ttl=10):
            pass
    assert info.value.resource == "order:1"

    assert first.release() is True
    assert not first.held and rconn.exists(first.key) == 0
    assert second.acquire() is True
    assert second.fence > first.fence
    second.release()


def test_context_manager_sets_current_lock(rconn):
    assert current_lock() is None
    with lock("tenant:7:cache", ttl=5) as held:
        assert current_lock() is held
        assert held.held and rconn.exists(held.key)
    assert current_lock() is None
    assert rconn.exists(held.key) == 0


def test_a_waiting_acquire_gets_the_lock_once_the_holders_ttl_ends(rconn):
    holder = lock("order:2", ttl=0.3, heartbeat=False)
    assert holder.acquire()
    waiter = lock("order:2", ttl=5)
    assert waiter.acquire(wait=3), "the waiter should get the lock once the holder's TTL ends"
    assert waiter.fence > holder.fence
    waiter.release()


def test_release_with_foreign_token_is_refused(rconn):
    held = lock("order:3", ttl=10)
    assert held.acquire()
    assert scripts.RELEASE(rconn, [held.key], ["not-the-owner"]) == scripts.Outcome.OTHER_OWNER
    assert rconn.hget(held.key, "token").decode() == held.token, "foreign release deleted it"
    held.release()


def test_renew_with_foreign_token_is_refused(rconn):
    held = lock("order:4", ttl=10)
    assert held.acquire()
    rconn.pexpire(held.key, 5000)
    reply = scripts.RENEW(rconn, [held.key], ["not-the-owner", 60000])
    assert reply == scripts.Outcome.OTHER_OWNER
    assert rconn.pttl(held.key) <= 5000, "a foreign renew must not extend the TTL"
    held.release()


def test_stale_holder_cannot_release_the_new_holders_lock(rconn):
    old = lock("order:5", ttl=0.2, heartbeat=False)
    assert old.acquire()
    wait_expired(rconn, old.key, old.ttl)
    new = lock("order:5", ttl=10)
    assert new.acquire()
    assert old.release() is False
    assert rconn.hget(new.key, "token").decode() == new.token
    new.release()


def test_renew_replaces_the_ttl(rconn):
    held = lock("order:6", ttl=10, heartbeat=False)
    assert held.acquire()
    rconn.pexpire(held.key, 100_000)  # longer than the lock's own TTL
    assert held.renew() is True
    pttl = rconn.pttl(held.key)
    assert 0 < pttl <= 10_000, f"renew must replace the TTL with 10 s, not add to it (got {pttl})"
    assert int(rconn.hget(held.key, "renewals")) == 1
    held.release()


def test_expiry_frees_the_lock(rconn):
    held = lock("order:7", ttl=0.2, heartbeat=False)
    assert held.acquire()
    wait_expired(rconn, held.key, held.ttl)
    assert held.lost and not held.held
    with pytest.raises(LockLost):
        held.ensure_held()
    other = lock("order:7", ttl=1)
    assert other.acquire()
    other.release()


def test_holder_details_are_stored(rconn):
    import os

    with lock("invoice:9", ttl=5) as held:
        details = {k.decode(): v.decode() for k, v in rconn.hgetall(held.key).items()}
    assert details["pid"] == str(os.getpid())
    assert details["host"]
    assert int(details["ttl_ms"]) == 5000
    assert int(details["acquired_ms"]) > 1_600_000_000_000  # Redis server clock, in ms


def test_redis_down_raises_backend_unavailable():
    with pytest.raises(LockBackendUnavailable) as info:
        lock("order:8", cache="down").acquire()
    assert info.value.resource == "order:8"
    assert "busy" not in str(info.value).lower()


def test_using_the_old_name_of_cache_still_picks_the_cache_and_warns():
    """``using=`` named the cache alias before ``cache=`` (in Django it names a database)."""
    with pytest.warns(DeprecationWarning, match="pass cache=") as warned:
        held = lock("order:9", using="down")
    assert warned[0].filename == __file__, "the warning points at the caller's line"
    assert held.cache == "down"
    with pytest.raises(LockBackendUnavailable):
        held.acquire()
    with pytest.warns(DeprecationWarning, match="pass cache="):
        assert Lock("order:9", using="down").cache == "down"
    with (
        pytest.warns(DeprecationWarning, match="pass cache="),
        pytest.raises(LockBackendUnavailable),
    ):
        lock_info("order:9", using="down")
    with pytest.raises(TypeError, match="give the cache alias once"):
        lock("order:9", cache="default", using="down")


@pytest.mark.slow
def test_redis_killed_raises_backend_unavailable(server, rconn):
    server.kill()
    try:
        with pytest.raises(LockBackendUnavailable):
            lock("order:9", ttl=5).acquire()
    finally:
        server.start()
        rconn.connection_pool.disconnect()
    # Negative control: the same call works once Redis is back.
    held = lock("order:9", ttl=5)
    assert held.acquire()
    held.release()


@pytest.mark.slow
def test_out_of_memory_raises_backend_unavailable(server, rconn):
    rconn.config_set("maxmemory-policy", "noeviction")
    rconn.config_set("maxmemory", 1)
    try:
        with pytest.raises(LockBackendUnavailable) as info:
            lock("order:10", ttl=5).acquire()
        assert "memory" in str(info.value).lower()
    finally:
        rconn.config_set("maxmemory", 0)
    held = lock("order:10", ttl=5)
    assert held.acquire(), "negative control: with memory back the same acquire works"
    held.release()


def test_state_transitions_on_release(rconn):
    held = lock("order:11", ttl=5)
    assert held.state is LockState.UNLOCKED
    held.acquire()
    assert held.state is LockState.HELD
    held.release()
    assert held.state is LockState.RELEASED
    assert held.release() is False


def test_lock_decorates_a_function_each_call_holding_a_new_lock(rconn):
    """``@lock("r")`` holds the lock around each call, as ``transaction.atomic`` decorates: a
    new holding (a greater fence) per call, released after it; calls from two threads never
    overlap; a busy lock raises ``LockNotAcquired`` from the call."""
    seen: list[tuple[str, int | None]] = []
    inside = threading.Semaphore(1)
    overlaps: list[bool] = []

    @lock("report:daily", ttl=5, wait=10)
    def build(n: int) -> int:
        held = current_lock()
        assert held is not None and held.held
        seen.append((held.resource, held.fence))
        overlaps.append(not inside.acquire(blocking=False))
        time.sleep(0.05)
        inside.release()
        return n * 2

    assert build(2) == 4
    assert current_lock() is None
    assert not rconn.exists(Lock("report:daily").key), "released after the call"
    threads = [threading.Thread(target=build, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [resource for resource, _ in seen] == ["report:daily"] * 5
    fences = [fence for _, fence in seen]
    assert fences == sorted(fences) and len(set(fences)) == 5, "a new holding per call"
    assert overlaps == [False] * 5, "no two calls held it at once"

    @lock("report:daily", wait=0)
    def busy() -> None:
        raise AssertionError("ran without the lock")

    with lock("report:daily"), pytest.raises(LockNotAcquired):
        busy()


def test_lock_refuses_to_decorate_an_async_function():
    async def report() -> None:
        pass

    with pytest.raises(TypeError, match=r"lock\('report'\) cannot decorate the async def"):
        lock("report")(report)
