"""Waiting for a busy lock: a line of tickets in arrival order, handed the lock on release.

A waiting acquire takes the lock if it is free and nobody waits; otherwise it takes a *ticket*
(the WAIT script) and blocks in ``BLPOP`` on its own wake list:

- **Arrival order.** While tickets are in line a free lock is theirs: a newcomer, even with
  ``wait=0``, is refused and joins the end. A wait is bounded by the work ahead of it.
- **Handed over, not polled for.** The release script gives the lock to the first live ticket
  (its token and details, a fresh fence) and pushes "fence next-ticket" to its wake list: a
  release wakes exactly one waiter, holding the lock. The releaser must name that wake list
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
from typing import Any, NamedTuple

from .. import conf
from ..backend import MAX_BLOCK, REDIS_ERRORS, blocking_client, is_cluster, send, text
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
) -> Turn:
    """Take the lock of ``keys``, waiting in line until the monotonic ``deadline``.

    ``ticket`` names this waiter (the lock's owner hash); ``args`` are ACQUIRE's arguments. A
    lock handed over with a shorter TTL than its own is renewed before returning when
    ``confirm`` (no heartbeat will), else within ``Turn.valid_for`` by the caller's heartbeat.
    The last try also leaves the line. Redis errors propagate; anything else raised while
    waiting (``KeyboardInterrupt``) leaves the line first, giving back a lock handed over.
    """
    waiter_ttl = conf.get().WAITER_TTL
    waiter_ttl_ms = max(1, int(waiter_ttl * 1000))
    hand_ttl_ms = min(int(args[1]), waiter_ttl_ms)
    refresh = min(waiter_ttl / 4, MAX_BLOCK)
    wake = keys.wake(ticket)
    script_keys = [*lock_keys(keys), wake]
    script_args = [*args, ticket, waiter_ttl_ms, hand_ttl_ms]
    blocking = blocking_client(alias)
    failed_blocks = 0
    with _waiters_guard:
        _waiters[alias] = _waiters.get(alias, 0) + 1
    try:
        while True:
            sent = time.monotonic()
            last = sent >= deadline
            fence, pttl_ms, place = WAIT(client, script_keys, [*script_args, int(last)])
            if fence > 0:
                return Turn(int(fence), sent, None, text(place))
            if last:
                return Turn(-1 - int(pttl_ms), sent, None, "")
            now = time.monotonic()
            if now >= deadline:
                continue  # one last try, which also leaves the line
            block = min(deadline - now, refresh)
            if place == 0:  # first in line: the holder's TTL may run out before a hand-over
                block = min(block, int(pttl_ms) / 1000 + 0.001)
            try:
                popped = blocking.blpop([wake], timeout=max(0.001, round(block, 3)))
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
            fence_s, _, after = text(popped[1]).partition(" ")
            short = hand_ttl_ms < int(args[1])
            valid_for = hand_ttl_ms / 1000
            # Renew it here when no heartbeat will, or when this process woke so late that
            # half the hand-over's validity is gone (then it is not safe to use as is).
            if (short and confirm) or time.monotonic() - sent >= valid_for / 2:
                renewed = time.monotonic()
                if RENEW(client, [keys.lock], [args[0], args[1]]) != Outcome.OK:
                    continue  # it ran out before we could renew it: wait on
                return Turn(int(fence_s), renewed, None, after)
            return Turn(int(fence_s), sent, valid_for if short else None, after)
    except REDIS_ERRORS:
        raise  # the ticket expires on its own; a retry by the same Lock keeps the place
    except BaseException:
        with contextlib.suppress(*REDIS_ERRORS):  # else the ticket expires after WAITER_TTL
            LEAVE(client, [keys.lock, keys.queue, keys.tickets, wake], [args[0], ticket])
        raise
    finally:
        with _waiters_guard:
            _waiters[alias] -= 1
            last = not _waiters[alias]
        if last and not is_cluster(blocking):
            blocking.connection_pool.disconnect(inuse_connections=False)


def release(
    client: Any,
    keys: LockKeys,
    token: str,
    expected: str,
    also: list[Any],
    unindex: tuple[list[str], list[Any]] = ([], []),
) -> tuple[Outcome, list[Any]]:
    """Release the lock held with ``token``, handing it to the first live ticket in line.

    ``expected`` is the ticket the holder believes first ("" if none known); ``also`` are
    commands sent with the first try as :func:`~django_joblock.backend.send`'s ``extra``,
    ``unindex`` the index key and member RELEASE removes (:func:`.index.in_script`). Returns
    the outcome and the replies of ``also``. One round trip when nobody waits or ``expected``
    is right (on Redis Cluster, one more for ``also``); one more each time the line changed."""
    extra: list[Any] = []
    for attempt in range(HAND_OVER_TRIES + 1):
        args = [token, expected]
        if attempt == HAND_OVER_TRIES:  # give up handing over: the first in line notices
            script_keys = [keys.lock]  # within a quarter WAITER_TTL
        else:  # (a wake list for "" is never pushed: no ticket is "")
            script_keys = [*lock_keys(keys), keys.wake(expected)]
            if attempt == 0 and unindex[0]:
                script_keys += unindex[0]
                args += unindex[1]
        reply, *replies = send(client, [(RELEASE, script_keys, args)], also)
        also, extra = [], extra or replies  # sent with the first try
        if isinstance(reply, Exception):
            raise reply
        if not isinstance(reply, (bytes, str)):
            return Outcome(reply), extra
        expected = text(reply)
    raise AssertionError("unreachable: the last try does not look at the line")
