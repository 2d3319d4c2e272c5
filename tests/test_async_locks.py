"""``alock()``: the lock for asyncio code, on a real Redis, beside sync holders of the same
resources. Each test runs its own event loop (``asyncio.run``)."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio
from asgiref.sync import sync_to_async
from django.core.exceptions import SynchronousOnlyOperation

from django_joblock import (
    AsyncLock,
    LockLost,
    LockNotAcquired,
    StaleFence,
    afenced_update,
    alock,
    current_lock,
    lock,
)
from tests import harness, racers
from tests.harness import wait_for


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(scenario())


def counter_client() -> Any:
    """An asyncio client of the test Redis, for the tests' own keys (made in the running loop)."""
    return redis.asyncio.Redis.from_url(harness.redis_url())


async def racy_increment(client: Any) -> None:
    """Read, yield to the loop, write: two bodies running at once lose an update."""
    value = int(await client.get("test:counter") or 0)
    await asyncio.sleep(0.002)
    await client.set("test:counter", value + 1)


def test_an_async_holder_takes_renews_and_releases_with_a_fence(rconn):
    async def scenario() -> tuple[Any, ...]:
        async with alock("order:1", ttl=5) as held:
            inside = (held.held, held.fence, current_lock() is held, rconn.hget(held.key, "token"))
            renewed = await held.arenew()
        return inside, renewed, held.held, rconn.exists(held.key)

    (held, fence, current, token), renewed, after, exists = run(scenario)
    assert held is True and fence > 0 and current is True and token is not None
    assert renewed is True
    assert after is False and exists == 0, "released on leaving the block"


@pytest.mark.slow
def test_async_tasks_and_sync_processes_exclude_each_other_on_one_resource(rconn):
    """50 async tasks and two sync processes (25 holds each) do racy increments of one counter
    under the lock of one resource: none is lost."""
    rconn.delete("test:ready", "test:go", "test:counter")
    procs = [racers.start("increment", "25", "lock") for _ in range(2)]
    assert wait_for(lambda: int(rconn.get("test:ready") or 0) == 2, 60), "the racers are ready"

    async def scenario() -> None:
        client = counter_client()

        async def one() -> None:
            async with alock("counter:1", ttl=10, wait=60):
                await racy_increment(client)

        rconn.set("test:go", 1)
        await asyncio.gather(*(one() for _ in range(50)))
        await client.aclose()

    run(scenario)
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    assert int(rconn.get("test:counter")) == 100


def test_without_the_lock_the_same_async_increments_lose_updates(rconn):
    """Negative control of the test above: the race is real."""
    rconn.delete("test:counter")

    async def scenario() -> None:
        client = counter_client()
        await asyncio.gather(*(racy_increment(client) for _ in range(50)))
        await client.aclose()

    run(scenario)
    assert int(rconn.get("test:counter")) < 50


def test_twenty_waiting_tasks_all_get_the_lock_and_never_block_the_loop():
    """20 tasks wait in line for one resource (each holds it 50 ms); a ticker task that sleeps
    10 ms at a time is not held up by them."""

    async def scenario() -> tuple[list[float], float, list[int]]:
        done = asyncio.Event()
        lateness: list[float] = []
        fences: list[int] = []

        async def ticker() -> None:
            while not done.is_set():
                before = time.monotonic()
                await asyncio.sleep(0.01)
                lateness.append(time.monotonic() - before - 0.01)

        async def one() -> None:
            async with alock("hot:1", ttl=10, wait=60) as held:
                fences.append(held.fence)
                await asyncio.sleep(0.05)

        tick = asyncio.create_task(ticker())
        await asyncio.gather(*(one() for _ in range(20)))
        done.set()
        await tick
        return lateness, max(lateness), fences

    lateness, worst, fences = run(scenario)
    assert len(fences) == 20 and fences == sorted(fences), "each got it, fences increasing"
    assert len(lateness) > 50, "the ticker ran throughout"
    # 50 ms at most on a quiet machine (measured: see CHANGELOG); a busy one may deschedule
    # the whole process now and then, so the bound holds for nine ticks in ten, and no tick
    # waits as long as a blocking acquire would have (a second or more: 20 holds of 50 ms).
    late = sorted(lateness)[int(len(lateness) * 0.9)]
    assert late < 0.05, f"nine ticks in ten within 50 ms; the tenth: {late * 1000:.0f} ms"
    assert worst < 0.5, f"the loop was blocked {worst * 1000:.0f} ms"


