"""The lock core under real conditions: Redis restarts, lost replies, capped pools,
bad numbers, fork(), other contexts, forgotten locks, loss at exit, slow replies, max_hold,
SIGUSR2, clock steps and introspection. Real Redis throughout; faults injected for real."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.cache import caches
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from redis.exceptions import ResponseError

from django_joblock import (
    JoblockConfigError,
    LockBackendUnavailable,
    LockError,
    LockLost,
    current_lock,
    lock,
    lock_info,
    locked_job,
)
from django_joblock.locks import scripts
from django_joblock.locks.renewal import renewer
from tests import harness
from tests.droppers import ReplyDropper
from tests.harness import expire_now, load_scripts, wait_expired, wait_for


def _cache(location: str, **options: Any) -> dict[str, Any]:
    """A django-redis cache. django-redis shares one pool per URL in a process, so a cache that
    needs its own pool options gets a URL of its own (a query argument redis-py accepts)."""
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": location,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5, **options},
    }


def _port() -> int:
    return int(harness.redis_url().rsplit(":", 1)[1].split("/")[0])


# -- 1. Redis restart; an acquire whose reply was lost -------------------------------------
@pytest.mark.slow
def test_first_acquire_after_a_redis_restart_reconnects(server, rconn):
    before = lock("restart:1", ttl=5)
    assert before.acquire()  # the lock path's connection is open, and now idle
    run_id = rconn.info("server")["run_id"]
    server.restart()
    assert server.client().info("server")["run_id"] != run_id, "negative control: restarted"
    assert server.client().exists(before.key) == 0, "negative control: the restart lost it"
    after = lock("restart:2", ttl=5)
    assert after.acquire(), "the first acquire after the restart must reconnect and succeed"
    assert after.release()


def test_an_acquire_whose_reply_was_lost_is_retried_and_gets_the_same_fence(settings, rconn):
    load_scripts(rconn)  # the dropped reply must be the acquire's, not a NOSCRIPT
    dropper = ReplyDropper(_port())
    settings.CACHES = {**settings.CACHES, "dropper": _cache(dropper.url)}
    try:
        held = lock("lost-reply:1", ttl=30, cache="dropper")
        dropper.armed = True
        assert held.acquire(), "a connection lost after the acquire ran is retried once"
        assert len(dropper.dropped) == 1, "negative control: one reply was really lost"
        lost_reply = dropper.dropped[0].split(b"\r\n")[0]  # the acquire's, then the index's
        assert lost_reply.startswith(b":") and int(lost_reply[1:]) == held.fence, (
            "the retry got the fence of the acquire that ran, not a second acquisition"
        )
        assert rconn.hget(held.key, "token").decode() == held.token
        assert 0 < rconn.pttl(held.key) <= 30_000
        assert held.release()
    finally:
        dropper.close()


def test_a_release_whose_hand_over_reply_was_lost_is_still_a_release(settings, rconn):
    """Regression (review): the release that handed the lock to the first waiter ran, its reply
    was lost, and the release sent again found the waiter's token: the holder was told its lock
    had been taken by another owner (False, marked lost, LockLost from a ``with`` block)."""
    load_scripts(rconn)
    waiter = lock("lost-reply:3", ttl=30, wait=30)
    dropper = ReplyDropper(_port(), marker=waiter.owner.encode())  # in the hand-over only
    settings.CACHES = {**settings.CACHES, "dropper": _cache(dropper.url)}
    got: list[bool] = []
    try:
        holder = lock("lost-reply:3", ttl=30, cache="dropper")
        assert holder.acquire()
        thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
        thread.start()
        assert wait_for(lambda: rconn.zcard(holder.keys.queue) == 1, 10)
        dropper.armed = True
        assert holder.release() is True, holder.lost_reason
        assert not holder.lost
        assert len(dropper.dropped) == 1, "negative control: the hand-over's reply was lost"
        thread.join(30)
        assert got == [True] and waiter.release()
    finally:
        dropper.close()


@pytest.mark.slow
@pytest.mark.parametrize("reused", [False, True], ids=["new", "reused (regression, review)"])
def test_an_acquire_that_timed_out_can_be_repeated_by_the_same_lock(settings, proxy, rconn, reused):
    """A reused Lock (acquired and released before) took a fresh token on every acquire, the
    repeated one too: its own lock refused it, busy until the TTL."""
    load_scripts(rconn)
    settings.CACHES = {**settings.CACHES, "slow": _cache(harness.proxy_url())}
    settings.JOBLOCK = {"REDIS_TIMEOUT": 0.3}  # the locks' own socket timeout
    warm = lock("lost-reply:warm", ttl=30, cache="slow")
    assert warm.acquire() and warm.release()  # connections made before the fault
    held = lock("lost-reply:2", ttl=30, cache="slow")
    if reused:
        assert held.acquire() and held.release()
    proxy.set("delay", 0.5)  # the server runs the acquire after the client gave up
    with pytest.raises(LockBackendUnavailable):
        held.acquire()
    assert wait_for(lambda: rconn.hget(held.key, "token") == held.token.encode(), 3.0), (
        "negative control: the acquire did run on the server after the timeout"
    )
    fence = int(rconn.hget(held.key, "fence"))
    proxy.set("forward")
    assert held.acquire(), "the same Lock retrying finds its own token: acquired"
    assert held.fence == fence
    assert held.release()


@pytest.mark.slow
def test_an_unresponsive_redis_bounds_every_acquire_without_socket_timeouts(settings, proxy):
    """The README's CACHES set no SOCKET_TIMEOUT: on redis-py 5.0 an acquire against a Redis
    that stopped answering had no time limit, and an interrupted waiting acquire blocked again
    in its clean-up. The locks' own client bounds each by REDIS_TIMEOUT (1 s here)."""
    readme = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": harness.proxy_url()}
    settings.CACHES = {**settings.CACHES, "readme": readme}
    settings.JOBLOCK = {"REDIS_TIMEOUT": 1}
    holder = lock("silent:1", ttl=30, cache="readme")
    assert holder.acquire()  # connections made before the fault
    threading.Timer(0.5, lambda: proxy.set("blackhole")).start()
    interrupted_at = math.nan

    def interrupt(*_args: Any) -> None:
        nonlocal interrupted_at
        interrupted_at = time.monotonic()
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 1.5)  # in the wait, with Redis silent since 0.5 s
    try:
        with pytest.raises(KeyboardInterrupt):
            lock("silent:1", ttl=30, cache="readme").acquire(wait=30)
        assert time.monotonic() - interrupted_at < 1 + 2, "its clean-up is bounded too"
        started = time.monotonic()
        for wait in (0, 3):  # one try, and a waiting acquire
            with pytest.raises(LockBackendUnavailable):
                lock("silent:2", ttl=30, cache="readme").acquire(wait=wait)
        assert time.monotonic() - started < 2 * (1 + 1), "each within REDIS_TIMEOUT"
        assert proxy.mode == "blackhole", "negative control: Redis was silent throughout"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        proxy.set("forward")


