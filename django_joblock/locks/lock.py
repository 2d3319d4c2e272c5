"""``Lock`` and ``lock()``: one holder per resource, with a TTL, an owner token and a fence.

Guarantees (with a single Redis primary whose clock does not step):

- at most one *valid* holder per resource: acquire is ``SET``-if-absent in one Lua script, and
  renew / release compare the owner token atomically (never a blind ``DEL`` or ``PEXPIRE``);
- every lock expires: the TTL is always set, so a dead holder frees it after at most ``ttl``;
- each acquisition gets a fence strictly greater than every earlier one for the same resource,
  for the database to reject a stale holder's writes (see :mod:`.fencing`);
- the holder's own view is conservative (see :mod:`.state`).

Rules (docs/locks.md): a lock belongs to the *process* that acquired it (a forked child never
touches its parent's lock in Redis); leaving a ``with`` block releases the lock in whatever
``contextvars`` context, and raises :class:`LockLost` if the lock had been lost and the block
raised nothing; a ``Lock`` nobody references any more is not renewed and expires.

Waiting (``wait`` > 0): a busy lock is waited for in line, in arrival order, and handed over
by the release rather than polled for (see :mod:`.waiting`). An uncontended acquire, a
``wait=0`` try and a release nobody waits for are one round trip each, their entry in the
active-lock index (:mod:`.index`) included.

Failure modes: Redis down, timing out or out of memory raises :class:`LockBackendUnavailable`
(never "busy"), within ``JOBLOCK["REDIS_TIMEOUT"]``; so does a reply that arrives after the
lock's validity already ran out. Nothing is retried behind the caller's back, but a failed
acquire can be repeated by the same ``Lock``: the script recognises its own token, so an
acquire whose reply was lost gets the same lock and fence back.
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from .. import conf, metrics
from ..backend import REDIS_ERRORS, client, is_cluster, send, unavailable
from ..exceptions import JoblockConfigError, LockBackendUnavailable, LockError, LockNotAcquired
from ..logs import log_lock, logger
from ..signals import lock_acquired, lock_contended, lock_lost, lock_released
from . import index, waiting
from .info import holder_details
from .keys import LockKeys, validate_resource
from .renewal import renewer
from .scripts import ACQUIRE, FENCE_COUNTER_TTL_MS, RENEW, Outcome, busy_pttl_ms
from .state import Holding, LockState, drift

OnLost = Callable[["Lock", str], Any]

_current: contextvars.ContextVar[Lock | None] = contextvars.ContextVar(
    "django_joblock_current_lock", default=None
)


class Lock(Holding):
    """A lock on one resource. Use as a context manager or call acquire/release yourself.

    ``ttl`` (s) defaults to ``JOBLOCK["LOCK_TTL"]``; ``wait`` (s) is how long :meth:`acquire`
    waits in line for a busy lock (default ``JOBLOCK["ACQUIRE_WAIT"]``, 0 = one try,
    ``math.inf`` = until it gets it). With ``heartbeat`` the process's renewal thread renews
    the lock every ``HEARTBEAT_INTERVAL`` (default ttl/3); ``max_hold`` (s) stops renewing
    after that long. ``on_lost(lock, reason)`` is called (from the renewal thread) when the
    lock is found lost. ``using`` names the django-redis cache.
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
        self.ttl: float = conf.TTL_RANGE.check(
            f"{what} ttl", settings.LOCK_TTL if ttl is None else ttl
        )
        self.wait: float = _check_wait(what, settings.ACQUIRE_WAIT if wait is None else wait)
        hold = settings.MAX_HOLD if max_hold is None else max_hold
        self.max_hold: float | None = (
            None if hold is None else conf.HOLD_RANGE.check(f"{what} max_hold", hold)
        )
        self.heartbeat: bool = bool(heartbeat)
        self.heartbeat_interval: float = settings.heartbeat_interval(self.ttl)
        self.on_lost: OnLost | None = on_lost
        self.alias: str = using or settings.REDIS_ALIAS
        self.keys = LockKeys(settings.KEY_PREFIX, self.resource)
        self.key: str = self.keys.lock
        self.family: str = self.keys.family
        # The ticket first in line behind this holder when it got the lock: its release hands
        # the lock to it in one round trip (see waiting.release).
        self._next_ticket = ""
        self.token = secrets.token_hex(16)
        self.job_id: str = ""
        self.job_func: str = ""
        self._reset_view()
        self._context_token: contextvars.Token[Lock | None] | None = None

    # -- checks --------------------------------------------------------------------------
    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless this lock is still validly held by this process.

        Noticing an expired deadline here (before the renewal thread did) counts as the loss:
        the lock is marked LOST with the usual signal, log, metric and ``on_lost``. In a forked
        child it raises without touching Redis or the lock's state.
        """
        if self._foreign():
            raise self._lost_error(
                f"Lock is held by process {self.pid}, not by this one ({os.getpid()}): a "
                "forked child does not hold its parent's locks"
            )
        if not self.held:
            self._declare_lost("validity deadline passed")
            reason = self.lost_reason or (
                "validity deadline passed"
                if self.state is not LockState.RELEASED
                else "already released"
            )
            raise self._lost_error(f"Lock is no longer held: {reason}")

    def owned(self) -> bool:
        """Ask Redis whether the lock still carries this object's token, without renewing it.

        One read, no TTL change. Finding it gone or taken marks a held lock LOST (as a renewal
        would). False without asking when this object has not acquired the lock, has released
        it, or is a forked child's copy. A lock can still be owned on the server after its
        local deadline passed (``held`` is False): act on ``held`` / :meth:`ensure_held`, which
        stay on the safe side of clock drift.
        """
        if self._foreign() or self.state not in (
            LockState.HELD,
            LockState.SUSPECT,
            LockState.LOST,
        ):
            return False
        try:
            stored = self._client().hget(self.key, "token")
        except REDIS_ERRORS as exc:
            raise self._unavailable(exc, "check the lock") from exc
        if isinstance(stored, bytes):
            stored = stored.decode()
        if stored == self.token:
            return True
        self._declare_lost((Outcome.GONE if stored is None else Outcome.OTHER_OWNER).reason)
        return False

    # -- loss (the renewal thread decides when; the lock changes its own state) ------------
    def _declare_lost(self, reason: str) -> None:
        """Found lost by the owner's own call: stop renewing, mark LOST and announce (once)."""
        renewer().remove(self)
        if self.mark_lost(reason):
            self.announce_lost(reason)

    def announce_lost(self, reason: str) -> None:
        """Tell everyone this holding was lost (after :meth:`mark_lost`): metric, warning,
        ``lock_lost`` signal, ``on_lost``. A receiver's or callback's exception is logged,
        never raised: the renewal thread calls this and must keep renewing other locks."""
        metrics.count("lost", self.family, self.job_func)
        log_lock(logging.WARNING, "lost", self, f"lock lost: {reason}", reason=reason)
        try:
            lock_lost.send(sender=Lock, lock=self, reason=reason)
        except Exception:  # noqa: BLE001 - a receiver's bug must not stop other renewals
            logger.exception("lock_lost receiver failed for %s", self.key)
        if self.on_lost is not None:
            try:
                self.on_lost(self, reason)
            except Exception:  # noqa: BLE001 - same: logged, never fatal to the thread
                logger.exception("on_lost callback failed for %s", self.key)

    def renewal_failed(self, exc: BaseException) -> None:
        """A renewal could not be confirmed (it is retried soon): HELD -> SUSPECT, logged once
        with the cause."""
        if self.mark_suspect():
            cause = f"{type(exc).__name__}: {exc}"
            log_lock(
                logging.WARNING,
                "renew_failed",
                self,
                f"renewal failed ({cause}); retrying until {self.remaining():.2f}s before expiry",
                reason=cause,
            )

    # -- Redis ---------------------------------------------------------------------------
    def _client(self) -> Any:
        return client(self.alias)

    def _unavailable(self, exc: BaseException, action: str) -> LockBackendUnavailable:
        return unavailable(exc, action, resource=self.resource, key=self.key, owner=self.owner)

    def _index_entry(self) -> list[index.Entry]:
        return [(self.resource, self.owner, self.ttl)]

    def acquire(self, wait: float | None = None) -> bool:
        """Take the lock; if it is busy, wait in line for up to ``wait`` seconds.

        ``wait`` defaults to this lock's wait (0: one try, one round trip; ``math.inf``: until
        it gets it, interruptible). Waiters are served in arrival order and handed the lock by
        the release (see :mod:`.waiting`); while some wait, a free lock is theirs and a
        newcomer is refused. Returns False if it was still busy (or reserved for earlier
        waiters) after ``wait`` seconds.

        Raises :class:`LockBackendUnavailable` if Redis cannot be asked, or answered only after
        the lock's validity had run out (then the lock is given back at once),
        :class:`LockError` if this object already holds the lock. A failed call can simply be
        repeated: the same object keeps its token (and its place in line) until it acquires.
        """
        if self.state in (LockState.HELD, LockState.SUSPECT) and not self._foreign():
            raise LockError(
                "This Lock object already holds the lock",
                resource=self.resource,
                key=self.key,
                owner=self.owner,
            )
        what = f"lock({self.resource!r}):"
        wait = self.wait if wait is None else _check_wait(what, wait)
        if self.state is not LockState.UNLOCKED:
            # A fresh token per acquisition: a late renew of the previous holding can never
            # extend this one (nor can a forked child's acquire find its parent's lock).
            self.token = secrets.token_hex(16)
        self.job_id, self.job_func, details = holder_details()
        args = [self.token, self.ttl_ms, FENCE_COUNTER_TTL_MS, *details]
        found = self._client()
        prefix = self.keys.prefix
        started = time.monotonic()
        try:
            if wait > 0:
                turn = waiting.wait_in_line(
                    found,
                    self.alias,
                    self.keys,
                    self.owner,
                    args,
                    started + wait,
                    confirm=not self.heartbeat,
                )
                if turn.reply > 0:
                    send(found, index.add_calls(prefix, self._index_entry()))
            else:
                calls = [(ACQUIRE, waiting.lock_keys(self.keys), args)]
                calls += index.add_calls(prefix, self._index_entry())
                try:
                    reply, *_ = send(found, calls)
                except RedisConnectionError:
                    # Lost mid-call (its reply, maybe): safe to send again, the script finds
                    # its own token and answers with the same fence.
                    reply, *_ = send(found, calls)
                if isinstance(reply, Exception):
                    raise reply
                if reply <= 0:  # take the speculative index entry back (contended path only)
                    found.execute_command(*index.remove_call(prefix, self.resource, self.owner))
                turn = waiting.Turn(int(reply), started, None, "")
        except REDIS_ERRORS as exc:
            metrics.count("acquire_attempts", self.family, self.job_func)
            metrics.count("acquire_errors", self.family, self.job_func)
            raise self._unavailable(exc, "acquire the lock") from exc
        if turn.reply > 0:
            now = time.monotonic()
            valid_for = self.ttl if turn.valid_for is None else turn.valid_for
            if now - turn.sent >= valid_for - drift(valid_for):
                raise self._too_late(found, now - turn.sent)
            acks = conf.get().REPLICA_ACKS
            if acks:
                self._await_replicas(found, acks)
            self._next_ticket = turn.next_ticket
            waited = now - started if wait > 0 else 0.0  # one try waits for nothing
            metrics.record_acquire(self.family, self.job_func, waited, acquired=True)
            self._on_acquired(turn.reply, turn.sent, waited=waited, valid_for=turn.valid_for)
            return True
        waited = time.monotonic() - started
        metrics.record_acquire(self.family, self.job_func, waited, acquired=False)
        lock_contended.send(sender=Lock, lock=self, waited=waited)
        log_lock(
            logging.INFO,
            "contended",
            self,
            "lock busy",
            reason=f"held, pttl={busy_pttl_ms(turn.reply)}ms",
        )
        return False

    def _await_replicas(self, found: Any, acks: int) -> None:
        """Return once ``acks`` replicas have the new lock (``REPLICA_ACKS``); otherwise give
        it back and raise :class:`LockBackendUnavailable`: a lock only the primary knows is
        one a failover would forget.

        One round trip: a RENEW (a write of this connection, after the acquire or the
        hand-over in the replication stream: ``WAIT`` counts this connection's writes) then
        ``WAIT acks timeout``.
        """
        timeout = conf.get().REPLICA_ACK_TIMEOUT
        if is_cluster(found):
            raise JoblockConfigError(
                "JOBLOCK['REPLICA_ACKS'] cannot be used with a Redis Cluster client "
                "(system check django_joblock.E008)"
            )
        try:
            renewed, acked = send(
                found,
                [
                    (RENEW, [self.key], [self.token, self.ttl_ms]),
                    ["WAIT", acks, max(1, int(timeout * 1000))],
                ],
            )
            for reply in (renewed, acked):
                if isinstance(reply, Exception):
                    raise reply
        except REDIS_ERRORS as exc:
            acked, error = 0, f"{type(exc).__name__}: {exc}"
        else:
            error = "" if renewed == Outcome.OK else "lost before it was replicated"
            acked = int(acked) if not error else -1
        if acked >= acks:
            return
        raise self._given_back(
            found,
            f"the lock reached {max(acked, 0)} of the {acks} replicas JOBLOCK['REPLICA_ACKS'] "
            f"asks for within {timeout:g}s ({error or 'WAIT timed out'}); not acquired",
        )

    def _too_late(self, found: Any, took: float) -> LockBackendUnavailable:
        """The error for an acquire whose reply came after the lock's validity ran out. The
        lock is ours on the server for at most the drift margin longer: give it back now."""
        return self._given_back(
            found,
            f"Redis answered the acquire after {took:.3f}s, when the lock's validity "
            f"(ttl {self.ttl:g}s minus the drift margin) had already run out; not acquired",
        )

    def _given_back(self, found: Any, message: str) -> LockBackendUnavailable:
        """An acquire that got the lock but cannot use it: counted as an acquire error, the
        lock given back (best effort: else it expires on its own), and the error to raise."""
        metrics.count("acquire_attempts", self.family, self.job_func)
        metrics.count("acquire_errors", self.family, self.job_func)
        unindex = index.remove_call(self.keys.prefix, self.resource, self.owner)
        try:
            waiting.release(found, self.keys, self.token, "", [unindex])
        except REDIS_ERRORS:
            pass  # it expires on its own
        return LockBackendUnavailable(
            message, resource=self.resource, key=self.key, owner=self.owner
        )

    def _on_acquired(
        self, fence: int, sent: float, *, waited: float, valid_for: float | None
    ) -> None:
        self._begin(fence, sent, valid_for=valid_for)
        renewer().add(self, renew_within=math.inf if valid_for is None else valid_for / 3)
        lock_acquired.send(sender=Lock, lock=self, waited=waited)
        log_lock(logging.DEBUG, "acquired", self, "lock acquired")

    def renew(self) -> bool:
        """Renew now (replacing the TTL). False, and the lock marked lost, if no longer ours.

        Also False, without asking Redis and without marking it lost, once ``max_hold`` has
        passed (the lock then runs out, as with the heartbeat), when the lock is not held, and
        in a forked child.
        """
        if self.state not in (LockState.HELD, LockState.SUSPECT) or self._foreign():
            return False
        sent = time.monotonic()
        if sent >= self.hold_until:
            return False
        try:
            code = Outcome(RENEW(self._client(), [self.key], [self.token, self.ttl_ms]))
        except REDIS_ERRORS as exc:
            raise self._unavailable(exc, "renew the lock") from exc
        if code is Outcome.OK:
            self.confirm_renewed(sent)
            log_lock(logging.DEBUG, "renewed", self, "lock renewed")
            return True
        self._declare_lost(code.reason)
        return False

    def release(self) -> bool:
        """Release if still ours (compare-and-delete). False if it had expired or changed owner.

        A lock found lost here is marked LOST first (signal, log, metric, ``on_lost``), and
        ``lost`` / ``lost_reason`` keep saying so after the release. Raises
        :class:`LockBackendUnavailable` if Redis cannot be asked; the lock then expires after
        its TTL. In a forked child: False, and Redis is not touched (the lock is the parent's).
        """
        if self._foreign() or self.state not in (
            LockState.HELD,
            LockState.SUSPECT,
            LockState.LOST,
        ):
            return False
        renewer().remove(self)
        sent = time.monotonic()
        if sent >= self.valid_until and self.mark_lost("validity deadline passed"):
            self.announce_lost("validity deadline passed")
        held_for = sent - (self.acquired_at or sent)
        metrics.observe("hold_seconds", self.family, self.job_func, held_for)
        also: list[Any] = [index.remove_call(self.keys.prefix, self.resource, self.owner)]
        # Metrics ride along: inside a job always (a work horse may exit right after),
        # elsewhere once a flush is due.
        pending = metrics.take_for_flush(force=bool(self.job_id))
        if pending:
            also.append(metrics.flush_call(pending))
        try:
            code, _ = waiting.release(
                self._client(), self.keys, self.token, self._next_ticket, also
            )
        except REDIS_ERRORS as exc:
            self.mark_released()
            if pending:
                metrics.restore(pending)
            raise self._unavailable(exc, "release the lock") from exc
        released = code is Outcome.OK
        if not released and self.mark_lost(code.reason):
            self.announce_lost(code.reason)
        self.mark_released()
        lock_released.send(sender=Lock, lock=self, released=released, held_for=held_for)
        log_lock(
            logging.DEBUG if released else logging.WARNING,
            "released",
            self,
            "lock released" if released else "lock was no longer ours at release",
            reason=code.reason if not released else "ok",
        )
        return released

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> Lock:
        if not self.acquire():
            raise LockNotAcquired(
                f"Lock busy after waiting {self.wait:g}s",
                resource=self.resource,
                key=self.key,
                owner=None,
            )
        self._context_token = _current.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token, self._context_token = self._context_token, None
        try:
            if token is not None:
                _leave(self, token)
        finally:
            self._exit(exc)

    def _exit(self, exc: BaseException | None) -> None:
        """Release on leaving the ``with`` block; raise :class:`LockLost` if it had been lost."""
        if self._foreign():
            return  # a forked child leaving its copy of the block: the lock is the parent's
        released_in_block = self.state is LockState.RELEASED
        try:
            self.release()
        except LockBackendUnavailable:
            if exc is None:
                raise
            # Do not hide the body's own exception; the lock expires after its TTL.
            logger.warning(
                "Could not release %s after an error in the block", self.key, exc_info=True
            )
            return
        if exc is None and not released_in_block and self.lost_reason:
            raise self._lost_error(
                f"Lock was lost before the end of the with block: {self.lost_reason}"
            )


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
    using: str | None = None,
) -> Lock:
    """A :class:`Lock` on ``resource`` (same keywords): ``with lock("order:1") as held: ...``.

    Entering raises :class:`LockNotAcquired` if the lock stayed busy for ``wait`` seconds.
    """
    return Lock(
        resource,
        ttl=ttl,
        wait=wait,
        heartbeat=heartbeat,
        max_hold=max_hold,
        on_lost=on_lost,
        using=using,
    )


def current_lock() -> Lock | None:
    """The lock entered by the code (or RQ job) running in this thread/context, if any."""
    return _current.get()


def set_current_lock(held: Lock | None) -> contextvars.Token[Lock | None]:
    """Make ``held`` the :func:`current_lock` (used by the RQ wrapper); undo with the token."""
    return _current.set(held)


def reset_current_lock(token: contextvars.Token[Lock | None]) -> None:
    """Undo :func:`set_current_lock`."""
    _current.reset(token)


def _leave(held: Lock, token: contextvars.Token[Lock | None]) -> None:
    """Undo ``__enter__``'s :func:`current_lock` change, in whatever context the block is left.

    ``ContextVar.reset`` refuses a token made in another context (a lock's ``__enter__`` and
    ``__exit__`` run by two ``sync_to_async`` calls, each in a copy of the caller's context);
    then the previous value is restored here instead, and nothing is raised.
    """
    try:
        _current.reset(token)
    except ValueError:
        if _current.get() is held:
            previous = token.old_value
            _current.set(None if previous is contextvars.Token.MISSING else previous)
