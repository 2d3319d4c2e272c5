"""The fence counter in Redis: the fences handed to successive holders of a resource are strictly
increasing, whatever happens to Redis in between. (The database side, ``fenced_update``
rejecting a superseded holder's write, is tests/test_fenced_update.py.)"""

from __future__ import annotations

import time

import pytest

from django_joblock import lock
from tests import racers
from tests.harness import wait_expired


def _fence_of_new_holder(resource: str = "order:1") -> int:
    held = lock(resource, ttl=5)
    assert held.acquire()
    fence = held.fence
    held.release()
    assert fence is not None
    return fence


def test_fence_increases_across_release():
    fences = [_fence_of_new_holder() for _ in range(20)]
    assert fences == sorted(set(fences)), fences


def test_fence_increases_across_expiry(rconn):
    first = lock("order:1", ttl=0.1, heartbeat=False)
    assert first.acquire()
    wait_expired(rconn, first.key, first.ttl)  # negative control: the first lock really expired
    assert _fence_of_new_holder() > first.fence


def test_fence_increases_after_flushdb(rconn):
    before = _fence_of_new_holder()
    rconn.flushdb()
    assert rconn.exists("joblock:{order:1}:fence") == 0, "the counter is really gone"
    assert _fence_of_new_holder() > before


def test_fence_counter_far_ahead_of_clock_still_increases(rconn):
    # Many acquisitions within one microsecond would push the counter past the clock;
    # simulate it: the next fence must come from the counter, not the (smaller) clock.
    ahead = int(time.time() * 1_000_000) + 10**12
    rconn.set("joblock:{order:1}:fence", ahead)
    assert _fence_of_new_holder() == ahead + 1


@pytest.mark.slow
def test_fence_increases_after_redis_restart_without_persistence(server, rconn):
    before = _fence_of_new_holder()
    server.restart()
    rconn.connection_pool.disconnect()
    assert rconn.dbsize() == 0, "negative control: the restart really lost every key"
    assert _fence_of_new_holder() > before


@pytest.mark.slow
def test_fences_from_8_racing_processes_are_distinct_and_increasing(rconn):
    racers.run_all(rconn, [("fence_race", "10")] * 8)
    rows = [row.decode().split(":") for row in rconn.lrange("test:fences", 0, -1)]
    assert len(rows) == 80
    by_order = sorted((int(order), int(fence)) for order, fence, _pid in rows)
    fences = [fence for _order, fence in by_order]
    assert len(set(fences)) == 80, "fences must be distinct"
    assert fences == sorted(fences), "fences must increase in acquisition order"
    assert len({pid for _o, _f, pid in rows}) == 8, "all 8 processes took part"
