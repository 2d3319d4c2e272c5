"""What a lock's sync and asyncio APIs share: its arguments, and the flows they drive.

:class:`BaseLock` checks a lock's arguments and runs each Redis operation of a holding (try
once, take the turn got in line, give back, renew, release with hand-over) as a flow: a
generator of Redis steps (:mod:`..redis_steps`) that :class:`~.lock.Lock` drives on the sync
client and :class:`~.async_lock.AsyncLock` on the asyncio one. The guarantees are stated where
users meet them, in :mod:`.lock`; the holder's local state is :class:`~.state.Holding`'s.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import secrets
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from .. import conf, metrics
from ..backend import REDIS_ERRORS, Call, cache_argument, unavailable
from ..exceptions import LockBackendUnavailable, LockError
from ..logs import log_lock
from ..redis_steps import Send, Steps
from ..signals import lock_acquired, lock_contended, lock_released
from . import index, replicas, waiting
from .info import holder_details
from .keys import LockKeys, validate_limit, validate_resource
from .renewal import renewer
from .scripts import ACQUIRE, FENCE_COUNTER_TTL_MS, Outcome
from .state import HOLDING, Holding, LockState, OnLost, drift

__all__ = ["BaseLock"]


class BaseLock(Holding):
    """A lock's arguments and Redis flows, without the API that drives them (see the module
    docs); its arguments are :class:`~.lock.Lock`'s."""

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

    def _declare_lost(self, reason: str) -> None:
        renewer().remove(self)
        if self.mark_lost(reason):
            self.announce_lost(reason)

    def _unavailable(self, exc: BaseException, action: str) -> LockBackendUnavailable:
        return unavailable(exc, action, resource=self.resource, key=self.key, owner=self.owner)

    def _prepare_acquire(self, wait: float | None) -> tuple[float, list[Any]]:
        """Check that an acquire may start and with what ``wait``; returns that wait (s) and
        ACQUIRE's arguments (the token, fresh if the last one held the lock, and the details of
        the holder, this process and its RQ job)."""
        if self.state in HOLDING and not self._foreign():
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

    def _forget_got(self, turn: waiting.Turn) -> None:
        """Before giving back the lock of ``turn``, got by an acquire that ends raising: not
        renewed, and released if it was already recorded as held; ``key`` names its slot."""
        renewer().remove(self)
        if self.state in HOLDING:
            self.mark_released()
        self._take_slot(turn.slot)

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

    def _add_to_index(self, entry: index.Entry) -> Steps[None]:
        """Add a holding ACQUIRE did not index to the active-lock index, in a round trip of
        its own. Best effort: a Redis error is ignored (each renewal refreshes the entry)."""
        with contextlib.suppress(*REDIS_ERRORS):
            yield Send(index.add_calls(self.keys.prefix, [entry]))

    def _report_busy(self, turn: waiting.Turn, waited: float) -> None:
        """Signal and log an acquire that found the lock busy after ``waited`` s."""
        lock_contended.send(sender=self.signal_sender, lock=self, waited=waited)
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
        the validity it has left, :meth:`.renewal.Renewer.add`), and signal and log the
        acquire, which waited ``waited`` s."""
        self._next_ticket = turn.next_ticket
        self._spent = True
        self._begin(turn.reply, turn.sent, valid_for)
        if turn.valid_for is None:
            renewer().add(self)  # the full TTL: on the heartbeat's usual schedule
        else:
            renewer().add(self, valid_for=self.remaining())  # what is left of the hand-over's
        if lock_acquired.receivers:  # what send() looks at first: no call when nobody listens
            lock_acquired.send(sender=self.signal_sender, lock=self, waited=waited)
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

    def _renewal_start(self) -> float | None:
        """The monotonic send time of a renewal that may start now; None when not held here
        (or in a forked child) or past ``max_hold``."""
        if self.state not in HOLDING or self._foreign():
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

    def _releasable(self) -> bool:
        """Whether a release has anything to do: the lock was held (or lost) by this process."""
        return not self._foreign() and self.state in (*HOLDING, LockState.LOST)

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
        except BaseException:
            # Interrupted (KeyboardInterrupt, a cancelled task) with the release perhaps run on
            # the server, the lock perhaps handed over: no longer held here, as after a Redis
            # error (not renewed any more, it expires after its TTL if the release never ran).
            self.mark_released()
            metrics.add(pending)
            raise
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
            lock_released.send(
                sender=self.signal_sender, lock=self, released=released, held_for=held_for
            )
        if released:
            log_lock(logging.DEBUG, "released", self, "lock released", reason="ok")
        else:
            message = "lock was no longer ours at release"
            log_lock(logging.WARNING, "released", self, message, reason=code.reason)


def _check_wait(what: str, wait: object) -> float:
    """A ``wait`` argument: finite and in range, or ``math.inf`` (wait until acquired)."""
    if isinstance(wait, float) and wait == math.inf:
        return wait
    return conf.WAIT_RANGE.check(f"{what} wait", wait)
