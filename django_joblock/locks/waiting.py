"""Waiting for a busy lock: a line of tickets in arrival order, handed the lock on release.

A waiting acquire takes the lock if it is free and nobody waits; otherwise it takes a *ticket*
(the WAIT script) and blocks in ``BLPOP`` on its own wake list:

- **Arrival order.** While tickets are in line a free lock is theirs: a newcomer, even with
  ``wait=0``, is refused and joins the end. A wait is bounded by the work ahead of it.
- **Handed over, not polled for.** The release script gives the lock to the first live ticket
  (its token and details, a fresh fence) and pushes "fence next-ticket lock-hash" to its wake
  list: a release wakes exactly one waiter, holding the lock. The releaser must name that wake list
  (the ticket behind it when it got the lock); if another is first by then, the script
  changes nothing and says who, and :func:`release` asks again.
- **Every block is bounded**: by the remaining wait, by a quarter of ``WAITER_TTL`` (at most
  a second; then the ticket is refreshed) and, first in line, by the holder's remaining TTL (a
  dead holder hands nothing over; its lock expires and the first in line takes it).
- **A waiter never blocks the line for long.** One that gives up or is interrupted leaves at
  once; one that dies drops out after ``WAITER_TTL``, and a lock handed to it meanwhile has a
  TTL of at most ``WAITER_TTL`` until renewed.

A handed-over lock's validity counts from the send time of the waiter's last WAIT, which
empties the wake list: whatever is popped later was pushed by a later hand-over. Redis errors
propagate; the same ``Lock`` acquiring again keeps its place (its ticket is its owner hash). A
dying releaser cannot lose a wake-up: the hand-over is part of the release script.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from .. import conf
from ..backend import MAX_BLOCK, REDIS_ERRORS, blocking_client, is_cluster, text
from ..redis_steps import Block, RunScript, Send, Steps, drive
from . import index
from .keys import LockKeys
from .scripts import LEAVE, RELEASE, RENEW, WAIT, Outcome

# A release finding someone unexpected first in line asks again at most this many times, then
# releases without handing over: the first in line notices within a quarter of WAITER_TTL.
HAND_OVER_TRIES = 3

# Waiters blocked now in this process, per alias: the last to leave closes the idle blocking
# connections (one was opened per concurrent waiter).
_waiters: dict[str, int] = {}
_waiters_guard = threading.Lock()


class Turn(NamedTuple):
    """What :func:`wait_in_line` ended with."""

    reply: int  # the fence (> 0) when acquired, else ACQUIRE's "busy" code (-1 - holder's PTTL)
    sent: float  # monotonic send time of the call from which the lock's validity counts
    valid_for: float | None  # seconds valid from ``sent`` (the hand-over TTL); None: the TTL
    next_ticket: str  # who was first in line behind this holder ("" if nobody)
    slot: int = 0  # the slot taken, of a lock with a limit of several holders
    indexed: bool = False  # the holding's active-lock index entry was written with it


def lock_keys(keys: LockKeys) -> list[str]:
    """The keys ACQUIRE and RELEASE are called with (before a wake list)."""
    return [keys.lock, keys.fence, keys.queue, keys.tickets]


def wait_in_line(
    client: Any,
    alias: str,
    keys: LockKeys,
    ticket: str,
    args: list[Any],
    deadline: float,
    *,
    confirm: bool,
    limit: int = 1,
    index_call: tuple[list[str], list[Any]] = ([], []),
) -> Turn:
    """Take the lock of ``keys``, waiting in line until the monotonic ``deadline``.

    ``ticket`` names this waiter (the lock's owner hash); ``args`` are ACQUIRE's arguments. A
    lock handed over with a shorter TTL than its own is renewed before returning when
    ``confirm`` (no heartbeat will), else within ``Turn.valid_for`` by the caller's heartbeat.
    ``limit`` is the lock's number of slots; ``index_call`` the active-lock index keys and
    arguments WAIT writes a holding's entry with (:func:`.index.in_wait_script`; none: the
    caller indexes). The last try also leaves the line. Redis errors
    propagate; anything else raised while waiting (``KeyboardInterrupt``) leaves the line
    first, giving back a lock handed over.
    """
    waiter = Waiter(keys, ticket, args, confirm=confirm, limit=limit, index_call=index_call)
    with _counted_blocking_client(alias) as blocking:
        try:
            return drive(waiter.take_turn(deadline), client, blocking)
        except REDIS_ERRORS:
            raise  # the ticket expires on its own; a retry by the same Lock keeps the place
        except BaseException:
            with contextlib.suppress(*REDIS_ERRORS):  # else the ticket expires after WAITER_TTL
                drive(waiter.leave(), client)
            raise


@contextlib.contextmanager
def _counted_blocking_client(alias: str) -> Iterator[Any]:
    """``alias``'s blocking client, with one more waiter of this process counted while inside.

    Whatever ends the block, the count goes down again, and the last waiter of ``alias`` to
    leave closes the idle blocking connections (one was opened per concurrent waiter; not on
    Redis Cluster)."""
    blocking = blocking_client(alias)
    with _waiters_guard:
        _waiters[alias] = _waiters.get(alias, 0) + 1
    try:
        yield blocking
    finally:
        with _waiters_guard:
            _waiters[alias] -= 1
            nobody_left = not _waiters[alias]
        if nobody_left and not is_cluster(blocking):
            blocking.connection_pool.disconnect(inuse_connections=False)


class Waiter:
    """A waiting acquire's ticket in the line of a lock, and the flows it runs with it
    (:mod:`django_joblock.redis_steps`: the same for the sync and the asyncio clients).

    Holds what every call of one wait shares; creating it makes no call. ``args`` are
    ACQUIRE's arguments (the owner token and the lock's TTL in ms first), ``confirm`` as for
    :func:`wait_in_line`, ``limit`` the lock's most holders at once (its slots), ``index_call``
    the index keys and arguments WAIT writes a holding's entry with (as for
    :func:`wait_in_line`)."""

    def __init__(
        self,
        keys: LockKeys,
        ticket: str,
        args: list[Any],
        *,
        confirm: bool,
        limit: int = 1,
        index_call: tuple[list[str], list[Any]] = ([], []),
    ) -> None:
        waiter_ttl = conf.get().WAITER_TTL
        waiter_ttl_ms = max(1, int(waiter_ttl * 1000))
        self.keys = keys
        self.ticket = ticket
        self.args = args
        self.confirm = confirm
        self.ttl_ms = int(args[1])
        # A lock handed to this waiter lives at most WAITER_TTL until renewed (it may have died).
        self.hand_ttl_ms = min(self.ttl_ms, waiter_ttl_ms)
        self.refresh = min(waiter_ttl / 4, MAX_BLOCK)  # the longest block: then WAIT again
        self.wake = keys.wake(ticket)
        self._more_slots = keys.more_slots(limit)
        index_keys, index_args = index_call
        self._indexes = bool(index_keys)
        self._wait_keys = [*lock_keys(keys), self.wake, *self._more_slots, *index_keys]
        self._wait_args = [*args, ticket, waiter_ttl_ms, self.hand_ttl_ms]
        self._index_args = index_args

    def take_turn(self, deadline: float) -> Steps[Turn]:
        """Wait in line until this waiter takes the lock, is handed it, or the monotonic
        ``deadline`` passes; then one last WAIT takes it or leaves the line (refused).

        Calls WAIT, then blocks in ``BLPOP`` for a hand-over, and again. A failed block is
        followed by a WAIT (which finds a lock handed over meanwhile); the second failure in a
        row raises. Redis errors of the other calls propagate."""
        failed_blocks = 0
        while True:
            sent = time.monotonic()
            last = sent >= deadline
            index_args = index.scored_now(self._index_args, self.ttl_ms)
            wait_args = [*self._wait_args, int(last), len(self._more_slots), *index_args]
            fence, pttl_ms, place, *slot = yield RunScript(WAIT, self._wait_keys, wait_args)
            if fence > 0:
                return Turn(int(fence), sent, None, text(place), int(slot[0]), self._indexes)
            if last:
                return Turn(-1 - int(pttl_ms), sent, None, "")
            now = time.monotonic()
            if now >= deadline:
                continue  # one last try, which also leaves the line
            timeout = self._block_timeout(deadline - now, place, pttl_ms)
            try:
                popped = yield Block(self.wake, timeout)
                failed_blocks = 0
            except REDIS_ERRORS:
                # Failed while blocked (a restart, say): the next WAIT tells whether Redis is
                # back (and finds a lock handed over meanwhile). Twice in a row: give up.
                failed_blocks += 1
                if failed_blocks > 1:
                    raise
                continue
            if popped is None:
                continue
            turn = yield from self._handed_over(text(popped[1]), sent)
            if turn is not None:
                return turn

    def _block_timeout(self, left: float, place: Any, pttl_ms: Any) -> float:
        """The ``BLPOP`` timeout (s, at least 1 ms) after a refused WAIT, with ``left`` seconds
        of the wait remaining: at most the refresh interval and, first in line (``place`` 0),
        until just past the holder's ``pttl_ms`` (a dead holder hands nothing over)."""
        block = min(left, self.refresh)
        if place == 0:  # first in line: the holder's TTL may run out before a hand-over
            block = min(block, int(pttl_ms) / 1000 + 0.001)
        return max(0.001, round(block, 3))

    def _handed_over(self, message: str, sent: float) -> Steps[Turn | None]:
        """The turn of the lock a release handed over, pushing ``message`` ("fence next-ticket
        lock-hash").

        Its validity counts from ``sent``, the send time of the last WAIT, for the hand-over
        TTL when shorter than the lock's. It is renewed first (its validity then counts from
        the renewal) when no heartbeat will (``confirm`` and a shorter TTL), or when this
        process woke so late that half the hand-over's validity is gone (then it is not safe
        to use as is). None when it ran out before it could be renewed: wait on."""
        fence, _, rest = message.partition(" ")
        after, _, key = rest.partition(" ")  # no key: pushed by a release of an older version
        key = key or self.keys.lock
        slot = self._slot_of(key)
        short = self.hand_ttl_ms < self.ttl_ms
        valid_for = self.hand_ttl_ms / 1000
        if (short and self.confirm) or time.monotonic() - sent >= valid_for / 2:
            renewed = time.monotonic()
            outcome = yield RunScript(RENEW, [key], [self.args[0], self.args[1]])
            if outcome != Outcome.OK:
                return None  # it ran out before we could renew it: wait on
            return Turn(int(fence), renewed, None, after, slot)
        return Turn(int(fence), sent, valid_for if short else None, after, slot)

    def _slot_of(self, key: str) -> int:
        """The slot whose lock hash is ``key`` (0 for slot 0's)."""
        return self._more_slots.index(key) + 1 if key in self._more_slots else 0

    def leave(self) -> Steps[None]:
        """Leave the line now (LEAVE), giving back a lock handed over to this waiter meanwhile."""
        leave_keys = [self.keys.lock, self.keys.queue, self.keys.tickets, self.wake]
        leave_keys += self._more_slots
        yield RunScript(LEAVE, leave_keys, [self.args[0], self.ticket])


