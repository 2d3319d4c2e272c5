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

import functools
import inspect
import os
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from django.utils.asyncio import async_unsafe

from ..backend import REDIS_ERRORS, Call, cache_argument, client, text
from ..exceptions import LockBackendUnavailable, LockLost, LockNotAcquired
from ..logs import logger
from ..redis_steps import drive
from . import current, index, waiting
from .base import BaseLock
from .current import reset_current_lock, set_current_lock
from .renewal import renewer
from .scripts import Outcome
from .state import HOLDING, LockState, OnLost

__all__ = ["Lock", "LockState", "current_lock", "lock", "reset_current_lock", "set_current_lock"]

# Django's SynchronousOnlyOperation, for a sync call that would block a running event loop.
_IN_LOOP = (
    "A Lock's sync acquire, release, renew and owned block the running event loop: in async "
    "code use alock() (async with alock(...), await held.aacquire() / arelease() / arenew())"
)

P = ParamSpec("P")
R = TypeVar("R")


class Lock(BaseLock):
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
        if self._foreign() or self.state not in (*HOLDING, LockState.LOST):
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

    @async_unsafe(_IN_LOOP)
    def release(self) -> bool:
        """Release if still ours (compare-and-delete). False if it had expired or changed owner.

        A lock found lost here is marked LOST first (signal, log, metric, ``on_lost``), and
        ``lost`` / ``lost_reason`` keep saying so. Raises :class:`LockBackendUnavailable` if
        Redis cannot be asked (the lock then expires after its TTL), :class:`LockError` while
        another thread is in this object's acquire or release. Failed or interrupted (a signal
        handler's ``KeyboardInterrupt``), the lock is no longer held by this object either way
        (it may have been released, even handed over). In a forked child: False, without
        touching Redis (the lock is the parent's).
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