# -- 2. Capped connection pool ---------------------------------------------------------------
def test_threads_taking_locks_never_starve_a_capped_pool(settings, rconn):
    settings.CACHES = {
        **settings.CACHES,
        "capped": _cache(
            f"{harness.redis_url()}?max_connections=4",
            CONNECTION_POOL_KWARGS={"max_connections": 4},
        ),
    }
    turn = [threading.Event() for _ in range(7)]
    done = threading.Event()
    results: dict[int, str] = {}

    def worker(index: int) -> None:
        turn[index].wait(10)
        try:
            held = lock(f"capped:{index}", ttl=10, cache="capped")
            results[index] = "held" if held.acquire() else "busy"
        except Exception as exc:
            results[index] = repr(exc)
            held = None
        turn[index + 1].set()
        done.wait(10)
        if held is not None and held.held:
            held.release()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    turn[0].set()
    assert turn[6].wait(10)
    try:
        # All six threads are alive and hold their locks; the cache still has its pool.
        assert results == dict.fromkeys(range(6), "held"), results
        cache = caches["capped"]
        cache.set("capped-probe", 1)
        assert cache.get("capped-probe") == 1
        pool = cache.client.get_client(write=True).connection_pool
        assert len(pool._in_use_connections) == 0, "no lock connection is kept out of the pool"
    finally:
        done.set()
        for thread in threads:
            thread.join(10)