def test_the_heartbeat_renews_an_async_holder_across_three_ttls(rconn):
    async def scenario() -> tuple[bool, int, bool]:
        held = alock("long:1", ttl=1)
        assert await held.aacquire()
        await asyncio.sleep(3.2)
        still = held.held
        pttl = rconn.pttl(held.key)
        return still, pttl, await held.arelease()

    still, pttl, released = run(scenario)
    assert still is True and pttl > 0, "renewed off the loop while the task slept"
    assert released is True


def test_without_the_heartbeat_an_async_holder_expires_after_its_ttl(rconn):
    """Negative control of the test above."""

    async def scenario() -> tuple[bool, int]:
        held = alock("long:1", ttl=1, heartbeat=False)
        assert await held.aacquire()
        await asyncio.sleep(1.5)
        return held.held, rconn.exists(held.key)

    assert run(scenario) == (False, 0)


def test_an_async_holder_notices_its_lock_lost_and_the_block_raises(rconn):
    lost: list[str] = []

    async def scenario() -> None:
        async with alock("lost:1", ttl=1, on_lost=lambda _lock, why: lost.append(why)) as held:
            rconn.hset(held.key, "token", "someone-else")
            while held.held:
                await asyncio.sleep(0.05)

    with pytest.raises(LockLost, match="taken by another owner"):
        run(scenario)
    assert lost == ["taken by another owner"]


@pytest.mark.django_db(transaction=True)
def test_the_fence_refuses_an_async_holders_stale_write(rconn):
    """An async holder that lost its lock to a newer holder has its late write refused."""
    from tests.testapp.models import Account

    account = Account.objects.create(name="a", balance=0)

    async def scenario() -> None:
        old = alock("account:1", ttl=1, heartbeat=False)
        assert await old.aacquire()
        await asyncio.sleep(1.2)  # expired: a newer holder takes it and writes
        async with alock("account:1", ttl=5) as new:
            await afenced_update(Account.objects.filter(pk=account.pk), new.fence, balance=10)
        with pytest.raises(StaleFence):
            await afenced_update(Account.objects.filter(pk=account.pk), old.fence, balance=99)

    run(scenario)
    account.refresh_from_db()
    assert account.balance == 10


def test_a_cancelled_waiting_task_leaves_the_line_at_once(rconn):
    async def scenario() -> tuple[int, int, bool]:
        holder = alock("line:1", ttl=10)
        assert await holder.aacquire()
        waiter = asyncio.create_task(alock("line:1", ttl=10, wait=60).aacquire())
        while not rconn.zcard(holder.keys.queue):
            await asyncio.sleep(0.01)
        in_line = rconn.zcard(holder.keys.queue)  # the negative control: it was in line
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        left = rconn.zcard(holder.keys.queue)
        await holder.arelease()
        newcomer = alock("line:1", ttl=10, wait=0)
        got = await newcomer.aacquire()
        await newcomer.arelease()
        return in_line, left, got

    in_line, left, got = run(scenario)
    assert in_line == 1 and left == 0
    assert got is True, "nobody left in line: a newcomer gets the released lock at once"


def test_a_waiting_task_cancelled_just_after_the_lock_was_handed_to_it_gives_it_back(rconn):
    """The holder releases, handing the lock to a task waiting in line; that task is cancelled
    k loop iterations later, for k = 0, 1, 2... until the acquire returned first. Wherever the
    cancellation lands (in the line, or after the lock was handed over but before ``aacquire``
    returned), the lock is not left under the cancelled task's token: a newcomer gets it."""

    async def trial(k: int) -> tuple[bool, bool, bool]:
        resource = f"handed:{k}"  # each trial its own: a lock left behind fails only its own
        holder = alock(resource, ttl=30, heartbeat=False)
        assert await holder.aacquire()
        waiter = alock(resource, ttl=30, wait=10, heartbeat=False)
        waiting = asyncio.create_task(waiter.aacquire())
        while not rconn.zcard(holder.keys.queue):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # blocked in BLPOP
        await holder.arelease()  # hands the lock over to the waiter
        for _ in range(k):
            await asyncio.sleep(0)
        waiting.cancel()
        try:
            returned = await waiting
        except asyncio.CancelledError:
            returned = False
        else:
            assert returned and await waiter.arelease()
        left = rconn.hget(holder.keys.lock, "token") == waiter.token.encode()
        newcomer = alock(resource, ttl=30, wait=0)
        free = await newcomer.aacquire()
        if free:
            await newcomer.arelease()
        return returned, left, free

    async def scenario() -> dict[int, tuple[bool, bool, bool]]:
        trials = {}
        for k in range(200):
            trials[k] = await trial(k)
            if trials[k][0]:  # returned before the cancellation: later ones do the same
                break
        return trials

    trials = run(scenario)
    cancelled = [k for k, (returned, _, _) in trials.items() if not returned]
    assert cancelled and len(cancelled) < len(trials), "negative control: the range spans both"
    leaked = {k: (left, free) for k, (_, left, free) in trials.items() if left or not free}
    assert not leaked, f"k: (left under the waiter's token, a newcomer got it): {leaked}"


