"""The renewal thread keeps long holds alive and notices loss (real Redis, real faults)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Any

import pytest

from django_joblock import LockState, lock
from django_joblock.locks.renewal import renewer
from django_joblock.signals import lock_lost
from tests.harness import expire_now, wait_expired, wait_for
from tests.procs.load import BusyCores

pytestmark = pytest.mark.slow  # starts processes or servers


class LostRecorder:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""
        self.at = 0.0

    def __call__(self, held, reason):  # type: ignore[no-untyped-def]
        self.reason, self.at = reason, time.monotonic()
        self.event.set()


# TTL 2 s: the renewal thread has 4/3 s (TTL minus one heartbeat interval) of slack before a
# lock expires, ample on a loaded 2-core machine.
HEARTBEAT_TTL = 2.0


def test_heartbeat_keeps_the_lock_through_5x_its_ttl(rconn):
    held = lock("report:1", ttl=HEARTBEAT_TTL)
    assert held.acquire()
    end = time.monotonic() + 5 * held.ttl
    while time.monotonic() < end:
        assert rconn.hget(held.key, "token").decode() == held.token
        assert held.held
        assert not lock("report:1", ttl=1).acquire(), "nobody else may get it meanwhile"
        time.sleep(0.1)
    assert int(rconn.hget(held.key, "renewals")) >= 5
    assert held.release()


def test_without_heartbeat_the_same_hold_loses_the_lock(rconn):
    """Negative control for the test above."""
    held = lock("report:1", ttl=HEARTBEAT_TTL, heartbeat=False)
    assert held.acquire()
    wait_expired(rconn, held.key, held.ttl)
    assert held.lost


def test_server_side_expiry_is_detected_within_one_interval(rconn):
    recorder = LostRecorder()
    held = lock("report:2", ttl=1.5, on_lost=recorder)
    assert held.acquire()
    expire_now(rconn, held.key)
    fault_at = time.monotonic()
    assert recorder.event.wait(held.heartbeat_interval + 0.5), "loss not noticed"
    assert recorder.at - fault_at <= held.heartbeat_interval + 0.5
    assert recorder.reason == "expired"
    assert held.lost and held.state is LockState.LOST and not held.held


def test_a_callback_calling_sys_exit_does_not_stop_the_renewal_of_other_locks(rconn, caplog):
    """``on_lost`` runs in the renewal thread when the thread finds the loss; a ``sys.exit()``
    there raised ``SystemExit``, which ended the thread silently: every other lock of the
    process went unrenewed (and expired) until the process's next acquire, and the other locks
    lost in the same renewal round trip were never announced."""
    called: list[str] = []

    def leave(held, reason):  # type: ignore[no-untyped-def]
        called.append(held.resource)
        sys.exit(1)

    kept = lock("report:kept", ttl=HEARTBEAT_TTL)
    assert kept.acquire()
    doomed = [lock(f"report:doomed{i}", ttl=1.5, on_lost=leave) for i in range(2)]
    for held in doomed:
        assert held.acquire()
    for held in doomed:  # both found lost by one renewal round trip
        expire_now(rconn, held.key)
    # The fault happened: the thread found the losses and a callback raised SystemExit there.
    assert wait_for(lambda: len(called) == 2, doomed[0].heartbeat_interval + 3.0), called
    assert sorted(called) == ["report:doomed0", "report:doomed1"]
    assert wait_for(lambda: "renewals go on" in caplog.text, 5.0), "the exit was not logged"
    end = time.monotonic() + 3 * kept.ttl
    while time.monotonic() < end:
        assert rconn.hget(kept.key, "token") == kept.token.encode(), "kept lock not renewed"
        time.sleep(0.1)
    assert kept.held
    assert kept.release()


def test_replaced_token_is_detected_and_signalled(rconn):
    recorder = LostRecorder()
    signalled = []

    def receiver(sender, lock, reason, **kwargs):  # type: ignore[no-untyped-def]
        signalled.append((lock, reason))

    lock_lost.connect(receiver)
    try:
        held = lock("report:3", ttl=1.5, on_lost=recorder)
        assert held.acquire()
        rconn.hset(held.key, "token", "someone-else")
        assert recorder.event.wait(held.heartbeat_interval + 0.5)
    finally:
        lock_lost.disconnect(receiver)
    assert recorder.reason == "taken by another owner"
    assert signalled == [(held, "taken by another owner")]
    assert held.release() is False
    assert rconn.hget(held.key, "token") == b"someone-else", "release must not delete theirs"


def test_an_async_locks_loss_is_signalled_with_sender_lock_as_its_other_signals(rconn):
    """Review bug: ``lock_lost`` was sent with ``sender=AsyncLock`` for an async holder, so a
    receiver connected with ``sender=Lock`` (signals.py: "sent with sender=Lock") heard its
    acquire and release but never its loss."""
    from django_joblock import Lock, alock
    from django_joblock.signals import lock_acquired

    heard: list[str] = []

    def on_acquired(sender, lock, **kwargs):  # type: ignore[no-untyped-def]
        heard.append("acquired")

    def on_lost(sender, lock, reason, **kwargs):  # type: ignore[no-untyped-def]
        heard.append("lost")

    lock_acquired.connect(on_acquired, sender=Lock)
    lock_lost.connect(on_lost, sender=Lock)
    try:
        held = alock("report:async", ttl=1.5)
        assert held.acquire()  # the sync half: no running loop here
        rconn.hset(held.key, "token", "someone-else")
        assert wait_for(lambda: "lost" in heard, held.heartbeat_interval + 1.0), heard
    finally:
        lock_acquired.disconnect(on_acquired, sender=Lock)
        lock_lost.disconnect(on_lost, sender=Lock)
    assert heard == ["acquired", "lost"]


def test_a_black_holed_redis_does_not_hold_up_the_renewal_of_locks_on_another(proxy, rconn):
    """Review bug: the renewal thread sent each alias's round trip in turn; while the round
    trip of a black-holed Redis waited for its socket timeout (2 s here), a 1 s lock on a
    healthy Redis went unrenewed, expired and was taken by another client."""
    stalled = lock("stall:1", ttl=10, cache="proxied")
    healthy = lock("healthy:1", ttl=1)
    assert stalled.acquire() and healthy.acquire()
    proxy.set("blackhole")
    # Its first renewal is due after a third of its TTL, then waits out the socket timeout.
    deadline = time.monotonic() + stalled.ttl
    while stalled.state is not LockState.SUSPECT and time.monotonic() < deadline:
        assert healthy.held and rconn.hget(healthy.key, "token") == healthy.token.encode()
        time.sleep(0.05)
    assert stalled.state is LockState.SUSPECT, "negative control: its renewal timed out"
    assert healthy.held
    proxy.set("forward")
    assert healthy.release()


def test_black_holed_redis_is_declared_lost_before_another_holder_can_enter(proxy, rconn):
    recorder = LostRecorder()
    held = lock("report:4", ttl=2.0, cache="proxied", on_lost=recorder)
    assert held.acquire()
    renewed = wait_for(lambda: int(rconn.hget(held.key, "renewals") or 0) >= 1, held.ttl)
    assert renewed, "no renewal through the proxy"
    proxy.set("blackhole")
    other_at = None
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        contender = lock("report:4", ttl=5)
        if contender.acquire():
            other_at = time.monotonic()
            contender.release()
            break
        time.sleep(0.005)
    # Negative control: the black hole really stopped the renewals, so the server let
    # another holder in once the TTL ran out.
    assert other_at is not None, "renewals were not actually blocked"
    assert recorder.event.is_set(), "the holder never noticed it had lost the lock"
    assert recorder.at < other_at, (
        f"declared LOST {recorder.at - other_at:+.3f}s after another holder got in"
    )
    assert "renewals failing" in recorder.reason or "deadline" in recorder.reason


def test_dropped_connection_is_retried_and_the_lock_survives(rconn):
    recorder = LostRecorder()
    held = lock("report:5", ttl=3.0, on_lost=recorder)
    assert held.acquire()

    def renewer_ids() -> set[int]:
        return {c["id"] for c in rconn.client_list() if c.get("name") == "joblock"}

    assert wait_for(renewer_ids, 2.0), "the renewal thread should have connected"
    before = renewer_ids()
    renewals = int(rconn.hget(held.key, "renewals") or 0)
    for client_id in before:
        rconn.client_kill_filter(_id=client_id)
    dropped_at = time.monotonic()
    # Two renewals after the drop, and past the TTL the lock had when the connection dropped.
    resumed = wait_for(
        lambda: int(rconn.hget(held.key, "renewals") or 0) >= renewals + 2, 3 * held.ttl
    )
    time.sleep(max(0.0, dropped_at + held.ttl - time.monotonic()))
    after = renewer_ids()
    assert resumed, "renewals did not resume after the drop"
    assert after and not (after & before), "negative control: the connection was really dropped"
    assert held.held and not recorder.event.is_set()
    assert rconn.hget(held.key, "token").decode() == held.token
    assert held.release()


def test_max_hold_stops_renewing(rconn):
    recorder = LostRecorder()
    held = lock("report:6", ttl=1.5, max_hold=2.0, on_lost=recorder)
    assert held.acquire()
    assert held.max_hold is not None
    assert recorder.event.wait(2 * (held.max_hold + held.ttl))
    assert recorder.reason.startswith("max_hold"), recorder.reason
    # Declared lost locally a little *before* the server expires it (drift margin).
    assert wait_for(lambda: rconn.exists(held.key) == 0, held.ttl)
    assert int(renewer().stats().renewed) >= 1, "it was renewed until max_hold"


@pytest.mark.parametrize("loaded", [False, True], ids=["idle", "every core busy"])
def test_ten_thousand_locks_are_renewed_by_one_thread(rconn, loaded):
    """One thread renews 10,000 locks of a 20 s TTL in batches, none lost; also while busy
    processes (one more than the cores) compete for the CPU. The TTL is long because the
    10,000 acquires themselves take seconds on a busy machine (CI runs three suites side by
    side: with 8 s, a few early locks ran out there before the heartbeat came round)."""
    load = BusyCores() if loaded else contextlib.nullcontext()
    with load:
        _renew_ten_thousand(rconn, ttl=20.0)
    if loaded:
        assert load.cpu > 2.0, "negative control: the load generator really used the CPU"


def _renew_ten_thousand(rconn: Any, ttl: float) -> None:
    threads_before = threading.active_count()
    stats_before = renewer().stats()
    locks = [lock(f"bulk:{i}", ttl=ttl) for i in range(10_000)]
    for held in locks:
        assert held.acquire()
    time.sleep(ttl + 1.0)  # longer than the TTL: every lock needed at least one renewal
    pipe = rconn.pipeline(transaction=False)
    for held in locks:
        pipe.hget(held.key, "token")
        pipe.hget(held.key, "renewals")
    replies = pipe.execute()
    tokens, renewals = replies[0::2], replies[1::2]
    assert all(t is not None and t.decode() == h.token for t, h in zip(tokens, locks, strict=True))
    assert all(int(r) >= 1 for r in renewals)
    assert all(held.held for held in locks)
    assert threading.active_count() <= threads_before + 1, "one renewal thread, not one per lock"
    stats = renewer().stats()
    round_trips = stats.round_trips - stats_before.round_trips
    assert stats.renewed - stats_before.renewed >= 10_000
    assert round_trips < 200, f"renewals must be batched ({round_trips} round trips)"
    for held in locks:
        held.release()
    assert renewer().held_locks() == []


def test_active_index_lists_long_held_locks(rconn):
    held = lock("order:77", ttl=5)
    assert held.acquire()
    assert wait_for(lambda: rconn.zcard("joblock:active:order"), 3.0)
    members = rconn.zrange("joblock:active:order", 0, -1)
    assert members == [f"order:77#{held.owner}".encode()]
    assert rconn.sismember("joblock:families", "order")
    held.release()
    assert rconn.zcard("joblock:active:order") == 0


@pytest.mark.django_db
def test_a_force_released_holders_renewal_leaves_no_index_entry_behind(rconn):
    """A force-release removes the holding's index entry; the holder's next renewal sent the
    index refresh with it and put the entry back (an active lock counted and listed for up to
    its TTL after it was gone). The renewal that finds the lock lost removes it again."""
    from django_joblock import force_release
    from django_joblock.locks import index

    recorder = LostRecorder()
    held = lock("order:78", ttl=30, on_lost=recorder)  # an entry put back would live 30 s
    held.heartbeat_interval = 0.2
    assert held.acquire()
    assert index.active_counts() == {"order": 1}
    force_release("order:78", reason="test", actor="test")
    assert index.active_counts() == {}, "negative control: the force-release removed it"
    assert recorder.event.wait(10), "the renewal found the lock gone"
    assert recorder.reason
    time.sleep(0.3)  # a renewal round trip after the loss would be sent by now
    assert index.active_counts() == {}, rconn.zrange("joblock:active:order", 0, -1, withscores=True)


def test_a_black_hole_is_noticed_in_time_with_metrics_on_the_same_redis(settings, proxy, rconn):
    """Regression (review): the renewal thread flushed the metrics first, on sockets of
    ``REDIS_TIMEOUT`` (2 s); with the metrics on the black-holed server it sat in the flush and
    declared a 1 s lock lost after the server had let another holder in. The flush now waits no
    longer than the renewal of the shortest lock held."""
    settings.JOBLOCK = {"REDIS_ALIAS": "proxied"}  # locks and metrics behind the proxy
    recorder = LostRecorder()
    held = lock("report:6", ttl=1.0, on_lost=recorder)
    assert held.acquire()
    assert wait_for(lambda: int(rconn.hget(held.key, "renewals") or 0) >= 1, 5)
    proxy.set("blackhole")
    other_at = None
    deadline = time.monotonic() + 6
    while other_at is None and time.monotonic() < deadline:
        contender = lock("report:6", ttl=5, cache="default")
        if contender.acquire():
            other_at = time.monotonic()
            contender.release()
        time.sleep(0.005)
    assert other_at is not None, "negative control: the renewals were really blocked"
    assert recorder.event.is_set(), "the holder never noticed it had lost the lock"
    assert recorder.at < other_at, f"declared LOST {recorder.at - other_at:+.3f}s too late"


def test_a_short_lock_does_not_shorten_the_renewals_of_longer_ones(proxy, rconn):
    """Regression (review): the socket timeout of an alias' renewals was the shortest ever
    wanted (TTL / 5) and never grew back: after one 250 ms lock, a 3 s lock was renewed with
    50 ms sockets, and 100 ms of network latency made it lost. Each round trip now takes the
    timeout of the locks it renews."""
    short = lock("report:7a", ttl=0.25, cache="proxied")
    assert short.acquire()
    short.release()
    recorder = LostRecorder()
    held = lock("report:7", ttl=3.0, cache="proxied", on_lost=recorder)
    assert held.acquire()
    proxy.set("delay", 0.05)  # about 100 ms per round trip: far below the lock's 0.6 s
    try:
        assert wait_for(lambda: int(rconn.hget(held.key, "renewals") or 0) >= 2, 10)
        assert not recorder.event.is_set(), recorder.reason
    finally:
        proxy.set("forward")
    assert held.release()


def test_released_locks_leave_no_pile_of_renewal_entries(rconn):
    """Regression (review): a released lock's entry stayed in the renewal schedule until it
    would have been due (TTL / 3), so a loop of long locks piled up entries by the thousand
    while one lock was held. They are now dropped once they outnumber the held locks."""
    long_held = lock("report:8", ttl=3600)
    assert long_held.acquire()
    try:
        for n in range(5000):
            each = lock(f"report:8:{n % 50}", ttl=3600)
            assert each.acquire()
            each.release()
        assert len(renewer().held_locks()) == 1
        assert len(renewer()._heap) < 2500, len(renewer()._heap)
    finally:
        assert long_held.release()


def test_a_loss_is_counted_by_the_time_the_lock_is_marked_lost(rconn):
    """A job's thread that finds its lock LOST (marked by the renewal thread) flushes its
    metrics and may exit at once: the loss must already be in the buffer when the state
    changes, not added later when the renewal thread announces it (CI: a horse's
    ``locks_lost`` alert never fired)."""
    from django_joblock import metrics

    held = lock("counted:1", ttl=5)
    assert held.acquire()
    metrics.take_for_flush(force=True)
    assert held.mark_lost("taken by another owner")  # what the renewal thread does first
    pending = metrics.take_for_flush(force=True)
    assert pending.get("lost|counted|") == 1, pending
    held.announce_lost("taken by another owner")  # then this, which must not count again
    assert "lost|counted|" not in metrics.take_for_flush(force=True)
    held.release()


def test_a_renewal_that_reaches_redis_after_the_release_leaves_no_index_entry(proxy, rconn):
    """Review bug: the renewal thread refreshed a holding's active-lock index entry with a plain
    ``ZADD`` beside its RENEW. A renewal under way when its holder released (or one that timed
    out on the client and reached Redis later) put the entry back after the release removed it:
    an active lock that was not there, counted on the dashboard for up to a TTL, and for a job
    an expired entry the liveness sweep took for a dead holder (its admission slot "freed")."""
    from django_joblock.locks import index
    from django_joblock.locks.scripts import RENEW

    held = lock("ghost:1", ttl=1.5, cache="proxied")
    entry_key = "joblock:active:ghost"
    member = index.member(held.resource, held.owner)
    proxy.hold_matching = RENEW.sha.encode()  # the renewal's round trip waits in the proxy
    assert held.acquire()
    assert rconn.zscore(entry_key, member) is not None, "negative control: indexed"
    assert wait_for(lambda: proxy.held >= 1, held.ttl), "the first renewal was sent"
    assert held.release(), "released before the renewal reached Redis"
    assert rconn.zscore(entry_key, member) is None, "the release removed the entry"
    proxy.hold_matching = None  # the renewal reaches Redis now
    time.sleep(0.5)  # it ran (RENEW found the lock gone)
    assert rconn.zscore(entry_key, member) is None, "no entry put back for a released lock"
    assert not rconn.exists(held.key)


def test_a_handed_over_lock_on_a_black_holed_redis_is_declared_lost_before_another_enters(
    proxy, rconn
):
    """Review bug: a lock handed over by a release lives ``WAITER_TTL`` (2 s) until renewed,
    but its renewals' socket timeout came from its TTL (30 s: the 2 s ``REDIS_TIMEOUT``). Its
    first renewal, due after 0.67 s, waited until 2.67 s on a black-holed Redis: the loss was
    declared after the server had let another holder in."""
    recorder = LostRecorder()
    holder = lock("handed:1", ttl=30)
    assert holder.acquire()
    waiter = lock("handed:1", ttl=30, wait=10, cache="proxied", on_lost=recorder)
    thread = threading.Thread(target=lambda: (time.sleep(0.3), holder.release()))
    thread.start()
    assert waiter.acquire()
    proxy.set("blackhole")  # before its first renewal (within a third of 2 s)
    thread.join()
    assert rconn.pttl(waiter.key) <= 2000, "negative control: handed over with WAITER_TTL"
    other_at = None
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        contender = lock("handed:1", ttl=5)
        if contender.acquire():
            other_at = time.monotonic()
            contender.release()
            break
        time.sleep(0.005)
    assert other_at is not None, "renewals were not actually blocked"
    assert recorder.event.wait(5), "the holder never noticed it had lost the lock"
    assert recorder.at < other_at, (
        f"declared LOST {recorder.at - other_at:+.3f}s after another holder got in"
    )