# -- 3. Numbers: finite, in range, checked before anything is written -------------------------
BAD_NUMBERS = [math.nan, math.inf, -math.inf, 1e300, 10**400, -1]


@pytest.mark.parametrize("value", BAD_NUMBERS)
@pytest.mark.parametrize("argument", ["ttl", "wait", "max_hold"])
def test_lock_arguments_must_be_finite_and_in_range(argument, value, rconn):
    if argument == "wait" and value == math.inf:
        return  # "wait forever": see the test below
    with pytest.raises(ValueError, match=argument):
        lock("numbers:1", **{argument: value})
    assert rconn.dbsize() == 0, "nothing may be written for a refused lock"


def test_wait_forever_waits_until_the_lock_is_free_and_can_be_interrupted(rconn):
    holder = lock("numbers:3", ttl=5)
    assert holder.acquire()
    letting_go = threading.Timer(0.5, holder.release)
    letting_go.start()
    waiter = lock("numbers:3", ttl=5, wait=math.inf)
    assert waiter.acquire(), "wait=math.inf waits until the holder lets go"
    assert waiter.release()
    letting_go.join()  # its release() may still be logging: a Lock is one thread's at a time
    assert holder.acquire()

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            lock("numbers:3", ttl=5).acquire(wait=math.inf)
    finally:
        signal.signal(signal.SIGALRM, previous)
    # Negative control and clean-up: the interrupted waiter left the line.
    assert rconn.zcard("joblock:{numbers:3}:queue") == 0
    assert holder.release()


@pytest.mark.parametrize("argument", ["ttl", "wait", "max_hold"])
def test_a_number_too_long_to_write_is_refused_by_its_size(argument, rconn):
    """Review bug: the message wrote the refused value in full, and Python refuses to write an
    int of over 4300 digits: the ValueError said that instead of naming the argument."""
    with pytest.raises(ValueError, match=f"{argument} .*got an int of 16610 bits"):
        lock("numbers:1", **{argument: 10**5000})
    assert rconn.dbsize() == 0


@pytest.mark.parametrize("value", [v for v in BAD_NUMBERS if v != math.inf])
def test_acquire_wait_must_be_finite(value, rconn):
    held = lock("numbers:2", ttl=5)
    with pytest.raises(ValueError, match="wait"):
        held.acquire(wait=value)
    assert rconn.dbsize() == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, 1e300])
@pytest.mark.parametrize("argument", ["ttl", "max_wait"])
def test_locked_job_numbers_must_be_finite(argument, value):
    with pytest.raises(ValueError, match=argument):
        locked_job("default", lock="numbers:{n}", **{argument: value})