def test_a_one_try_task_cancelled_after_its_acquire_got_the_lock_gives_it_back(rconn, settings):
    """With ``REPLICA_ACKS`` (no replica here), a one-try ``aacquire`` that got the lock then
    waits for a replica: cancelled there, before it returned, it gives the lock back."""
    # WAIT blocks for the 5 s ack timeout within a 10 s socket timeout: time to cancel it there
    # on a busy machine (CI: a 2 s socket timeout ran out first).
    acked = {"REPLICA_ACKS": 1, "REPLICA_ACK_TIMEOUT": 5, "REDIS_TIMEOUT": 10}
    settings.JOBLOCK = {**settings.JOBLOCK, **acked}

    async def scenario() -> tuple[bool, bytes | None, bool]:
        trying = alock("acked:1", ttl=30, heartbeat=False)
        task = asyncio.create_task(trying.aacquire(wait=0))
        while not any(c["cmd"] == "wait" and "b" in c["flags"] for c in rconn.client_list()):
            await asyncio.sleep(0.005)
        got = rconn.hget(trying.key, "token") == trying.token.encode()  # its ACQUIRE got it
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        left = rconn.hget(trying.key, "token")
        settings.JOBLOCK = {**settings.JOBLOCK, "REPLICA_ACKS": 0}
        newcomer = alock("acked:1", ttl=30, wait=0)
        free = await newcomer.aacquire()
        if free:
            await newcomer.arelease()
        return got, left, free

    got, left, free = run(scenario)
    assert got is True, "negative control: it had got the lock when cancelled"
    assert left is None and free is True, "given back: a newcomer gets it at once"


def test_a_sync_lock_and_an_async_lock_exclude_each_other(rconn):
    async def scenario() -> tuple[bool, bool]:
        async with alock("mixed:1", ttl=5):
            busy = await sync_to_async(lambda: lock("mixed:1", wait=0).acquire())()
        sync_held = lock("mixed:1", ttl=5, wait=0)
        assert await sync_to_async(sync_held.acquire)()
        refused = await alock("mixed:1", wait=0).aacquire()
        await sync_to_async(sync_held.release)()
        return busy, refused

    assert run(scenario) == (False, False)


def test_a_busy_async_lock_raises_lock_not_acquired_after_its_wait():
    async def scenario() -> None:
        async with alock("busy:1", ttl=5):
            async with alock("busy:1", wait=0.2):
                pass

    with pytest.raises(LockNotAcquired, match=r"busy after waiting 0\.2s"):
        run(scenario)


def test_the_sync_api_inside_a_running_loop_names_the_async_one():
    async def scenario() -> None:
        lock("sync:1").acquire()

    with pytest.raises(SynchronousOnlyOperation, match=r"alock\(\)"):
        run(scenario)


def test_alock_decorates_async_functions_only():
    calls: list[bool] = []

    @alock("decorated:1", ttl=5)
    async def report() -> str:
        calls.append(current_lock() is not None)
        return "done"

    assert run(report) == "done" and calls == [True]
    with pytest.raises(TypeError, match=r"use lock\('decorated:1'\)"):

        @alock("decorated:1")
        def plain() -> None: ...


def test_alock_checks_its_arguments_as_lock_does():
    with pytest.raises(ValueError, match="ttl"):
        alock("r:1", ttl=math.nan)
    assert isinstance(alock("r:1"), AsyncLock)


