"""``Lock`` and ``lock()``: one holder per resource, with a TTL, an owner token and a fence.

Guarantees (with a single Redis primary whose clock does not step):

- at most one *valid* holder per resource: acquire is ``SET``-if-absent in one Lua script,
  renew and release compare the owner token atomically (never a blind ``DEL`` or ``PEXPIRE``);
- every lock expires: the TTL is always set, so a dead holder frees it after at most ``ttl``;
- each acquisition gets a fence strictly greater than every earlier one for the resource
  (:mod:`.fencing`); the holder's own view of its validity is conservative (:mod:`.state`).

A lock belongs to the *process* that acquired it (a forked child never touches it in Redis);
leaving a ``with`` block releases it in whatever ``contextvars`` context, and raises
:class:`LockLost` if it had been lost and the block raised nothing; a ``Lock`` nobody
references any more is not renewed and expires (docs/locks.md). An uncontended acquire, a
``wait=0`` try on a free lock and a release nobody waits for are one round trip each, the
active-lock index (:mod:`.index`) included (on Redis Cluster, two); a busy lock is waited
for in line and handed over by the release (:mod:`.waiting`).

Failure modes: Redis down, timing out or out of memory raises :class:`LockBackendUnavailable`
(never "busy") within ``JOBLOCK["REDIS_TIMEOUT"]``; so does a reply that arrives after the
lock's validity ran out (the lock is then given back). A connection lost mid-call is sent
once more: the scripts recognise their own token, so an acquire whose reply was lost gets the
same lock and fence back, and a repeated release finds its own release done.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from django.utils.asyncio import async_unsafe
from redis.exceptions import ConnectionError as RedisConnectionError

from .. import conf, metrics
from ..backend import REDIS_ERRORS, Call, cache_argument, client, text, unavailable
from ..exceptions import LockBackendUnavailable, LockError, LockLost, LockNotAcquired
from ..logs import log_lock, logger
from ..redis_steps import Send, Steps, drive
from ..signals import lock_acquired, lock_contended, lock_released
from . import current, index, replicas, waiting
from .current import reset_current_lock, set_current_lock
from .info import holder_details
from .keys import LockKeys, validate_limit, validate_resource
from .renewal import renewer
from .scripts import ACQUIRE, FENCE_COUNTER_TTL_MS, Outcome
from .state import Holding, LockState, OnLost, drift

__all__ = ["Lock", "LockState", "current_lock", "lock", "reset_current_lock", "set_current_lock"]

_HOLDING = (LockState.HELD, LockState.SUSPECT)
# Django's SynchronousOnlyOperation, for a sync call that would block a running event loop.
_IN_LOOP = (
    "A Lock's sync acquire, release, renew and owned block the running event loop: in async "
    "code use alock() (async with alock(...), await held.aacquire() / arelease() / arenew())"
)

P = ParamSpec("P")
R = TypeVar("R")


class Lock(Holding):
    """A lock on one resource. Use as a context manager (``with lock("order:1") as held:``), as
    a decorator (``@lock("report")``: each call holds it), or call acquire/release yourself.

    ``ttl`` (s) defaults to ``JOBLOCK["LOCK_TTL"]``; ``wait`` (s) is how long :meth:`acquire`
    waits in line for a busy lock (default ``JOBLOCK["ACQUIRE_WAIT"]``, 0 = one try,
    ``math.inf`` = until it gets it). ``limit`` (default 1) is how many holders the resource
    may have at once: each takes one of its ``limit`` slots (``slot``), with its own token,
    TTL, heartbeat and fence. With ``heartbeat`` the renewal thread renews the lock
    every ``HEARTBEAT_INTERVAL`` (default ttl/3) until ``max_hold`` (s), and calls
    ``on_lost(lock, reason)`` when it finds it lost. ``cache`` names the django-redis cache.
    """

    def __init__(
        self,
        resource: str,
        *,
        ttl: float | None = None,
        wait: float | None = None,
        heartbeat: bool = True,
        max_hold: float | None = None,
        on_lost: OnLost | None = None,
        cache: str | None = None,
        using: str | None = None,
        limit: int = 1,
    ) -> None:
        settings = conf.get()
        cache = cache_argument(cache, using)
        self.resource: str = validate_resource(resource)
        what = f"lock({resource!r}):"
        self.limit: int = validate_limit(what, limit)
        # As given, for the lock of each call when this one decorates a function.
        self._arguments: dict[str, Any] = {
            "ttl": ttl,
            "wait": wait,
            "heartbeat": heartbeat,
            "max_hold": max_hold,
            "on_lost": on_lost,
            "cache": cache,
            "limit": limit,
        }
        # The settings' defaults were validated when read (conf.get); arguments are checked.
        self.ttl: float = settings.LOCK_TTL
        if ttl is not None:
            self.ttl = conf.TTL_RANGE.check(f"{what} ttl", ttl)
        self.wait: float = settings.ACQUIRE_WAIT
        if wait is not None:
            self.wait = _check_wait(what, wait)
        self.max_hold: float | None = settings.MAX_HOLD
        if max_hold is not None:
            self.max_hold = conf.HOLD_RANGE.check(f"{what} max_hold", max_hold)
        self.heartbeat: bool = bool(heartbeat)
        self.heartbeat_interval: float = settings.heartbeat_interval(self.ttl)
        self.on_lost: OnLost | None = on_lost
        self.cache: str = cache or settings.REDIS_ALIAS
        self.keys = LockKeys(settings.KEY_PREFIX, self.resource)
        self.key: str = self.keys.lock  # the lock hash of the slot held (slot 0 until then)
        self.slot: int = 0
        self.family: str = self.keys.family
        # Who was first in line behind this holder when it got the lock: its release hands
        # the lock to that waiter in the same round trip (see waiting.release).
        self._next_ticket = ""
        self.token = secrets.token_hex(16)
        self._spent = False  # True once self.token has been used for a holding
        self.job_id = ""
        self.job_func = ""
        self._reset_view()
        self._context_token: contextvars.Token[Any] | None = None

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless this lock is still validly held by this process.

        Noticing an expired deadline here (before the renewal thread did) counts as the loss
        (signal, log, metric, ``on_lost``). In a forked child it raises without touching Redis.
        """
        if self._foreign():
            raise self._error(
                LockLost,
                f"Lock is held by process {self.pid}, not by this one ({os.getpid()}): a "
                "forked child does not hold its parent's locks",
            )
        if not self.held:
            self._declare_lost("validity deadline passed")
            released = self.state is LockState.RELEASED
            reason = self.lost_reason or (
                "already released" if released else "validity deadline passed"
            )
            raise self._error(LockLost, f"Lock is no longer held: {reason}")

    @async_unsafe(_IN_LOOP)
    def owned(self) -> bool:
        """Ask Redis whether the lock still carries this object's token, without renewing it.

        One read. Finding it gone or taken marks a held lock LOST (as a renewal would). False
        without asking when not held here. It may still be owned on the server after its local
        deadline passed: act on ``held`` / :meth:`ensure_held`."""
        if self._foreign() or self.state not in (*_HOLDING, LockState.LOST):
            return False
        try:
            stored = client(self.cache).hget(self.key, "token")
        except REDIS_ERRORS as exc:
            raise self._unavailable(exc, "check the lock") from exc
        if stored is not None and text(stored) == self.token:
            return True
        outcome = Outcome.GONE if stored is None else Outcome.OTHER_OWNER
        self._declare_lost(outcome.reason)
        return False

    def _declare_lost(self, reason: str) -> None:
        renewer().remove(self)
        if self.mark_lost(reason):
            self.announce_lost(reason)

    def _unavailable(self, exc: BaseException, action: str) -> LockBackendUnavailable:
        return unavailable(exc, action, resource=self.resource, key=self.key, owner=self.owner)

    @async_unsafe(_IN_LOOP)
    def acquire(self, wait: float | None = None) -> bool:
        """Take the lock; if it is busy, wait in line for up to ``wait`` seconds.

        ``wait`` defaults to this lock's (0: one try; ``math.inf``: until it gets it,
        interruptible). While others wait, a free lock is theirs and a newcomer is refused.
        Returns False if still busy (or reserved for earlier waiters) after ``wait``.

        Raises :class:`LockBackendUnavailable` if Redis cannot be asked or answered too late (a
        failed call can be repeated: the object keeps its token and its place in line), and
        :class:`LockError` if this object already holds the lock or another thread is in this
        object's acquire or release."""
        self._start_call()
        try:
            return self._acquire(wait)
        finally:
            self._calls.release()

    def _acquire(self, wait: float | None) -> bool:
        """The body of :meth:`acquire`, run between :meth:`_start_call` and its end.

        It returns with the lock held, or the lock is not held by this object: an acquire that
        got the lock but ends raising (``KeyboardInterrupt`` in a round trip after it was got,
        or a ``lock_acquired`` receiver's exception) gives it back first."""
        wait, args = self._prepare_acquire(wait)
        entry = self.index_entry()
        started = time.monotonic()
        turn: waiting.Turn | None = None  # once known: a lock got is given back on an error
        try:
            try:
                found = client(self.cache)  # on Redis Cluster, made by asking a node
                if wait > 0 or self.limit > 1:  # with a limit, a one-try is a wait's last call
                    turn = self._wait_in_line(found, args, started + wait)
                    if turn.reply > 0 and not turn.indexed:  # handed over, or Redis Cluster
                        drive(self._add_to_index(self.index_entry()), found)
                else:
                    turn = self._try_once_interruptible(found, args, entry, started)
            except REDIS_ERRORS as exc:
                raise self._failed_attempt(exc) from exc
            return drive(self._taken(found, turn, started, wait), found)
        except LockBackendUnavailable:
            raise  # a failed attempt (kept for a repeat), or a lock _taken gave back itself
        except BaseException:
            if turn is not None and turn.reply > 0:
                self._forget_got(turn)
                drive(self._give_back(), found)
            raise

    def _try_once_interruptible(
        self, found: Any, args: list[Any], entry: index.Entry, started: float
    ) -> waiting.Turn:
        """One ACQUIRE. Interrupted meanwhile (not by a Redis error: a repeat of the acquire
        recovers from that), the lock it may have got is given back first."""
        try:
            return drive(self._try_once(found, args, entry, started), found)
        except REDIS_ERRORS:
            raise
        except BaseException:
            drive(self._give_back(), found)
            raise

    def _forget_got(self, turn: waiting.Turn) -> None:
        """Before giving back the lock of ``turn``, got by an acquire that ends raising: not
        renewed, and released if it was already recorded as held; ``key`` names its slot."""
        renewer().remove(self)
        if self.state in _HOLDING:
            self.mark_released()
        self._take_slot(turn.slot)

    def _prepare_acquire(self, wait: float | None) -> tuple[float, list[Any]]:
        """Check that an acquire may start and with what ``wait``; returns that wait (s) and
        ACQUIRE's arguments (the token, fresh if the last one held the lock, and the details of
        the holder, this process and its RQ job)."""
        if self.state in _HOLDING and not self._foreign():
            raise self._error(LockError, "This Lock object already holds the lock")
        if wait is None:
            wait = self.wait
        else:
            wait = _check_wait(f"lock({self.resource!r}):", wait)
        if self._spent:
            # A fresh token per holding: a late renew of the previous one can never extend this
            # one (nor can a forked child's acquire find its parent's lock). A failed acquire
            # keeps it: its repeat finds the lock the failed one may have taken on the server.
            self.token = secrets.token_hex(16)
            self._spent = False
        self.job_id, self.job_func, details = holder_details()
        if self.slot:
            self._take_slot(0)
        return wait, [self.token, self.ttl_ms, FENCE_COUNTER_TTL_MS, *details]

    def _take_slot(self, slot: int) -> None:
        """Point ``keys``, ``key`` and ``slot`` at the lock hash of ``slot``."""
        self.slot = slot
        self.keys = self.keys.at(slot)
        self.key = self.keys.lock

    def _failed_attempt(self, exc: BaseException) -> LockBackendUnavailable:
        """An acquire that Redis failed: counted as a failed attempt; the error to raise (this
        object keeps its token and its place in line, so the acquire can be repeated)."""
        self._count_failed_attempt()
        return self._unavailable(exc, "acquire the lock")

    def _taken(self, found: Any, turn: waiting.Turn, started: float, wait: float) -> Steps[bool]:
        """The end of an acquire that asked at the monotonic ``started`` with ``wait`` and got
        ``turn``: True, the lock held, when it was got and is usable (:meth:`_usable_for`);
        False, reported busy, when it was not."""
        now = time.monotonic()
        waited = now - started if wait > 0 else 0.0  # one try waits for nothing
        if turn.reply <= 0:
            metrics.record_acquire(self.family, self.job_func, waited, acquired=False)
            self._report_busy(turn, waited)
            return False
        if turn.slot != self.slot:
            self._take_slot(turn.slot)
        valid_for = yield from self._usable_for(found, turn, now)
        self._hold(turn, valid_for, waited)
        # Counted once the renewal thread knows the lock (``_hold``): it leaves a job's metrics
        # to the job's release.
        metrics.record_acquire(self.family, self.job_func, waited, acquired=True)
        return True

    def _try_once(
        self, found: Any, args: list[Any], entry: index.Entry, started: float
    ) -> Steps[waiting.Turn]:
        """One ACQUIRE, in one round trip with its active-lock index entry (on Redis Cluster,
        the entry follows if the lock was got). The lock's validity counts from ``started``
        (monotonic s, taken before sending).

        A connection lost mid-call sends the script once more: it recognises this token, so
        a repeat whose first try took the lock gets the same lock and fence back. Redis
        errors, including a reply the server refused, are raised."""
        index_keys, index_args = index.in_script(found, self.keys.prefix, entry)
        script_keys = [*waiting.lock_keys(self.keys), *index_keys]
        calls: list[Call] = [(ACQUIRE, script_keys, [*args, *index_args])]
        try:
            replies = yield Send(calls)
        except RedisConnectionError:  # lost mid-call: safe to send again
            replies = yield Send(calls)
        reply = replies[0]
        if isinstance(reply, Exception):
            raise reply
        turn = waiting.Turn(reply=int(reply), sent=started, valid_for=None, next_ticket="")
        if turn.reply > 0 and not index_keys:  # Redis Cluster: the index is on other nodes
            yield from self._add_to_index(entry)
        return turn

    def _wait_in_line(self, found: Any, args: list[Any], deadline: float) -> waiting.Turn:
        """Wait in line for the lock until the monotonic ``deadline`` (s); a lock got is indexed
        by WAIT itself, or by the caller when handed over (or on Redis Cluster). A lock handed
        over with less than its TTL left is renewed before returning when there is no
        heartbeat (else the heartbeat renews it within ``Turn.valid_for``). Redis errors are
        raised; an interruption leaves the line (:func:`.waiting.wait_in_line`)."""
        confirm = not self.heartbeat
        turn = waiting.wait_in_line(
            found,
            self.cache,
            self.keys,
            self.owner,
            args,
            deadline,
            confirm=confirm,
            limit=self.limit,
            index_call=index.in_wait_script(found, self.keys.prefix, self.index_entry()),
        )
        if turn.reply > 0:
            self._take_slot(turn.slot)
        return turn

    def _add_to_index(self, entry: index.Entry) -> Steps[None]:
        """Add a holding ACQUIRE did not index to the active-lock index, in a round trip of
        its own. Best effort: a Redis error is ignored (each renewal refreshes the entry)."""
        with contextlib.suppress(*REDIS_ERRORS):
            yield Send(index.add_calls(self.keys.prefix, [entry]))

    def _report_busy(self, turn: waiting.Turn, waited: float) -> None:
        """Signal and log an acquire that found the lock busy after ``waited`` s."""
        lock_contended.send(sender=Lock, lock=self, waited=waited)
        pttl = -1 - turn.reply  # "busy": -1 - the holder's PTTL in ms
        log_lock(logging.INFO, "contended", self, "lock busy", reason=f"held, pttl={pttl}ms")

    def _usable_for(self, found: Any, turn: waiting.Turn, now: float) -> Steps[float]:
        """How long (s, from the monotonic ``turn.sent``) the lock just got stays valid.

        Raises :class:`LockBackendUnavailable`, after giving the lock back, if at ``now``
        (monotonic s, when the reply arrived) that validity less the drift margin had already
        run out, or if with ``REPLICA_ACKS`` it did not reach that many replicas in time
        (:func:`.replicas.shortfall`, one renewal)."""
        if turn.valid_for is None:
            valid_for = self.ttl
        else:
            valid_for = turn.valid_for  # handed over: what was left of the TTL
        answered_after = now - turn.sent
        if answered_after >= valid_for - drift(valid_for):
            why = (
                f"Redis answered the acquire after {answered_after:.3f}s, when the lock's "
                f"validity (ttl {self.ttl:g}s minus the drift margin) had already run out"
            )
            error = yield from self._given_back(why)
            raise error
        if conf.get().REPLICA_ACKS:
            short = yield from replicas.shortfall(found, self.key, self.token, self.ttl_ms)
            if short:
                error = yield from self._given_back(short)
                raise error
        return valid_for

    def _hold(self, turn: waiting.Turn, valid_for: float, waited: float) -> None:
        """Record the lock as held: fence ``turn.reply``, valid for ``valid_for`` s from the
        monotonic ``turn.sent``. Then start renewing it (a handed-over lock within a third of
        that validity), and signal and log the acquire, which waited ``waited`` s."""
        self._next_ticket = turn.next_ticket
        self._spent = True
        self._begin(turn.reply, turn.sent, valid_for)
        if turn.valid_for is None:
            renew_within = math.inf  # the full TTL: on the heartbeat's usual schedule
        else:
            renew_within = valid_for / 3
        renewer().add(self, renew_within=renew_within)
        if lock_acquired.receivers:  # what send() looks at first: no call when nobody listens
            lock_acquired.send(sender=Lock, lock=self, waited=waited)
        log_lock(logging.DEBUG, "acquired", self, "lock acquired")

    def _count_failed_attempt(self) -> None:
        """Count an acquire that ended in an error: an attempt, and an error."""
        metrics.count("acquire_attempts", self.family, self.job_func)
        metrics.count("acquire_errors", self.family, self.job_func)

    def _unindex(self) -> list[Any]:
        """The command that removes this holding's active-lock index entry."""
        return index.remove_call(
            self.keys.prefix, self.resource, self.owner, self.job_id, self.slot
        )

    def _given_back(self, why: str) -> Steps[LockBackendUnavailable]:
        """An acquire that got the lock but cannot use it: counted as an acquire error, the
        lock given back (best effort: else it expires on its own), and the error to raise."""
        self._count_failed_attempt()
        yield from self._give_back()
        return self._error(LockBackendUnavailable, f"{why}; not acquired")

    def _give_back(self) -> Steps[None]:
        """Release a lock this object may have got but does not hold (no state to change),
        with its index entry. Best effort: a Redis error is ignored (it expires on its own)."""
        with contextlib.suppress(*REDIS_ERRORS):
            yield from waiting.release_steps(self.keys, self.token, "", [self._unindex()])

    @async_unsafe(_IN_LOOP)
    def renew(self) -> bool:
        """Renew now (replacing the TTL). False, and the lock marked lost, if no longer ours;
        False without asking Redis when not held, in a forked child, and once ``max_hold`` has
        passed (the lock then runs out, as with the heartbeat). With ``REPLICA_ACKS``, a renewal
        short of the replicas raises :class:`LockBackendUnavailable` and counts for nothing, as
        in the renewal thread (:mod:`.replicas`)."""
        sent = self._renewal_start()
        if sent is None:
            return False
        try:
            found = client(self.cache)
        except REDIS_ERRORS as exc:
            raise self._unavailable(exc, "renew the lock") from exc
        return drive(self._renewing(sent), found)

    def _renewal_start(self) -> float | None:
        """The monotonic send time of a renewal that may start now; None when not held here
        (or in a forked child) or past ``max_hold``."""
        if self.state not in _HOLDING or self._foreign():
            return None
        sent = time.monotonic()
        if sent >= self.hold_until:
            return None
        return sent

    def _renewing(self, sent: float) -> Steps[bool]:
        """One renewal sent at the monotonic ``sent``: True if renewed (the validity then counts
        from ``sent``), False and the lock marked lost if it was no longer ours."""
        try:
            code = yield from replicas.renew(self.key, self.token, self.ttl_ms)
        except LockBackendUnavailable as exc:
            raise self._error(LockBackendUnavailable, f"Renewal not counted: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise self._unavailable(exc, "renew the lock") from exc
        if code is not Outcome.OK:
            self._declare_lost(code.reason)
            return False
        self.confirm_renewed(sent)
        log_lock(logging.DEBUG, "renewed", self, "lock renewed")
        return True

    @async_unsafe(_IN_LOOP)
    def release(self) -> bool:
        """Release if still ours (compare-and-delete). False if it had expired or changed owner.

        A lock found lost here is marked LOST first (signal, log, metric, ``on_lost``), and
        ``lost`` / ``lost_reason`` keep saying so. Raises :class:`LockBackendUnavailable` if
        Redis cannot be asked (the lock then expires after its TTL), :class:`LockError` while
        another thread is in this object's acquire or release. In a forked child: False,
        without touching Redis (the lock is the parent's).
        """
        self._start_call()
        try:
            return self._release([])[0]
        finally:
            self._calls.release()

    @async_unsafe(_IN_LOOP)
    def release_with(self, calls: list[Call]) -> tuple[bool, list[Any] | None]:
        """:meth:`release`, with ``calls`` (commands for the lock's Redis server, such as a job's
        outcome) sent in the release's round trip. Returns (released, the calls' replies, a
        command the server refused giving its exception). The replies are None when the calls
        were not sent: the lock was not held here, or the round trip was cut off and the release
        was sent again without them (whether they ran is unknown; the caller sends them again).
        Raises as :meth:`release` does."""
        self._start_call()
        try:
            return self._release(calls)
        finally:
            self._calls.release()

    def _release(self, calls: list[Call]) -> tuple[bool, list[Any] | None]:
        """The body of :meth:`release_with`, run between :meth:`_start_call` and its end."""
        if not self._releasable():
            return False, None
        try:
            found = client(self.cache)
        except REDIS_ERRORS as exc:
            renewer().remove(self)
            self.mark_released()
            raise self._unavailable(exc, "release the lock") from exc
        return drive(self._release_steps(found, calls), found)

    def _releasable(self) -> bool:
        """Whether a release has anything to do: the lock was held (or lost) by this process."""
        return not self._foreign() and self.state in (*_HOLDING, LockState.LOST)

    def _release_steps(self, found: Any, calls: list[Call]) -> Steps[tuple[bool, list[Any] | None]]:
        """Release the lock on ``found`` with ``calls`` riding along (see :meth:`release_with`).

        The heartbeat stops first; the hold time, pending metrics (always inside a job, unless an
        in-process worker runs it: a work horse may exit right after) and the index entry's
        removal ride in the release's round trip. A connection lost mid-call sends the release
        once more, without the metrics and ``calls``."""
        renewer().remove(self)
        sent = time.monotonic()
        if sent >= self.valid_until and self.mark_lost("validity deadline passed"):
            self.announce_lost("validity deadline passed")
        valid = self.state is not LockState.LOST
        held_for = sent - (self.acquired_at or sent)
        metrics.observe("hold_seconds", self.family, self.job_func, held_for)
        unindex = index.in_release(found, self.keys.prefix, self.index_entry())
        also = [] if unindex[0] else [self._unindex()]  # Redis Cluster: not in RELEASE
        pending = metrics.take_for_flush(force=bool(self.job_id) and metrics.flush_at_job_end())
        flush = [metrics.flush_call(pending)] if pending else []
        riders: list[Any] | None = None
        retried = False
        try:
            try:
                code, replies = yield from waiting.release_steps(
                    self.keys, self.token, self._next_ticket, [*also, *flush, *calls], unindex
                )
                riders = replies[len(also) + len(flush) :]
            except RedisConnectionError:  # lost mid-call: once more, without the metrics
                metrics.add(pending)  # kept for the next flush (twice rather than lost)
                retried = True
                pending = {}
                code, replies = yield from waiting.release_steps(
                    self.keys, self.token, self._next_ticket, also, unindex
                )
        except REDIS_ERRORS as exc:
            self.mark_released()
            metrics.add(pending)
            raise self._unavailable(exc, "release the lock") from exc
        if pending and isinstance(replies[len(also)], Exception):  # refused, or node down
            metrics.add(pending)
        # Sent twice, it finds the lock gone, or handed over (another owner), if the first one
        # ran: that was our own release, if the lock was still valid when sent.
        released = code is Outcome.OK or (retried and valid)
        self._released(code, released, held_for)
        return released, riders

    def _released(self, code: Outcome, released: bool, held_for: float) -> None:
        """Record the end of a holding (``released``: by this release), held ``held_for`` s."""
        if not released and self.mark_lost(code.reason):
            self.announce_lost(code.reason)
        self.mark_released()
        if lock_released.receivers:  # (as in _hold)
            lock_released.send(sender=Lock, lock=self, released=released, held_for=held_for)
        if released:
            log_lock(logging.DEBUG, "released", self, "lock released", reason="ok")
        else:
            message = "lock was no longer ours at release"
            log_lock(logging.WARNING, "released", self, message, reason=code.reason)

    def __enter__(self) -> Lock:
        if not self.acquire():
            raise LockNotAcquired(
                f"Lock busy after waiting {self.wait:g}s", resource=self.resource, key=self.key
            )
        self._context_token = set_current_lock(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        released_in_block = self._leave_context()
        if self._foreign():
            return  # a forked child leaving its copy of the block: the lock is the parent's
        try:
            self.release()
        except LockBackendUnavailable as error:
            self._release_failed_on_leaving(exc, error)
            return
        self._check_kept(exc, released_in_block)

    def _leave_context(self) -> bool:
        """Leaving a ``with`` block: ``current_lock()`` back as it was; whether the block
        released the lock itself."""
        token = self._context_token
        self._context_token = None
        if token is not None:
            reset_current_lock(token, self)
        return self.state is LockState.RELEASED

    def _release_failed_on_leaving(
        self, exc: BaseException | None, error: LockBackendUnavailable
    ) -> None:
        """Leaving a block, the release raised ``error``: raised again, unless the block raised
        ``exc``, which wins (the lock expires after its TTL)."""
        if exc is None:
            raise error
        logger.warning("could not release %s after an error in the block", self.key)

    def _check_kept(self, exc: BaseException | None, released_in_block: bool) -> None:
        """:class:`LockLost` when the lock was lost in a block that raised nothing (``exc``)
        and did not release it itself."""
        if exc is None and not released_in_block and self.lost_reason:
            raise self._error(
                LockLost, f"Lock was lost before the end of the with block: {self.lost_reason}"
            )

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        """Use the lock as a decorator, as ``transaction.atomic`` is used: each call of
        ``func`` runs inside ``with`` a new :class:`Lock` made with this one's arguments, so
        calls in several threads never share one holding. A call raises
        :class:`LockNotAcquired` when the lock stays busy past ``wait``, and
        :class:`LockLost` as a ``with`` block does. ``TypeError`` for an ``async def``."""
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"lock({self.resource!r}) cannot decorate the async def {func.__qualname__}: "
                f"its body would run after the call returned, outside the lock: use "
                f"alock({self.resource!r})"
            )

        @functools.wraps(func)
        def locked(*args: P.args, **kwargs: P.kwargs) -> R:
            with Lock(self.resource, **self._arguments):
                return func(*args, **kwargs)

        return locked


Lock.signal_sender = Lock  # an AsyncLock's signals are sent with sender=Lock too


def current_lock() -> Lock | None:
    """The :class:`Lock` the running code holds: the one entered last by a ``with`` block or a
    decorated call in this context (thread, RQ job, asyncio task), or the lock of the
    ``@locked_job`` running here; None outside any."""
    return cast("Lock | None", current.current_lock())


def _check_wait(what: str, wait: object) -> float:
    """A ``wait`` argument: finite and in range, or ``math.inf`` (wait until acquired)."""
    if isinstance(wait, float) and wait == math.inf:
        return wait
    return conf.WAIT_RANGE.check(f"{what} wait", wait)


def lock(
    resource: str,
    *,
    ttl: float | None = None,
    wait: float | None = None,
    heartbeat: bool = True,
    max_hold: float | None = None,
    on_lost: OnLost | None = None,
    cache: str | None = None,
    using: str | None = None,
    limit: int = 1,
) -> Lock:
    """A :class:`Lock` on ``resource``, as redis-py's ``Redis.lock()`` makes its ``Lock``: use it
    with ``with lock("order:1") as held:``, as a decorator (``@lock("report")``), or call
    ``acquire()`` / ``release()``. Nothing is sent to Redis until it is acquired.

    ``resource``: what the lock protects (``"order:42"``: letters, digits, ``_ . : @ / -``; the
    part before the first ``:`` is its family in metrics). ``ttl`` (s, default
    ``JOBLOCK["LOCK_TTL"]``): how long the lock lives unless renewed. ``wait`` (s, default
    ``JOBLOCK["ACQUIRE_WAIT"]``): how long an acquire waits in line for a busy lock (0: one
    try; ``math.inf``: until it gets it). ``heartbeat``: renew it every
    ``HEARTBEAT_INTERVAL`` (default ``ttl / 3``) while held, until ``max_hold`` (s), calling
    ``on_lost(lock, reason)`` when it finds it lost. ``cache``: the django-redis cache alias
    (default ``JOBLOCK["REDIS_ALIAS"]``; ``using=``, its old name, warns). ``limit``: how many
    holders at once (default 1; up to 100), each in a slot of its own. Raises ``ValueError``
    for a bad resource or number."""
    return Lock(
        resource,
        ttl=ttl,
        wait=wait,
        heartbeat=heartbeat,
        max_hold=max_hold,
        on_lost=on_lost,
        cache=cache_argument(cache, using),
        limit=limit,
    )