@pytest.mark.parametrize(
    "joblock, key",
    [
        ({"LOCK_TTL": 1e300}, "LOCK_TTL"),
        ({"LOCK_TTL": math.inf}, "LOCK_TTL"),
        ({"HEARTBEAT_INTERVAL": math.nan}, "HEARTBEAT_INTERVAL"),
        ({"HEARTBEAT_INTERVAL": 0.001}, "HEARTBEAT_INTERVAL"),  # 1,000 renewals/s per lock
        ({"MAX_HOLD": math.nan}, "MAX_HOLD"),
        ({"ACQUIRE_WAIT": math.inf}, "ACQUIRE_WAIT"),
        ({"REQUEUE_MAX_WAIT": math.nan}, "REQUEUE_MAX_WAIT"),
        ({"IDEMPOTENCY_TTL": math.inf}, "IDEMPOTENCY_TTL"),
        ({"REDIS_TIMEOUT": math.nan}, "REDIS_TIMEOUT"),
        ({"METRICS_RETENTION": 0.5}, "METRICS_RETENTION"),
        ({"REQUEUE_BACKOFF": {"factor": math.inf}}, "REQUEUE_BACKOFF"),
        ({"ALERTS": {"WINDOW": math.nan}}, "ALERTS"),
        ({"ALERTS": {"CONTENTION_RATIO": 2}}, "ALERTS"),
    ],
)
@pytest.mark.django_db
def test_settings_numbers_must_be_finite_and_in_range(settings, joblock, key):
    settings.JOBLOCK = joblock
    with pytest.raises(SystemCheckError, match=rf"django_joblock\.E003.*{key}"):
        call_command("check")
    with pytest.raises(JoblockConfigError, match=key):
        lock("numbers:settings")


@pytest.mark.parametrize("ttl_ms", ["1e+300", "nan", "inf", "abc", "0", "-5", "1.5"])
def test_the_acquire_script_refuses_a_bad_ttl_before_writing(ttl_ms, rconn):
    key, fence_key = "joblock:{numbers:3}:lock", "joblock:{numbers:3}:fence"
    args = ["token", ttl_ms, 86_400_000, "host", 1, "", "", ""]
    with pytest.raises(ResponseError, match="ttl"):
        scripts.ACQUIRE(rconn, [key, fence_key], args)
    assert rconn.exists(key) == 0, "the script must not leave a lock hash (without expiry)"


def test_the_renew_script_refuses_a_bad_ttl_before_writing(rconn):
    held = lock("numbers:4", ttl=5, heartbeat=False)
    assert held.acquire()
    before = rconn.hgetall(held.key)
    with pytest.raises(ResponseError, match="ttl"):
        scripts.RENEW(rconn, [held.key], [held.token, "1e+300"])
    assert rconn.hgetall(held.key) == before
    assert 0 < rconn.pttl(held.key) <= 5000
    held.release()


def test_a_lock_key_found_without_expiry_gets_one(rconn):
    key = "joblock:{numbers:5}:lock"
    rconn.hset(key, mapping={"token": "left-by-a-bug", "fence": 1})
    assert rconn.pttl(key) == -1
    assert lock("numbers:5", ttl=3).acquire() is False
    assert 0 < rconn.pttl(key) <= 3000, "a lock without expiry must not block forever"


# -- 4. fork() ---------------------------------------------------------------------------------
def _child_leaves(held: Any) -> None:
    """In the forked child: release / renew / ensure_held / leave the block; never returns."""
    code = 10
    try:
        ok = held.release() is False and held.renew() is False and not held.held
        try:
            held.ensure_held()
            ok = False
        except LockLost as exc:
            ok = ok and "forked child" in str(exc)
        held.__exit__(None, None, None)  # leaving the with block in the child
        code = 0 if ok else 1
    except BaseException:
        code = 2
    finally:
        os._exit(code)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_never_releases_its_parents_lock(rconn):
    with lock("fork:1", ttl=5) as held:
        pid = os.fork()
        if pid == 0:
            _child_leaves(held)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0, f"child saw the wrong behaviour (code {status})"
        assert rconn.hget(held.key, "token").decode() == held.token, (
            "the child released the parent's lock"
        )
        assert held.held
        assert lock("fork:1", ttl=5).acquire() is False, "nobody else may get in"
    assert rconn.exists(held.key) == 0, "the parent's own exit still releases it"