def release(
    client: Any,
    keys: LockKeys,
    token: str,
    expected: str,
    also: list[Any],
    unindex: tuple[list[str], list[Any]] = ([], []),
) -> tuple[Outcome, list[Any]]:
    """:func:`release_steps` on the redis-py client ``client``."""
    return drive(release_steps(keys, token, expected, also, unindex), client)


def release_steps(
    keys: LockKeys,
    token: str,
    expected: str,
    also: list[Any],
    unindex: tuple[list[str], list[Any]] = ([], []),
) -> Steps[tuple[Outcome, list[Any]]]:
    """Release the lock held with ``token``, handing it to the first live ticket in line.

    ``expected`` is the ticket the holder believes first ("" if none known); ``also`` are
    commands sent with the first try as :func:`~django_joblock.backend.send`'s ``extra``,
    ``unindex`` the index key and member RELEASE removes (:func:`.index.in_release`). Returns
    the outcome and the replies of ``also``. One round trip when nobody waits or ``expected``
    is right (on Redis Cluster, one more for ``also``); one more each time the line changed."""
    also_replies: list[Any] = []
    for attempt in range(HAND_OVER_TRIES + 1):
        first = attempt == 0
        args = [token, expected]
        if attempt == HAND_OVER_TRIES:  # give up handing over: the first in line notices
            script_keys = [keys.lock]  # within a quarter WAITER_TTL
        else:  # (a wake list for "" is never pushed: no ticket is "")
            script_keys = [*lock_keys(keys), keys.wake(expected)]
            if first and unindex[0]:
                script_keys += unindex[0]
                args += unindex[1]
        # ``also`` rides with the first try only: the replies after RELEASE's are its own.
        reply, *replies = yield Send([(RELEASE, script_keys, args)], also if first else [])
        if first:
            also_replies = replies
        if isinstance(reply, Exception):
            raise reply
        if not isinstance(reply, (bytes, str)):
            return Outcome(reply), also_replies
        expected = text(reply)
    raise AssertionError("unreachable: the last try does not look at the line")
