"""``lock(resource, limit=N)``: up to N holders at once, each in a slot of its own.

On a real Redis: slots are distinct lock hashes (own token, TTL, fence), renew and release
touch only the caller's slot, waiters are served in arrival order as slots free, a dead
holder's slot frees with its TTL, and changing N never lets more than the larger N hold.
Real-process runs with workers and faults are in tests/test_limit_workers.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from django_joblock import LockNotAcquired, alock, lock, lock_holders, lock_info
from django_joblock.locks import index
from django_joblock.locks.keys import MAX_LIMIT, LockKeys
from tests.harness import wait_for


def _slot_keys(resource: str, limit: int) -> list[str]:
    keys = LockKeys("joblock", resource)
    return [keys.slot_key(slot) for slot in range(limit)]


def test_three_holders_at_most_each_in_its_own_slot(rconn: Any) -> None:
    held = [lock("api:merchant-7", limit=3, wait=0) for _ in range(4)]
    assert [each.acquire() for each in held] == [True, True, True, False]
    assert sorted(each.slot for each in held[:3]) == [0, 1, 2]
    assert len({each.key for each in held[:3]}) == 3
    # Each slot hash carries its own holder's fence; fences increase with each acquire.
    fences = [each.fence for each in held[:3]]
    assert fences == sorted(fences) and len(set(fences)) == 3
    for each in held[:3]:
        assert int(rconn.hget(each.key, "fence")) == each.fence
    # A release frees exactly the caller's slot, which the next acquire takes.
    freed = held[1].slot
    assert held[1].release()
    assert rconn.exists(held[1].key) == 0
    assert all(rconn.exists(each.key) for each in (held[0], held[2]))
    assert held[3].acquire() and held[3].slot == freed
    assert held[3].fence > max(fences)
    for each in (held[0], held[2], held[3]):
        assert each.release()
    assert rconn.exists(*_slot_keys("api:merchant-7", 3)) == 0


def test_a_limit_of_one_is_the_plain_lock(rconn: Any) -> None:
    with lock("order:1", limit=1) as held:
        assert held.slot == 0 and held.key == "joblock:{order:1}:lock"
        with pytest.raises(LockNotAcquired):
            with lock("order:1", wait=0):
                pass
        # A plain lock and a limit=2 lock share slot 0: the second holder takes slot 1.
        with lock("order:1", limit=2, wait=0) as other:
            assert other.slot == 1


def test_renew_touches_only_the_callers_slot(rconn: Any) -> None:
    first = lock("api:a", limit=2, ttl=30, heartbeat=False)
    second = lock("api:a", limit=2, ttl=5, heartbeat=False)
    assert first.acquire(wait=0) and second.acquire(wait=0)
    rconn.pexpire(second.key, 1000)
    assert first.renew()
    assert rconn.pttl(second.key) <= 1000  # untouched by the other holder's renewal
    assert int(rconn.hget(first.key, "renewals")) == 1
    assert int(rconn.hget(second.key, "renewals")) == 0
    first.release()
    second.release()


def test_a_dead_holders_slot_frees_with_its_ttl(rconn: Any) -> None:
    # heartbeat off and never released: as a holder that died
    dead = lock("api:b", limit=2, ttl=0.5, heartbeat=False)
    alive = lock("api:b", limit=2, ttl=30)
    assert dead.acquire(wait=0) and alive.acquire(wait=0)
    newcomer = lock("api:b", limit=2, wait=0)
    assert not newcomer.acquire()  # negative control: both slots taken
    assert newcomer.acquire(wait=5)  # the dead one's TTL runs out
    assert newcomer.slot == dead.slot
    newcomer.release()
    alive.release()


def test_waiters_are_served_in_arrival_order_as_slots_free(rconn: Any) -> None:
    holders = [lock("api:c", limit=2, wait=0) for _ in range(2)]
    assert all(each.acquire() for each in holders)
    fences: dict[int, int] = {}
    started: list[threading.Thread] = []

    def wait_then_hold(number: int) -> None:
        with lock("api:c", limit=2, wait=30) as held:
            assert held.fence is not None
            fences[number] = held.fence  # fences increase in the order the slots were given
            time.sleep(0.05)

    for number in range(5):
        thread = threading.Thread(target=wait_then_hold, args=(number,))
        thread.start()
        started.append(thread)
        # Each in line before the next arrives: arrival order is known.
        wait_for(lambda n=number: rconn.zcard("joblock:{api:c}:queue") == n + 1, timeout=10)
    for each in holders:
        each.release()
    for thread in started:
        thread.join(30)
    assert sorted(fences, key=fences.__getitem__) == [0, 1, 2, 3, 4]


def test_never_more_holders_than_the_larger_of_old_and_new_limit(rconn: Any) -> None:
    # Deployed with limit=5: five hold. A deploy with limit=3 then admits nobody new until
    # fewer than three of the old slots 0..2 are held, and slots 3..4 are not its own.
    old = [lock("api:d", limit=5, wait=0) for _ in range(5)]
    assert all(each.acquire() for each in old)
    new = lock("api:d", limit=3, wait=0)
    assert not new.acquire()
    for each in old:
        if each.slot >= 3:
            each.release()
    assert not new.acquire()  # slots 0..2 are still held: 3 holders, not more
    next(each for each in old if each.slot == 1).release()
    assert new.acquire() and new.slot == 1
    counted = sum(rconn.exists(key) for key in _slot_keys("api:d", 5))
    assert counted == 3
    # Back up to limit=5 while limit=3 holders run: at most 5.
    grown = [lock("api:d", limit=5, wait=0) for _ in range(3)]
    assert [each.acquire() for each in grown] == [True, True, False]
    for each in [*old, new, *grown]:
        if each.held:
            each.release()


def test_the_index_and_lock_info_show_each_holder(rconn: Any) -> None:
    held = [lock("api:e", limit=3) for _ in range(3)]
    for each in held:
        each.acquire()
    entries = index.members(["api"], 10)
    assert sorted((entry.resource, entry.slot) for entry in entries) == [
        ("api:e", 0),
        ("api:e", 1),
        ("api:e", 2),
    ]
    assert {entry.owner for entry in entries} == {each.owner for each in held}
    assert {entry.key for entry in entries} == {each.key for each in held}
    info = lock_info("api:e", limit=3)
    assert info is not None
    assert (info.slot, info.limit, info.slots_used) == (0, 3, 3)
    by_slot = {each.slot: each for each in held}
    assert info.owner == by_slot[0].owner and info.fence == by_slot[0].fence
    holders = lock_holders("api:e", limit=3)
    assert [(h.slot, h.owner, h.fence) for h in holders] == [
        (slot, by_slot[slot].owner, by_slot[slot].fence) for slot in range(3)
    ]
    by_slot[0].release()
    info = lock_info("api:e", limit=3)
    assert info is not None and (info.slot, info.slots_used) == (1, 2)
    assert lock_info("api:e") is None  # slot 0 alone: free
    for each in held:
        if each.held:
            each.release()
    assert index.members(["api"], 10) == []


@pytest.mark.parametrize("bad", [0, -1, MAX_LIMIT + 1, 2.0, "3", True, None])
def test_a_bad_limit_is_refused_naming_it(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"lock\('api:f'\): limit must be an int in 1\.\.100"):
        lock("api:f", limit=bad)


def test_async_holders_share_the_slots_with_sync_ones(rconn: Any) -> None:
    sync_holder = lock("api:g", limit=2, wait=0)
    assert sync_holder.acquire()

    async def run() -> list[int]:
        first = alock("api:g", limit=2, wait=0)
        assert await first.aacquire()
        refused = alock("api:g", limit=2, wait=0)
        assert not await refused.aacquire()  # two holders: a sync and an async one
        waiting = asyncio.ensure_future(alock("api:g", limit=2, wait=10).aacquire())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await first.arelease()
        assert await waiting
        return [first.slot]

    asyncio.run(run())
    sync_holder.release()


@pytest.mark.django_db
def test_fenced_update_refuses_the_fence_of_a_lock_with_several_holders(rconn: Any) -> None:
    from django_joblock import fenced_update
    from tests.testapp.models import Account

    Account.objects.create(name="shared", balance=0)
    rows = Account.objects.filter(name="shared")
    with lock("api:h", limit=2) as held:
        assert held.fence is not None
        with pytest.raises(ValueError, match=r"limit=2\), which several holders hold at once"):
            fenced_update(rows, held.fence, balance=5)
    assert Account.objects.get(name="shared").balance == 0, "nothing written"
    with lock("api:h") as plain:  # negative control: a plain lock's fence guards the row
        assert plain.fence is not None
        assert fenced_update(rows, plain.fence, balance=6) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock": "q:{n}", "concurrency": 0}, r"concurrency must be an int in 1\.\.100"),
        ({"lock": "q:{n}", "concurrency": 101}, r"concurrency must be an int in 1\.\.100"),
        ({"lock": "q:{n}", "concurrency": 2.5}, r"concurrency must be an int in 1\.\.100"),
        ({"idempotency_key": "k:{n}", "concurrency": 3}, "concurrency= .* it needs a lock"),
    ],
)
def test_a_bad_concurrency_is_refused_at_decoration(options: dict[str, Any], message: str) -> None:
    from django_joblock import locked_job

    with pytest.raises(ValueError, match=message):
        locked_job("default", **options)


def test_a_release_hands_a_slot_only_to_a_waiter_whose_lock_has_it(rconn: Any) -> None:
    plain = lock("api:i", wait=0)
    assert plain.acquire() and plain.slot == 0
    second = lock("api:i", limit=2, wait=0)
    assert second.acquire() and second.slot == 1
    got: list[tuple[str, int]] = []

    def waiter(name: str, limit: int) -> None:
        with lock("api:i", wait=30, limit=limit) as held:
            got.append((name, held.slot))
            time.sleep(0.1)

    # First in line a plain lock's waiter (slot 0 only), behind it a limit=2 one (which
    # marks both held slots as waited for).
    threads = []
    for name, limit in (("plain", 1), ("two", 2)):
        threads.append(threading.Thread(target=waiter, args=(name, limit)))
        threads[-1].start()
        count = len(threads)
        wait_for(lambda n=count: rconn.zcard("joblock:{api:i}:queue") == n, timeout=10)
    second.release()  # slot 1 is no plain lock's: not handed to the first in line
    time.sleep(0.3)
    assert got == [] and rconn.zcard("joblock:{api:i}:queue") == 2
    assert not rconn.exists("joblock:{api:i}:lock:1")
    plain.release()  # slot 0 is: handed to the plain waiter; the other one follows
    for thread in threads:
        thread.join(30)
    assert [name for name, _ in got] == ["plain", "two"] and got[0][1] == 0


def test_a_waiter_behind_a_silent_ticket_does_not_spin(rconn: Any) -> None:
    """A free slot reserved for a ticket ahead (its waiter silent, not polling): the waiter
    behind it blocks between tries as any waiter not next in line does, not every ms."""
    from django_joblock.locks import scripts

    keys = LockKeys("joblock", "api:j")
    holder = lock("api:j", limit=2, wait=0, heartbeat=False, ttl=30)
    assert holder.acquire()
    wait_keys = [
        keys.lock,
        keys.fence,
        keys.queue,
        keys.tickets,
        keys.wake("silent"),
        keys.slot_key(1),
    ]
    # A ticket that never polls again: live for 10 s.
    silent = [
        "silent-token",
        30_000,
        86_400_000,
        "host",
        1,
        "",
        "",
        "",
        "silent",
        10_000,
        10_000,
        0,
    ]
    dying = lock("api:j", limit=2, wait=0, heartbeat=False, ttl=0.3)
    assert dying.acquire() and dying.slot == 1
    fence, _, place = scripts.WAIT(rconn, wait_keys, silent)
    assert fence == 0 and place == 0
    # Slot 1 expires (a release would hand it to the silent ticket): free, and reserved for
    # the silent ticket ahead.
    wait_for(lambda: not rconn.exists(keys.slot_key(1)), timeout=10)
    before = int(rconn.info("commandstats")["cmdstat_evalsha"]["calls"])
    behind = lock("api:j", limit=2, wait=1.5, heartbeat=False)
    assert not behind.acquire()  # negative control: the slot is the silent ticket's
    calls = int(rconn.info("commandstats")["cmdstat_evalsha"]["calls"]) - before
    assert calls <= 8, f"{calls} scripts in 1.5 s: the waiter spun"
    holder.release()


@pytest.mark.django_db
def test_an_operator_release_leaves_its_note_for_that_slots_holder(rconn: Any) -> None:
    """Two holders released one after the other: each finds the note about its own release
    (one note per resource would leave the first with the second's)."""
    from django_joblock.locks import notes
    from django_joblock.monitor.control import force_release

    held = [lock("api:k", limit=3, heartbeat=False) for _ in range(3)]
    for each in held:
        assert each.acquire()
    for each in held[1:]:
        result = force_release("api:k", owner=each.owner, slot=each.slot, reason=f"r{each.slot}")
        assert result.released
    for each in held[1:]:
        note = notes.read(rconn, each.keys.released, each.owner)
        assert note is not None and note.reason == f"r{each.slot}", note
    assert notes.read(rconn, held[0].keys.released, held[0].owner) is None
    assert held[0].release()