@pytest.mark.parametrize("wait", [0, 1])
def test_one_lock_object_acquired_by_two_threads_at_once_is_held_once(wait, rconn):
    """Two threads calling acquire() on one Lock object at the same instant: one gets it,
    the other is refused with LockError (it used to be told True too, holding nothing of its
    own). Many rounds, so the calls really overlap."""
    outcomes: set[tuple[object, ...]] = set()
    for round_ in range(40):
        shared = lock(f"threads:{round_}", ttl=5, wait=wait)
        results: list[object] = []
        start = threading.Barrier(2)

        def take(shared: Any = shared, results: list[object] = results, start: Any = start) -> None:
            start.wait()
            try:
                results.append(shared.acquire())
            except LockError as exc:
                results.append(LockError)
                assert "Lock object" in str(exc), exc
                assert exc.resource == shared.resource

        threads = [threading.Thread(target=take) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        outcomes.add(tuple(sorted(results, key=str)))
        assert shared.release() is True
        assert rconn.exists(shared.key) == 0
    assert outcomes == {(LockError, True)}, outcomes


# -- 5. Leaving the block in another context ---------------------------------------------------
def test_leaving_the_block_in_another_context_still_releases(rconn):
    held = lock("context:1", ttl=5)

    async def scenario() -> Any:
        await sync_to_async(held.__enter__)()
        assert current_lock() is held
        assert rconn.exists(held.key)
        await sync_to_async(held.__exit__)(None, None, None)
        return current_lock()

    assert asyncio.run(scenario()) is None
    assert rconn.exists(held.key) == 0, "leaving in another context must still release"
    assert held not in renewer().held_locks(), "and stop the heartbeat"


# -- 6. Forgotten locks ----------------------------------------------------------------------
def _take_and_forget(resource: str) -> str:
    held = lock(resource, ttl=1.0)
    assert held.acquire()
    return held.key


def test_a_lock_nobody_references_stops_being_renewed_and_expires(rconn, caplog):
    kept = lock("forgotten:kept", ttl=1.0)
    assert kept.acquire()
    key = _take_and_forget("forgotten:dropped")
    gc.collect()
    assert wait_for(lambda: rconn.exists(key) == 0, 5.0), "a forgotten lock is renewed forever"
    # Negative control: the lock still referenced was renewed through the same time.
    assert kept.held and rconn.hget(kept.key, "token").decode() == kept.token
    assert [held.resource for held in renewer().held_locks()] == ["forgotten:kept"]
    assert any(
        "dropped while held" in r.getMessage() and key in r.getMessage() for r in caplog.records
    )
    assert kept.release()


# -- 7. Loss is reported when leaving the block --------------------------------------------------
def test_leaving_the_block_after_the_lock_expired_raises_lock_lost(rconn):
    with pytest.raises(LockLost) as info:
        with lock("exit:1", ttl=0.3, heartbeat=False) as held:
            wait_expired(rconn, held.key, held.ttl)
    assert info.value.resource == "exit:1"
    assert held.lost and held.lost_reason, "lost and its reason stay visible after the exit"


def test_leaving_the_block_after_another_owner_took_it_raises_lock_lost(rconn):
    with pytest.raises(LockLost, match="another owner"):
        with lock("exit:2", ttl=5) as held:
            rconn.hset(held.key, "token", "someone-else")
    assert held.lost and held.lost_reason == "taken by another owner"
    assert rconn.hget(held.key, "token") == b"someone-else", "the other owner's lock stays"


def test_the_blocks_own_exception_wins_over_lock_lost(rconn):
    with pytest.raises(KeyError):
        with lock("exit:3", ttl=0.3, heartbeat=False) as held:
            wait_expired(rconn, held.key, held.ttl)
            raise KeyError("the block's own error")


# -- 8. Smaller ones -------------------------------------------------------------------------
@pytest.mark.slow
def test_an_acquire_answered_after_the_ttl_ran_out_is_not_acquired(proxy, rconn):
    load_scripts(rconn)
    held = lock("late:1", ttl=0.2, cache="proxied")
    proxy.set("delay", 0.3)  # each way: the reply comes ~0.6 s after sending
    with pytest.raises(LockBackendUnavailable, match="validity"):
        held.acquire()
    proxy.set("forward")
    assert not held.held
    # Negative control: the server did grant it (its fence counter moved).
    assert rconn.exists("joblock:{late:1}:fence")


def test_renew_by_the_holder_stops_at_max_hold(rconn):
    held = lock("maxhold:1", ttl=2.0, max_hold=1.5, heartbeat=False)
    assert held.acquire()
    acquired = time.monotonic()  # max_hold counts from before the acquire was sent
    assert held.renew() is True, "negative control: before max_hold a renew works"
    assert held.max_hold is not None
    time.sleep(max(0.0, acquired + held.max_hold - time.monotonic()) + 0.1)
    assert held.renew() is False, "past max_hold the holder cannot keep renewing"
    wait_expired(rconn, held.key, held.ttl)  # the lock runs out


# atomic=False: these tests are about signals and run without database access (pytest-django
# refuses it to tests without a django_db mark; a job transaction would need it).
@locked_job("default", lock="signal:{n}", ttl=2, atomic=False)
def _inline_job(n: int, expire: bool = False) -> Any:
    """Reports the SIGUSR2 handler seen inside the job; with ``expire``, loses its lock."""
    seen = signal.getsignal(signal.SIGUSR2)
    if expire:
        held = current_lock()
        assert held is not None
        threading.Timer(0.2, expire_now, args=(_redis(), held.key)).start()
        time.sleep(3)  # interrupted by the abort
    return seen


def _redis() -> Any:
    import redis

    return redis.Redis.from_url(harness.redis_url())


@pytest.fixture
def own_sigusr2() -> Iterator[list[int]]:
    calls: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        yield calls
        assert signal.getsignal(signal.SIGUSR2) is handler, "SIGUSR2 handler not restored"
    finally:
        signal.signal(signal.SIGUSR2, previous)


@pytest.mark.django_db  # the job body runs in a transaction
def test_an_inline_locked_job_restores_the_sigusr2_handler(own_sigusr2):
    seen = _inline_job(1)
    assert seen is not signal.getsignal(signal.SIGUSR2), "negative control: the job armed it"
    assert not own_sigusr2


@pytest.mark.django_db  # the job body runs in a transaction
def test_the_sigusr2_handler_is_restored_after_an_abort(own_sigusr2):
    with pytest.raises(LockLost, match="aborted"):
        _inline_job(2, expire=True)
    time.sleep(0.2)  # a late signal would have reached the restored handler by now
    assert not own_sigusr2, "our abort signal must not reach the user's handler"


def test_an_abort_signal_still_pending_when_the_job_ends_never_reaches_the_restored_handler(
    own_sigusr2,
):
    """The renewal thread sends the abort just before the job ends, and the kernel has not yet
    delivered it to the main thread when the job's handler is restored (modelled by blocking
    SIGUSR2 in the main thread). The pending signal is drained before the restore: it never
    reaches the process's own handler (nor SIG_DFL, which would kill a work horse)."""
    import threading

    from django_joblock.jobs.abort import ABORT_SIGNAL, Abort

    held = lock("abort:pending", ttl=5)
    signal.pthread_sigmask(signal.SIG_BLOCK, {ABORT_SIGNAL})
    try:
        with Abort() as armed:
            sender = threading.Thread(target=armed.lost, args=(held, "expired"))
            sender.start()
            sender.join()
            assert armed.sent and ABORT_SIGNAL in signal.sigpending(), "negative control"
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {ABORT_SIGNAL})
    for _ in range(1000):  # the interpreter runs a pending Python handler between bytecodes
        pass
    assert ABORT_SIGNAL not in signal.sigpending()
    assert not own_sigusr2, "the late abort signal reached the process's own handler"