async def asgi_get(app: Any, path: str) -> tuple[int, bytes]:
    """One GET through the ASGI application ``app``: (status, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    requested = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


@pytest.mark.parametrize("requests", [2, 10])
def test_concurrent_requests_to_an_async_view_with_a_lock_are_served_one_after_another(
    requests,
):
    """Through Django's ASGI handler (tests/async_views.py): all answered 200, and the
    locked parts never overlap."""
    import json

    from django.core.asgi import get_asgi_application

    app = get_asgi_application()

    async def scenario(path: str) -> list[tuple[int, bytes]]:
        return await asyncio.gather(*(asgi_get(app, path) for _ in range(requests)))

    def overlaps(path: str) -> list[bool]:
        answers = run(lambda: scenario(path))
        assert [status for status, _ in answers] == [200] * requests
        spans = sorted(
            (json.loads(body)["started"], json.loads(body)["ended"]) for _, body in answers
        )
        return [started < ended for (_, ended), (started, _) in itertools.pairwise(spans)]

    assert not any(overlaps("/async/export/")), "the lock served them one after another"
    assert all(overlaps("/async/export-unlocked/")), "negative control: without it they overlap"


def sentinel_client() -> Any:
    """A ``JOBLOCK["REDIS_CLIENT"]`` factory: a Sentinel-managed client (made without asking
    a sentinel, as redis-py makes them)."""
    from redis.sentinel import Sentinel

    return Sentinel([("127.0.0.1", 1)]).master_for("mymaster")


def test_alock_on_a_sentinel_client_says_it_needs_one_redis_server(settings):
    from django_joblock import JoblockConfigError

    settings.JOBLOCK = {**settings.JOBLOCK, "REDIS_CLIENT": f"{__name__}.sentinel_client"}

    async def scenario() -> None:
        await alock("r:1", wait=0).aacquire()

    with pytest.raises(JoblockConfigError, match="one Redis server"):
        run(scenario)


@pytest.mark.slow
def test_a_silent_redis_fails_an_async_acquire_within_redis_timeout(settings, proxy):
    """Redis black-holed behind a proxy: a one-try and a waiting ``aacquire`` each raise
    LockBackendUnavailable within REDIS_TIMEOUT (1 s here), and the loop kept ticking."""
    from django_joblock import LockBackendUnavailable

    silent = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": harness.proxy_url()}
    settings.CACHES = {**settings.CACHES, "silent": silent}
    settings.JOBLOCK = {"REDIS_TIMEOUT": 1}

    async def scenario() -> tuple[list[float], int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.05)
                ticks += 1

        tick = asyncio.create_task(ticker())
        warm = alock("silent:1", ttl=30, cache="silent")
        assert await warm.aacquire(), "connections made before the fault"
        proxy.set("blackhole")
        took = []
        for wait in (0, 3):
            started = time.monotonic()
            with pytest.raises(LockBackendUnavailable):
                await alock("silent:2", ttl=30, cache="silent").aacquire(wait=wait)
            took.append(time.monotonic() - started)
        done.set()
        await tick
        return took, ticks

    try:
        took, ticks = run(scenario)
        assert proxy.mode == "blackhole", "negative control: Redis was silent throughout"
    finally:
        proxy.set("forward")
    assert all(seconds < 1 + 1 for seconds in took), took
    assert ticks >= 10, "the loop ran while the acquires waited for Redis"


@pytest.mark.slow
def test_an_async_waiter_whose_redis_goes_away_raises_and_can_wait_again(server, rconn):
    """Redis killed while a task waits in line: the task gets LockBackendUnavailable (never
    "busy"); once Redis is back the same lock waits again and gets a larger fence."""
    from django_joblock import LockBackendUnavailable

    async def scenario() -> tuple[object, AsyncLock, AsyncLock]:
        holder = alock("restart:1", ttl=30)
        assert await holder.aacquire()
        waiter = alock("restart:1", ttl=30, wait=60)
        waiting = asyncio.create_task(waiter.aacquire())
        while not rconn.zcard(holder.keys.queue):
            await asyncio.sleep(0.01)
        server.kill()
        try:
            outcome: object = await asyncio.wait_for(waiting, 30)
        except LockBackendUnavailable as exc:
            outcome = exc
        server.start()
        assert await waiter.aacquire(wait=10)
        return outcome, holder, waiter

    outcome, holder, waiter = run(scenario)
    assert isinstance(outcome, LockBackendUnavailable), outcome
    assert waiter.fence is not None and holder.fence is not None
    assert waiter.fence > holder.fence, "the fence still increases across the restart"

    async def release_both() -> tuple[bool, bool]:
        return await waiter.arelease(), await holder.arelease()

    assert run(release_both) == (True, False)


def test_an_aacquire_whose_lock_acquired_receiver_raises_gives_the_lock_back(rconn):
    """Review bug: a ``lock_acquired`` receiver's exception came out of ``aacquire()`` with the
    lock held and renewed (the give-back covered only a lock not yet recorded as held): the
    ``async with`` block was never entered, so nothing released it until the TTL."""
    from django_joblock import Lock
    from django_joblock.locks.renewal import renewer
    from django_joblock.signals import lock_acquired

    def broken(sender, lock, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("receiver bug")

    async def scenario() -> bool:
        with pytest.raises(RuntimeError, match="receiver bug"):
            async with alock("receiver:2", ttl=30):
                pytest.fail("the block must not run")
        lock_acquired.disconnect(broken, sender=Lock)
        newcomer = alock("receiver:2", ttl=30, wait=0)
        free = await newcomer.aacquire()
        if free:
            await newcomer.arelease()
        return free

    lock_acquired.connect(broken, sender=Lock)
    try:
        free = run(scenario)
    finally:
        lock_acquired.disconnect(broken, sender=Lock)
    assert free is True, "given back: a newcomer gets it at once"
    assert all(held.resource != "receiver:2" for held in renewer().held_locks())


def test_loop_after_loop_keeps_no_connections_of_closed_loops(rconn):
    """Review bug: each event loop's clients were cached in a weak dictionary whose values (the
    connections) refer to the loop, so no loop was ever dropped: every ``asyncio.run()`` (and
    every ``async def`` job's ``async_to_sync`` loop) left its loop and a Redis connection
    open for the life of the process."""
    import gc

    def connected() -> int:
        gc.collect()
        return int(rconn.info("clients")["connected_clients"])

    async def scenario(number: int) -> None:
        async with alock(f"loops:{number}", ttl=5):
            pass

    run(lambda: scenario(0))  # the sync clients of the test, made once
    before = connected()
    for number in range(1, 21):
        run(lambda: scenario(number))  # noqa: B023 - called at once
    grown = connected() - before
    assert grown <= 1, f"{grown} connections of closed loops left open"


@pytest.mark.slow  # the proxy
def test_an_arelease_cancelled_before_its_reply_leaves_the_lock_not_held(proxy, rconn):
    """Review bug: an ``arelease()`` cancelled (``asyncio.timeout``) while its reply was on its
    way, the lock already handed to the waiter, left the object HELD, its renewal stopped:
    ``held`` said it still held the waiter's lock, and a second release reported a loss."""
    harness.load_scripts(rconn)
    losses: list[str] = []

    async def scenario() -> tuple[bool, bool, bool, bool]:
        holder = alock(
            "cancelled:3",
            ttl=30,
            heartbeat=False,
            cache="proxied",
            on_lost=lambda held, why: losses.append(why),
        )
        assert await holder.aacquire()
        waiter = alock("cancelled:3", ttl=30, wait=30)
        waiting = asyncio.create_task(waiter.aacquire())
        while rconn.zcard(holder.keys.queue) != 1:
            await asyncio.sleep(0.005)
        proxy.set("delay", 0.5)  # each way: handed over ~0.5 s before the reply comes
        releasing = asyncio.create_task(holder.arelease())
        while rconn.hget(holder.key, "token") != waiter.token.encode():
            await asyncio.sleep(0.005)
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        proxy.set("forward")
        got = await waiting
        still_held = holder.held
        again = await holder.arelease()
        waiter_kept = rconn.hget(waiter.key, "token") == waiter.token.encode()
        await waiter.arelease()
        return got, still_held, again, waiter_kept

    try:
        got, still_held, again, waiter_kept = run(scenario)
    finally:
        proxy.set("forward")
    assert got is True, "negative control: handed over before the cancellation"
    assert still_held is False, "the lock is the waiter's now"
    assert again is False and losses == [], "nothing left to release, and no loss"
    assert waiter_kept
