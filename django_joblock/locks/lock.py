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
import logging
import math
import os
import secrets
import time
from types import TracebackType
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from .. import conf, metrics
from ..backend import REDIS_ERRORS, Call, client, send, text, unavailable
from ..exceptions import LockBackendUnavailable, LockError, LockLost, LockNotAcquired
from ..logs import log_lock, logger
from ..signals import lock_acquired, lock_contended, lock_released
from . import index, replicas, waiting
from .current import current_lock, reset_current_lock, set_current_lock
from .info import holder_details
from .keys import LockKeys, validate_resource
from .renewal import renewer
from .scripts import ACQUIRE, FENCE_COUNTER_TTL_MS, Outcome
from .state import Holding, LockState, OnLost, drift

__all__ = ["Lock", "LockState", "current_lock", "lock", "reset_current_lock", "set_current_lock"]

_HOLDING = (LockState.HELD, LockState.SUSPECT)


class Lock(Holding):
    """A lock on one resource. Use as a context manager or call acquire/release yourself.

    ``ttl`` (s) defaults to ``JOBLOCK["LOCK_TTL"]``; ``wait`` (s) is how long :meth:`acquire`
    waits in line for a busy lock (default ``JOBLOCK["ACQUIRE_WAIT"]``, 0 = one try,
    ``math.inf`` = until it gets it). With ``heartbeat`` the renewal thread renews the lock
    every ``HEARTBEAT_INTERVAL`` (default ttl/3) until ``max_hold`` (s), and calls
    ``on_lost(lock, reason)`` when it finds it lost. ``using`` names the django-redis cache.
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
        using: str | None = None,
    ) -> None:
        settings = conf.get()
        self.resource: str = validate_resource(resource)
        what = f"lock({resource!r}):"
        ttl = settings.LOCK_TTL if ttl is None else ttl
        self.ttl: float = conf.TTL_RANGE.check(f"{what} ttl", ttl)
        self.wait: float = _check_wait(what, settings.ACQUIRE_WAIT if wait is None else wait)
        hold = settings.MAX_HOLD if max_hold is None else max_hold
        self.max_hold = None if hold is None else conf.HOLD_RANGE.check(f"{what} max_hold", hold)
        self.heartbeat: bool = bool(heartbeat)
        self.heartbeat_interval: float = settings.heartbeat_interval(self.ttl)
        self.on_lost: OnLost | None = on_lost
        self.alias: str = using or settings.REDIS_ALIAS
        self.keys = LockKeys(settings.KEY_PREFIX, self.resource)
        self.key: str = self.keys.lock
        self.family: str = self.keys.family
        # Who was first in line behind this holder when it got the lock: its release hands
        # the lock to that waiter in the same round trip (see waiting.release).
        self._next_ticket = ""
        self.token, self._spent = secrets.token_hex(16), False
        self.job_id = self.job_func = ""
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

    def owned(self) -> bool:
        """Ask Redis whether the lock still carries this object's token, without renewing it.

        One read. Finding it gone or taken marks a held lock LOST (as a renewal would). False
        without asking when not held here. It may still be owned on the server after its local
        deadline passed: act on ``held`` / :meth:`ensure_held`."""
        if self._foreign() or self.state not in (*_HOLDING, LockState.LOST):
            return False
        try:
            stored = client(self.alias).hget(self.key, "token")
        except REDIS_ERRORS as exc:
            raise self._unavailable(exc, "check the lock") from exc
        if stored is not None and text(stored) == self.token:
            return True
        self._declare_lost((Outcome.GONE if stored is None else Outcome.OTHER_OWNER).reason)
        return False

    def _declare_lost(self, reason: str) -> None:
        renewer().remove(self)
        if self.mark_lost(reason):
            self.announce_lost(reason)

    def _unavailable(self, exc: BaseException, action: str) -> LockBackendUnavailable:
        return unavailable(exc, action, resource=self.resource, key=self.key, owner=self.owner)

    def acquire(self, wait: float | None = None) -> bool:
        """Take the lock; if it is busy, wait in line for up to ``wait`` seconds.

        ``wait`` defaults to this lock's (0: one try; ``math.inf``: until it gets it,
        interruptible). While others wait, a free lock is theirs and a newcomer is refused.
        Returns False if still busy (or reserved for earlier waiters) after ``wait``.

        Raises :class:`LockBackendUnavailable` if Redis cannot be asked or answered too late (a
        failed call can be repeated: the object keeps its token and its place in line), and
        :class:`LockError` if this object already holds the lock or another thread is in this
        object's acquire or release."""
        with self._one_call():
            return self._acquire(wait)

    def _acquire(self, wait: float | None) -> bool:
        if self.state in _HOLDING and not self._foreign():
            raise self._error(LockError, "This Lock object already holds the lock")
        wait = self.wait if wait is None else _check_wait(f"lock({self.resource!r}):", wait)
        if self._spent:
            # A fresh token per holding: a late renew of the previous one can never extend this
            # one (nor can a forked child's acquire find its parent's lock). A failed acquire
            # keeps it: its repeat finds the lock the failed one may have taken on the server.
            self.token, self._spent = secrets.token_hex(16), False
        self.job_id, self.job_func, details = holder_details()
        args = [self.token, self.ttl_ms, FENCE_COUNTER_TTL_MS, *details]
        entry = (self.resource, self.owner, self.ttl, self.job_id)
        started = time.monotonic()
        try:
            found = client(self.alias)  # on Redis Cluster, made by asking a node
            index_keys: list[str] = []
            if wait > 0:
                deadline = started + wait
                confirm = not self.heartbeat  # else the heartbeat renews a handed-over lock
                turn = waiting.wait_in_line(
                    found, self.alias, self.keys, self.owner, args, deadline, confirm=confirm
                )
            else:
                index_keys, index_args = index.in_script(found, self.keys.prefix, entry)
                script_keys = [*waiting.lock_keys(self.keys), *index_keys]
                calls: list[Call] = [(ACQUIRE, script_keys, [*args, *index_args])]
                try:
                    reply = send(found, calls)[0]
                except RedisConnectionError:  # lost mid-call: safe to send again (see above)
                    reply = send(found, calls)[0]
                if isinstance(reply, Exception):
                    raise reply
                turn = waiting.Turn(int(reply), started, None, "")
            if turn.reply > 0 and not index_keys:  # after the line, or Cluster (other nodes):
                with contextlib.suppress(*REDIS_ERRORS):  # best effort, renewals refresh it
                    send(found, index.add_calls(self.keys.prefix, [entry]))
        except REDIS_ERRORS as exc:
            metrics.count("acquire_attempts", self.family, self.job_func)
            metrics.count("acquire_errors", self.family, self.job_func)
            raise self._unavailable(exc, "acquire the lock") from exc
        now = time.monotonic()
        waited = now - started if wait > 0 else 0.0  # one try waits for nothing
        metrics.record_acquire(self.family, self.job_func, waited, acquired=turn.reply > 0)
        if turn.reply <= 0:
            lock_contended.send(sender=Lock, lock=self, waited=waited)
            pttl = -1 - turn.reply  # "busy": -1 - the holder's PTTL in ms
            log_lock(logging.INFO, "contended", self, "lock busy", reason=f"held, pttl={pttl}ms")
            return False
        valid_for = self.ttl if turn.valid_for is None else turn.valid_for
        if now - turn.sent >= valid_for - drift(valid_for):
            raise self._given_back(
                found,
                f"Redis answered the acquire after {now - turn.sent:.3f}s, when the lock's "
                f"validity (ttl {self.ttl:g}s minus the drift margin) had already run out",
            )
        if conf.get().REPLICA_ACKS:
            short = replicas.shortfall(found, self.key, self.token, self.ttl_ms)
            if short:
                raise self._given_back(found, short)
        self._next_ticket, self._spent = turn.next_ticket, True
        self._begin(turn.reply, turn.sent, valid_for)
        renewer().add(self, renew_within=math.inf if turn.valid_for is None else valid_for / 3)
        lock_acquired.send(sender=Lock, lock=self, waited=waited)
        log_lock(logging.DEBUG, "acquired", self, "lock acquired")
        return True

    def _unindex(self) -> list[Any]:
        """The command that removes this holding's active-lock index entry."""
        return index.remove_call(self.keys.prefix, self.resource, self.owner, self.job_id)

    def _given_back(self, found: Any, why: str) -> LockBackendUnavailable:
        """An acquire that got the lock but cannot use it: counted as an acquire error, the
        lock given back (best effort: else it expires on its own), and the error to raise."""
        metrics.count("acquire_attempts", self.family, self.job_func)
        metrics.count("acquire_errors", self.family, self.job_func)
        with contextlib.suppress(*REDIS_ERRORS):
            waiting.release(found, self.keys, self.token, "", [self._unindex()])
        return self._error(LockBackendUnavailable, f"{why}; not acquired")

    def renew(self) -> bool:
        """Renew now (replacing the TTL). False, and the lock marked lost, if no longer ours;
        False without asking Redis when not held, in a forked child, and once ``max_hold`` has
        passed (the lock then runs out, as with the heartbeat). With ``REPLICA_ACKS``, a renewal
        short of the replicas raises :class:`LockBackendUnavailable` and counts for nothing, as
        in the renewal thread (:mod:`.replicas`)."""
        if self.state not in _HOLDING or self._foreign():
            return False
        sent = time.monotonic()
        if sent >= self.hold_until:
            return False
        try:
            code = replicas.renew(client(self.alias), self.key, self.token, self.ttl_ms)
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

    def release(self) -> bool:
        """Release if still ours (compare-and-delete). False if it had expired or changed owner.

        A lock found lost here is marked LOST first (signal, log, metric, ``on_lost``), and
        ``lost`` / ``lost_reason`` keep saying so. Raises :class:`LockBackendUnavailable` if
        Redis cannot be asked (the lock then expires after its TTL), :class:`LockError` while
        another thread is in this object's acquire or release. In a forked child: False,
        without touching Redis (the lock is the parent's).
        """
        with self._one_call():
            return self._release()

    def _release(self) -> bool:
        if self._foreign() or self.state not in (*_HOLDING, LockState.LOST):
            return False
        renewer().remove(self)
        sent = time.monotonic()
        if sent >= self.valid_until and self.mark_lost("validity deadline passed"):
            self.announce_lost("validity deadline passed")
        valid = self.state is not LockState.LOST
        held_for = sent - (self.acquired_at or sent)
        metrics.observe("hold_seconds", self.family, self.job_func, held_for)
        entry = (self.resource, self.owner, self.ttl, self.job_id)
        retried, pending = False, {}
        try:
            found = client(self.alias)
            index_keys, index_args = index.in_script(found, self.keys.prefix, entry)
            unindex = (index_keys[:1], index_args[1:2])
            also = [] if index_keys else [self._unindex()]  # Redis Cluster: not in RELEASE
            # Metrics ride along: always inside a job (a work horse may exit right after).
            pending = metrics.take_for_flush(force=bool(self.job_id))
            flush = [metrics.flush_call(pending)] if pending else []
            next_ticket = self._next_ticket
            try:
                code, replies = waiting.release(
                    found, self.keys, self.token, next_ticket, [*also, *flush], unindex
                )
            except RedisConnectionError:  # lost mid-call: once more, without the metrics,
                metrics.restore(pending)  # kept for the next flush (twice rather than lost)
                retried, pending = True, {}
                code, replies = waiting.release(
                    found, self.keys, self.token, next_ticket, also, unindex
                )
        except REDIS_ERRORS as exc:
            self.mark_released()
            metrics.restore(pending)
            raise self._unavailable(exc, "release the lock") from exc
        if pending and isinstance(replies[-1], Exception):  # refused, or its node down (Cluster)
            metrics.restore(pending)
        # Sent twice, it finds the lock gone, or handed over (another owner), if the first one
        # ran: that was our own release, if the lock was still valid when sent.
        released = code is Outcome.OK or (retried and valid)
        if not released and self.mark_lost(code.reason):
            self.announce_lost(code.reason)
        self.mark_released()
        lock_released.send(sender=Lock, lock=self, released=released, held_for=held_for)
        if released:
            log_lock(logging.DEBUG, "released", self, "lock released", reason="ok")
        else:
            message = "lock was no longer ours at release"
            log_lock(logging.WARNING, "released", self, message, reason=code.reason)
        return released

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
        token, self._context_token = self._context_token, None
        if token is not None:
            reset_current_lock(token, self)
        if self._foreign():
            return  # a forked child leaving its copy of the block: the lock is the parent's
        released_in_block = self.state is LockState.RELEASED
        try:
            self.release()
        except LockBackendUnavailable:
            if exc is None:
                raise
            # The block's own exception wins; the lock expires after its TTL.
            logger.warning("could not release %s after an error in the block", self.key)
            return
        if exc is None and not released_in_block and self.lost_reason:
            raise self._error(
                LockLost, f"Lock was lost before the end of the with block: {self.lost_reason}"
            )


def _check_wait(what: str, wait: object) -> float:
    """A ``wait`` argument: finite and in range, or ``math.inf`` (wait until acquired)."""
    if isinstance(wait, float) and wait == math.inf:
        return wait
    return conf.WAIT_RANGE.check(f"{what} wait", wait)


# The documented lower-case entry point, ``with lock("order:1") as held:``, is the class.
lock = Lock