def test_a_forward_clock_step_shows_as_early_expiry_and_is_reported(rconn):
    # A forward step of the Redis server clock expires keys early; the holder's monotonic
    # view cannot see it. Simulated by expiring the key on the server, which is what the
    # step does: the next renewal finds it gone, and leaving the block says so.
    with pytest.raises(LockLost, match="expired"):
        with lock("clock:1", ttl=3) as held:
            expire_now(rconn, held.key)
            assert wait_for(lambda: held.lost, held.ttl), "found at the next renewal (ttl/3)"


# -- 9. Introspection --------------------------------------------------------------------------
def test_lock_info_says_who_holds_a_resource_without_touching_it(rconn):
    assert lock_info("info:1") is None
    held = lock("info:1", ttl=5, heartbeat=False)
    assert held.acquire()
    rconn.pexpire(held.key, 4000)
    info = lock_info("info:1")
    assert info is not None
    assert (info.resource, info.owner, info.fence) == ("info:1", held.owner, held.fence)
    assert info.pid == os.getpid() and info.host and info.ttl == 5
    assert 0 < info.expires_in <= 4 and info.renewals == 0
    assert info.acquired_at is not None and info.acquired_at.tzinfo is not None
    assert rconn.pttl(held.key) <= 4000, "reading must not extend the lock"
    assert held.token not in repr(info), "the token itself is never exposed"
    held.release()
    assert lock_info("info:1") is None


