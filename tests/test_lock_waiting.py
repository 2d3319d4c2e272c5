"""``lock(wait=...)``: waiters in line, in arrival order, handed the lock on release.

Real processes (tests/waiters.py) where order, death and hand-over are the point; real
faults (SIGKILL, SIGSTOP, a lock expired under its holder); commands counted on the wire
(tests/counting.py). No wall-clock assertions: order, hand-over, server-clock times and wait
budgets sized far past what the mechanism needs.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.core.cache import caches
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from redis.exceptions import ResponseError

from django_joblock import JoblockConfigError, LockBackendUnavailable, lock
from django_joblock.locks import scripts
from django_joblock.locks.keys import LockKeys
from tests import harness
from tests.counting import CommandCounter
from tests.harness import expire_now, wait_for
from tests.waiters import Waiters

pytestmark = pytest.mark.slow  # starts processes or servers


def _keys(resource: str) -> LockKeys:
    return LockKeys("joblock", resource)


def _cache(location: str, **options: Any) -> dict[str, Any]:
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": location,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5, **options},
    }


def _port() -> int:
    return int(harness.redis_url().rsplit(":", 1)[1].split("/")[0])


def _records(rconn: Any) -> list[dict[str, int]]:
    return [json.loads(raw) for raw in rconn.lrange("test:order", 0, -1)]


@pytest.fixture
def waiters() -> Iterator[Waiters]:
    crew = Waiters()
    yield crew
    crew.close()


def _in_line(rconn: Any, queue: str, count: int) -> bool:
    """Wait (generously) until ``count`` tickets are in line."""
    return wait_for(lambda: rconn.zcard(queue) == count, 60)


def _queue_up(rconn: Any, crew: Waiters, resource: str, count: int, *args: str) -> list[Any]:
    """Start ``count`` waiting processes one after the other, each in line before the next."""
    line = _keys(resource).queue
    procs = []
    for index in range(count):
        procs.append(crew.start("wait", resource, str(index), *args))
        assert _in_line(rconn, line, index + 1), f"waiter {index} not in line"
    return procs


def _finish(procs: list[Any]) -> None:
    for proc in procs:
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"exit {proc.returncode}: {err[-2000:]}"


# -- arrival order ---------------------------------------------------------------------------
def test_eight_waiting_processes_get_the_lock_in_arrival_order(rconn, waiters):
    waiters.joblock = {"WAITER_TTL": 30}  # a loaded machine must not cost anyone its place
    keys = _keys("line:8")
    holder = lock("line:8", ttl=30)
    assert holder.acquire()
    procs = _queue_up(rconn, waiters, "line:8", 8, "30", "60", "0.02")
    # Negative control: all eight wait at once and none got in while the lock was held.
    assert rconn.zcard(keys.queue) == 8
    assert rconn.llen("test:order") == 0
    # Nothing of the line lives without an expiry.
    line_keys = list(rconn.scan_iter(match="joblock:{line:8}:*"))
    assert {keys.queue.encode(), keys.tickets.encode()} <= set(line_keys)
    assert all(rconn.pttl(key) > 0 for key in line_keys), line_keys
    assert holder.release()
    _finish(procs)
    records = _records(rconn)
    assert [record["index"] for record in records] == list(range(8))
    fences = [holder.fence] + [record["fence"] for record in records]
    assert fences == sorted(set(fences)), "each hand-over issues a greater fence"
    assert rconn.exists(keys.queue, keys.tickets) == 0, "the line is gone with its last waiter"


def test_a_newcomer_never_goes_before_the_line(rconn, waiters):
    waiters.joblock = {"WAITER_TTL": 30}
    keys = _keys("fair:1")
    holder = lock("fair:1", ttl=30, heartbeat=False)
    assert holder.acquire()
    (first,) = _queue_up(rconn, waiters, "fair:1", 1, "30", "60", "0")
    os.kill(first.pid, signal.SIGSTOP)  # the first in line cannot take the lock for now
    try:
        expire_now(rconn, holder.key)  # the holder's TTL ran out: no release, no hand-over
        assert rconn.exists(holder.key) == 0, "negative control: the lock is free"
        assert not lock("fair:1", ttl=5).acquire(), "one try must not take a reserved lock"
        assert not lock("fair:1", ttl=5).acquire(wait=0.5), "a newcomer waits behind the line"
        assert rconn.exists(holder.key) == 0, "still free, still reserved"
        assert rconn.zcard(keys.queue) == 1, "the newcomer that gave up left the line"
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _finish([first])
    assert [record["index"] for record in _records(rconn)] == [0]


# -- dead waiters, dead holders --------------------------------------------------------------
@pytest.mark.parametrize("killed", [0, 1], ids=["first-in-line", "second-in-line"])
def test_a_waiter_killed_while_waiting_does_not_stall_the_line(rconn, waiters, killed):
    # Locks live 30 s, places in line 3 s without a sign of life, and the survivors wait 20 s
    # at most: had the dead waiter held up the line for a lock TTL, they would give up.
    waiters.joblock = {"WAITER_TTL": 3}
    keys = _keys("dead-waiter:1")
    holder = lock("dead-waiter:1", ttl=30)
    assert holder.acquire()
    procs = _queue_up(rconn, waiters, "dead-waiter:1", 3, "30", "20", "0.05")
    victim = procs.pop(killed)
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    assert rconn.zcard(keys.queue) == 3, "negative control: the dead waiter's ticket is in line"
    assert holder.release()
    _finish(procs)
    assert [record["index"] for record in _records(rconn)] == [i for i in range(3) if i != killed]
    assert wait_for(lambda: rconn.exists(keys.queue, keys.tickets) == 0, 30)


def test_a_holder_killed_mid_hold_hands_over_after_its_ttl(rconn, waiters):
    waiters.joblock = {"WAITER_TTL": 30}
    keys = _keys("dead-holder:1")
    holder = waiters.start("hold", "dead-holder:1", "2")
    line = holder.stdout.readline()
    assert line.startswith("held "), line + holder.stderr.read()
    procs = _queue_up(rconn, waiters, "dead-holder:1", 2, "30", "60", "0.05")
    holder.send_signal(signal.SIGKILL)
    holder.communicate(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    # Negative control: the dead holder's lock is still there (nobody released it).
    snapshot = rconn.hgetall(keys.lock)
    assert int(snapshot[b"fence"]) == int(line.split()[1])
    assert rconn.pttl(keys.lock) > 0
    expires_ms = int(snapshot[b"renewed_ms"]) + int(snapshot[b"ttl_ms"])
    _finish(procs)
    records = _records(rconn)
    assert [record["index"] for record in records] == [0, 1]
    # Server clock against server clock: the first in line got it once the TTL had run out.
    assert records[0]["acquired_ms"] >= expires_ms - 2, (records[0], expires_ms)
    assert int(snapshot[b"fence"]) < records[0]["fence"] < records[1]["fence"]


# -- hand-over ---------------------------------------------------------------------------------
@pytest.mark.parametrize("heartbeat", [True, False], ids=["heartbeat", "no-heartbeat"])
def test_a_release_hands_the_lock_to_the_first_in_line(settings, rconn, heartbeat):
    settings.JOBLOCK = {"WAITER_TTL": 6}
    keys = _keys("hand:1")
    holder = lock("hand:1", ttl=30)
    assert holder.acquire()
    waiter = lock("hand:1", ttl=30, wait=60, heartbeat=heartbeat)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    try:
        assert wait_for(lambda: rconn.zcard(keys.queue) == 1, 30)
        assert holder.release()
        # The release itself wrote the waiter's lock, before the waiter ran another command.
        assert rconn.hget(keys.lock, "token") == waiter.token.encode()
        if heartbeat:
            # Handed over for the hand-over TTL (WAITER_TTL) only, until the waiter renews it.
            assert 0 < rconn.pttl(keys.lock) <= 6000
    finally:
        thread.join(60)
    assert got == [True]
    assert waiter.fence is not None and holder.fence is not None
    assert waiter.fence > holder.fence
    if not heartbeat:
        assert rconn.pttl(keys.lock) > 6000, "renewed to its TTL before acquire() returned"
    assert wait_for(lambda: rconn.pttl(keys.lock) > 6000, 30), "renewed to its TTL"
    assert waiter.held
    assert waiter.release()
    assert rconn.exists(keys.lock, keys.queue, keys.tickets) == 0


@pytest.mark.parametrize(
    "pool_options",
    [{"protocol": 3}, {"decode_responses": True}],
    ids=["resp3", "decoded-replies"],
)
def test_waiting_works_whatever_the_reply_format(settings, rconn, pool_options):
    """Replies come as RESP3 types, or as str instead of bytes, when the cache asks for it."""
    settings.CACHES = {
        **settings.CACHES,
        "shaped": _cache(
            # A URL of its own, so that django-redis gives this cache a pool of its own.
            f"{harness.redis_url()}?client_name=shaped-{sorted(pool_options)[0]}",
            CONNECTION_POOL_KWARGS=pool_options,
        ),
    }
    keys = _keys("shaped:1")
    holder = lock("shaped:1", ttl=30, cache="shaped")
    assert holder.acquire()
    waiters = [lock("shaped:1", ttl=30, wait=60, cache="shaped") for _ in range(2)]
    got: list[int] = []

    def wait(index: int) -> None:
        if waiters[index].acquire():
            got.append(index)
            waiters[index].release()

    threads = [threading.Thread(target=wait, args=(index,)) for index in range(2)]
    try:
        for index, thread in enumerate(threads):
            thread.start()
            assert _in_line(rconn, keys.queue, index + 1)
        assert not lock("shaped:1", ttl=5, cache="shaped").acquire()
        assert holder.release()
    finally:
        for thread in threads:
            thread.join(60)
    assert got == [0, 1]
    assert rconn.exists(keys.lock, keys.queue, keys.tickets) == 0


def test_a_waiter_that_gives_up_or_is_interrupted_leaves_the_line(rconn):
    keys = _keys("leave:1")
    holder = lock("leave:1", ttl=30)
    assert holder.acquire()
    joined: list[bool] = []
    watcher = threading.Thread(
        target=lambda: joined.append(wait_for(lambda: rconn.zcard(keys.queue) == 1, 30))
    )
    watcher.start()
    assert not lock("leave:1", ttl=5).acquire(wait=2)
    watcher.join(30)
    assert joined == [True], "negative control: it was in line while it waited"
    assert rconn.exists(keys.queue, keys.tickets) == 0

    def interrupt(signum: int, frame: Any) -> None:
        raise RuntimeError("interrupted while waiting")

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(RuntimeError, match="interrupted"):
            lock("leave:1", ttl=5).acquire(wait=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert rconn.exists(keys.queue, keys.tickets) == 0
    assert holder.release()


def test_a_waiter_whose_redis_goes_away_raises_and_can_wait_again(server, rconn):
    keys = _keys("restart:1")
    holder = lock("restart:1", ttl=30)
    assert holder.acquire()
    waiter = lock("restart:1", ttl=30, wait=60)
    outcome: list[object] = []

    def wait_for_it() -> None:
        try:
            outcome.append(waiter.acquire())
        except LockBackendUnavailable as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    assert _in_line(rconn, keys.queue, 1)
    server.kill()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], LockBackendUnavailable), (
        "Redis gone while waiting is 'unavailable', never 'busy'",
        outcome,
    )
    server.start()
    # The restart (no persistence) forgot the holder's lock and the line: waiting again works.
    assert waiter.acquire(wait=10)
    assert waiter.fence is not None and holder.fence is not None
    assert waiter.fence > holder.fence, "the fence still increases across the restart"
    assert waiter.release()
    assert not holder.release()
    assert holder.lost


# -- round trips and connections ---------------------------------------------------------------
@pytest.fixture
def counted(settings: Any) -> Iterator[CommandCounter]:
    counter = CommandCounter(_port())
    settings.CACHES = {**settings.CACHES, "counted": _cache(counter.url)}
    settings.JOBLOCK = {"METRICS": False}  # no metrics flush riding along with a release
    yield counter
    counter.close()


def test_a_try_and_a_release_take_one_round_trip_a_free_lock_ready_to_wait_two(rconn, counted):
    warm = lock("trips:warm", ttl=10, cache="counted")
    assert warm.acquire() and warm.release()  # connections made, scripts loaded
    counted.take()
    free = lock("trips:1", ttl=10, wait=60, cache="counted")
    assert free.acquire()
    # Ready to wait: one round trip too, the script writes the index entry itself.
    assert counted.take() == ["EVALSHA"], "uncontended, even when ready to wait"

    def indexed(held: Any) -> Any:
        return rconn.zscore("joblock:active:trips", f"{held.resource}#{held.owner}")

    assert indexed(free) is not None
    assert free.release()
    assert counted.take() == ["EVALSHA"], "a release with nobody waiting unindexes in its script"
    assert indexed(free) is None
    once = lock("trips:3", ttl=10, wait=0, cache="counted")
    assert once.acquire()
    assert counted.take() == ["EVALSHA"], "one try: the script writes the index entry itself"
    assert indexed(once) is not None
    assert once.release()
    counted.take()
    holder = lock("trips:2", ttl=10)  # on the default cache: not counted
    assert holder.acquire()
    busy = lock("trips:2", ttl=10, wait=0, cache="counted")
    assert not busy.acquire()
    assert counted.take() == ["EVALSHA"], "wait=0 on a busy lock: one try, nothing indexed"
    assert indexed(busy) is None and indexed(holder) is not None
    assert rconn.exists(_keys("trips:2").queue) == 0, "one try does not join the line"
    # Negative control: the counter does see what a waiting acquire sends.
    assert not lock("trips:2", ttl=10, wait=0.3, cache="counted").acquire()
    seen = counted.take()
    assert "BLPOP" in seen and seen.count("EVALSHA") >= 2, seen
    assert holder.release()
    counted.take()
    # A lock with several holders: its one-try is one round trip as well, indexed by slot.
    slots = [lock("trips:4", ttl=10, wait=0, limit=3, cache="counted") for _ in range(2)]
    assert all(each.acquire() for each in slots)
    assert counted.take() == ["EVALSHA", "EVALSHA"], "one round trip per holder"
    assert indexed(slots[0]) is not None, "slot 0: the plain member"
    member = f"trips:4#{slots[1].owner}##1"
    assert rconn.zscore("joblock:active:trips", member) is not None, "slot 1's member"
    assert all(each.release() for each in slots)
    assert counted.take() == ["EVALSHA", "EVALSHA"]
    assert rconn.zcard("joblock:active:trips") == 0, "each release removed its own entry"


def _blocked_in_blpop(rconn: Any) -> int:
    return sum(1 for c in rconn.client_list() if c["cmd"] == "blpop" and "b" in c["flags"])


def _checkout(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 wants a command name
        return pool.get_connection("PING")


def test_fifty_waiters_on_a_capped_pool_do_not_break_the_cache(settings, rconn):
    settings.CACHES = {
        **settings.CACHES,
        "capped": _cache(
            f"{harness.redis_url()}?max_connections=4",
            CONNECTION_POOL_KWARGS={"max_connections": 4},
        ),
    }
    settings.JOBLOCK = {"WAITER_TTL": 30}
    keys = _keys("crowd:1")
    holder = lock("crowd:1", ttl=30, cache="capped")
    assert holder.acquire()
    results: dict[int, object] = {}
    order: list[int] = []

    def waiter(index: int) -> None:
        held = lock("crowd:1", ttl=30, wait=120, cache="capped")
        try:
            results[index] = held.acquire()
        except Exception as exc:  # reported by the assertion below
            results[index] = repr(exc)
            return
        order.append(index)
        held.release()

    threads = []
    try:
        for index in range(50):
            threads.append(threading.Thread(target=waiter, args=(index,)))
            threads[-1].start()
            assert _in_line(rconn, keys.queue, index + 1), index
        # Negative controls: fifty waiters are blocked on the server right now, and the
        # cache's pool really is capped at four connections.
        assert wait_for(lambda: _blocked_in_blpop(rconn) >= 50, 30)
        cache = caches["capped"]
        pool = cache.client.get_client(write=True).connection_pool
        taken = [_checkout(pool) for _ in range(4)]
        with pytest.raises(redis.ConnectionError):
            _checkout(pool)
        for conn in taken:
            pool.release(conn)
        # The cache works, and no waiter holds one of its connections.
        cache.set("crowd-probe", 1)
        assert cache.get("crowd-probe") == 1
        assert len(pool._in_use_connections) == 0
    finally:
        assert holder.release()
        for thread in threads:
            thread.join(120)
    assert results == dict.fromkeys(range(50), True)
    assert order == list(range(50))
    # Idle blocking connections are closed but for a couple kept for the next waiter.
    assert wait_for(lambda: len(rconn.client_list()) < 20, 30), len(rconn.client_list())


# -- numbers -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["nan", "inf", "0", "1.5", "1e+300", "x"])
@pytest.mark.parametrize("position", [9, 10], ids=["ticket-ttl", "hand-over-ttl"])
def test_the_wait_script_refuses_a_bad_ttl_before_writing(rconn, bad, position):
    keys = _keys("bad:1")
    args: list[Any] = ["token", 5000, 86_400_000, "host", 1, "", "", "", "ticket", 2000, 2000, "0"]
    args[position] = bad
    script_keys = [keys.lock, keys.fence, keys.queue, keys.tickets, keys.wake("ticket")]
    with pytest.raises(ResponseError, match="ttl"):
        scripts.WAIT(rconn, script_keys, args)
    assert rconn.dbsize() == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.01, 1e9, "2"])
@pytest.mark.django_db
def test_waiter_ttl_setting_must_be_finite_and_in_range(settings, value):
    settings.JOBLOCK = {"WAITER_TTL": value}
    with pytest.raises(SystemCheckError, match=r"django_joblock\.E003.*WAITER_TTL"):
        call_command("check")
    with pytest.raises(JoblockConfigError, match="WAITER_TTL"):
        lock("numbers:waiter-ttl", wait=1)


@pytest.mark.django_db
def test_a_force_release_hands_the_lock_to_the_first_in_line(rconn):
    """An operator's release goes through the owner's release script: the first waiter is
    handed the lock at once (before the fix the lock was left free for the waiter to notice)."""
    from django_joblock import lock_info
    from django_joblock.locks.keys import owner_hash
    from django_joblock.monitor.control import force_release

    holder = lock("order:55", ttl=30)
    assert holder.acquire()
    waiter = lock("order:55", ttl=30, wait=30)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    try:
        assert wait_for(lambda: _in_line(rconn, _keys("order:55").queue, 1), 10)
        result = force_release("order:55", reason="stuck", actor="test", owner=holder.owner)
        assert result.released, result.outcome
        info = lock_info("order:55")  # right away: the release itself wrote the new holder
        assert info is not None and info.owner == owner_hash(waiter.token), info
    finally:
        thread.join(30)
    assert got == [True] and waiter.release()


def test_a_release_behind_a_hundred_dead_tickets_frees_the_lock(settings, rconn):
    """Regression (review): with 100 or more dead tickets first in line (their waiters killed),
    the release's look at the line ends without a verdict; it took that for a ticket and
    unpacked its missing details: a raw ResponseError, the lock left held for its TTL and the
    live waiter behind them waiting in vain. Now the release frees the lock and the waiter,
    cleaning the line on its next tries, takes it."""
    settings.JOBLOCK = {"WAITER_TTL": 40}
    keys = _keys("order:dead")
    holder = lock("order:dead", ttl=30)
    assert holder.acquire()
    # Joined the line, then died: never refreshed, their tickets all run out at one moment, a
    # few seconds on (time for the live waiter to join behind them on a busy machine). 300: the
    # live waiter's own look at the line (about every second) drops at most 100 of them.
    dead = 300
    started = time.monotonic()
    for n in range(dead):
        left_ms = max(1, int((3.0 - (time.monotonic() - started)) * 1000))
        args = [f"dead{n}", 30_000, 86_400_000, "host", 1, "", "", "", f"t{n}", left_ms, 1500, 0]
        wake = keys.wake(f"t{n}")
        scripts.WAIT(rconn, [keys.lock, keys.fence, keys.queue, keys.tickets, wake], args)
    waiter = lock("order:dead", ttl=30, wait=30)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    try:
        assert _in_line(rconn, keys.queue, dead + 1)  # the fault: the dead first, the live last
        time.sleep(max(0.0, 3.2 - (time.monotonic() - started)))  # the dead tickets ran out
        assert rconn.zcard(keys.queue) > 100, "negative control: 100 or more dead still first"
        assert holder.release() is True
        assert rconn.hget(keys.lock, "token") != holder.token.encode()
    finally:
        thread.join(30)
    assert got == [True] and waiter.release()


def test_a_lock_taken_after_a_wait_longer_than_its_ttl_is_indexed_as_live(rconn):
    """Review bug: WAIT wrote the holding's active-lock index entry with the score computed
    when the wait began (start + TTL). After a wait longer than the TTL the entry read as a
    holding already ended, and the dashboard and ``joblock_locks`` did not show the lock until
    its first renewal (never, without a heartbeat)."""
    from django_joblock.locks import index

    first = lock("indexed:1", ttl=2, heartbeat=False)
    assert first.acquire()  # never released: its TTL frees the resource for the waiter's WAIT
    waiter = lock("indexed:1", ttl=1, wait=10, heartbeat=False)
    started = time.monotonic()
    assert waiter.acquire()
    assert time.monotonic() - started > waiter.ttl, "negative control: it waited past its TTL"
    live = [m.owner for m in index.members(["indexed"], 10)]
    assert live == [waiter.owner], "the holding is listed while it is held"
    assert waiter.release()