def test_owned_checks_with_the_server_without_extending(rconn):
    held = lock("info:2", ttl=5, heartbeat=False)
    assert held.owned() is False, "not acquired yet"
    assert held.acquire()
    rconn.pexpire(held.key, 4000)
    assert held.owned() is True
    assert rconn.pttl(held.key) <= 4000, "owned() must not extend the lock"
    rconn.hset(held.key, "token", "someone-else")
    assert held.owned() is False
    assert held.lost and held.lost_reason == "taken by another owner"


class _Interrupted(BaseException):
    """What a signal handler raises in the main thread, as ``KeyboardInterrupt`` would."""


def _interrupted_when(condition: Any, call: Any) -> bool:
    """Run ``call()`` in this (main) thread and interrupt it with a signal once ``condition()``
    holds (polled from another thread): :class:`_Interrupted` must come out of it. Returns
    whether the condition was met (the negative control: the interruption came then)."""
    met: list[bool] = []

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    def watch() -> None:
        met.append(wait_for(condition, 10))
        if met[0]:
            signal.pthread_kill(main, signal.SIGUSR1)

    main = threading.get_ident()
    previous = signal.signal(signal.SIGUSR1, interrupt)
    watcher = threading.Thread(target=watch, daemon=True)
    try:
        watcher.start()
        with pytest.raises(_Interrupted):
            call()
    finally:
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)
    return met == [True]


def test_an_acquire_interrupted_after_it_got_the_lock_gives_it_back(settings, rconn):
    """Review bug (the sync twin of a cancelled ``aacquire``): with ``REPLICA_ACKS`` (no replica
    here) a one-try acquire that got the lock waits for a replica's ack; a ``KeyboardInterrupt``
    there left the lock held, by nobody, until its TTL."""
    acked = {"REPLICA_ACKS": 1, "REPLICA_ACK_TIMEOUT": 5, "REDIS_TIMEOUT": 10}
    settings.JOBLOCK = {**settings.JOBLOCK, **acked}
    trying = lock("interrupted:1", ttl=30, heartbeat=False)

    def blocked_in_wait() -> bool:  # the replica WAIT after the ACQUIRE
        return any(c["cmd"] == "wait" for c in rconn.client_list())

    assert _interrupted_when(blocked_in_wait, lambda: trying.acquire(wait=0))
    # The replica WAIT follows a granted ACQUIRE only, which moved the resource's fence.
    assert rconn.exists("joblock:{interrupted:1}:fence"), "negative control: it got the lock"
    assert rconn.hget(trying.key, "token") is None, "given back"
    assert not trying.held and not trying.lost
    settings.JOBLOCK = {**settings.JOBLOCK, "REPLICA_ACKS": 0}
    newcomer = lock("interrupted:1", ttl=30, wait=0)
    assert newcomer.acquire(), "a newcomer gets it at once"
    newcomer.release()
    assert trying.acquire(wait=0), "the interrupted object can acquire again"
    trying.release()


def test_an_acquire_whose_lock_acquired_receiver_raises_gives_the_lock_back(rconn):
    """Review bug: a ``lock_acquired`` receiver's exception came out of ``acquire()`` (as Django's
    ``Signal.send`` raises it) with the lock held and renewed: a ``with`` block was never
    entered, so nothing released it; the resource stayed busy until the TTL."""
    from django_joblock import Lock
    from django_joblock.signals import lock_acquired

    def broken(sender, lock, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("receiver bug")

    lock_acquired.connect(broken, sender=Lock)
    try:
        with pytest.raises(RuntimeError, match="receiver bug"), lock("receiver:1", ttl=30):
            pytest.fail("the block must not run")
    finally:
        lock_acquired.disconnect(broken, sender=Lock)
    assert rconn.exists("joblock:{receiver:1}:lock") == 0, "given back at once"
    with lock("receiver:1", ttl=30, wait=0) as newcomer:
        assert newcomer.held
    assert all(held.resource != "receiver:1" for held in renewer().held_locks())


@pytest.mark.slow  # the proxy
def test_a_one_try_acquire_interrupted_before_its_reply_gives_the_lock_back(proxy, rconn):
    """The same, earlier: interrupted while the ACQUIRE's reply was on its way (the server had
    run it), the acquire gives back the lock it may have got. A Redis error there does not:
    the same object's repeat recognises its token (test_an_acquire_whose_reply_was_lost...)."""
    load_scripts(rconn)
    trying = lock("interrupted:2", ttl=30, cache="proxied")
    proxy.set("delay", 0.5)  # each way: the lock is granted ~0.5 s before the reply comes

    def granted() -> bool:
        return bool(rconn.hget(trying.key, "token") == trying.token.encode())

    try:
        got = _interrupted_when(granted, lambda: trying.acquire(wait=0))
    finally:
        proxy.set("forward")
    assert got, "negative control: the server had granted it when interrupted"
    assert rconn.hget(trying.key, "token") is None, "given back"
    assert lock("interrupted:2", ttl=30, wait=0).acquire(), "a newcomer gets it at once"


@pytest.mark.slow  # the proxy
def test_a_release_interrupted_before_its_reply_leaves_the_lock_not_held(proxy, rconn):
    """Review bug: a ``release()`` interrupted while its reply was on its way (the server had
    run it: the lock handed to the waiter) stopped the renewal but left the object HELD:
    ``held`` and ``ensure_held()`` said it still held a lock that was the waiter's, and a second
    ``release()`` reported it "taken by another owner" (on_lost, LockLost's warning)."""
    load_scripts(rconn)
    losses: list[str] = []
    holder = lock(
        "interrupted:3",
        ttl=30,
        heartbeat=False,
        cache="proxied",
        on_lost=lambda held, why: losses.append(why),
    )
    assert holder.acquire()
    waiter = lock("interrupted:3", ttl=30, wait=30)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
    thread.start()
    assert wait_for(lambda: rconn.zcard(holder.keys.queue) == 1, 10), "the waiter is in line"
    proxy.set("delay", 0.5)  # each way: the lock is handed over ~0.5 s before the reply comes

    def to_waiter() -> bool:
        return bool(rconn.hget(holder.key, "token") == waiter.token.encode())

    try:
        handed = _interrupted_when(to_waiter, holder.release)
    finally:
        proxy.set("forward")
    thread.join(30)
    assert handed and got == [True], "negative control: handed over when interrupted"
    assert waiter.held
    assert not holder.held, "the lock is the waiter's now"
    with pytest.raises(LockLost):
        holder.ensure_held()
    assert holder.release() is False, "nothing left to release"
    assert losses == [], "the holder's own release is no loss"
    assert rconn.hget(waiter.key, "token") == waiter.token.encode(), "the waiter's, untouched"
    assert waiter.release()
    assert holder.acquire(wait=0), "the interrupted object can acquire again"
    holder.release()
