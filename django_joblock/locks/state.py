"""A lock's local view of one holding: its state and deadlines, by the local monotonic clock.

:class:`~django_joblock.Lock` extends this with the Redis operations; it alone changes its
state (the renewal thread decides *when*). The view is conservative: validity counts from the
*send* time of the last confirmed acquire or renew, minus a clock-drift margin, so the holder
believes the lock gone before the server lets anyone else in. In a forked child the parent's
lock is neither held nor lost."""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from .. import metrics
from ..exceptions import LockError
from ..logs import log_lock, logger
from ..signals import lock_lost
from .keys import owner_hash

OnLost = Callable[[Any, str], Any]  # on_lost(lock, reason)
_E = TypeVar("_E", bound=LockError)


class LockState(enum.Enum):
    """Life cycle: UNLOCKED -> HELD <-> SUSPECT -> LOST, and HELD/SUSPECT/LOST -> RELEASED."""

    UNLOCKED = "unlocked"
    HELD = "held"
    SUSPECT = "suspect"  # renewals are failing; still valid until the local deadline
    LOST = "lost"
    RELEASED = "released"


# The states in which this process holds the lock: valid, or valid while renewals fail.
HOLDING = (LockState.HELD, LockState.SUSPECT)


def drift(ttl: float) -> float:
    """Safety margin (s) for clock drift between us and Redis: 1 % of the TTL + 2 ms."""
    return ttl * 0.01 + 0.002


class Holding:
    """State, deadlines and owner of one lock, as its holder sees them (no I/O here)."""

    resource: str
    key: str
    slot: int
    cache: str
    family: str
    job_id: str
    job_func: str
    heartbeat: bool
    heartbeat_interval: float
    on_lost: OnLost | None
    ttl: float
    max_hold: float | None
    token: str
    # The sender of the lock signals (signals.py: ``sender=Lock``, for an AsyncLock's too); set
    # by lock.py, which this module cannot import.
    signal_sender: ClassVar[type]

    def _start_call(self) -> None:
        """Begin an acquire or release (the caller ends it with ``self._calls.release()`` in a
        ``finally``). Refuses a second thread's while one runs: two acquires of one object
        would both send its token, and both be told they hold the lock."""
        if not self._calls.acquire(blocking=False):
            raise self._error(
                LockError,
                "Another thread is acquiring or releasing this Lock object: a Lock is one "
                "holding, give each thread a Lock of its own",
            )

    def _reset_view(self) -> None:
        # The owner's thread and the renewal thread can both find the lock lost at once: each
        # check-and-set runs under this guard, so a loss is marked (and announced) once.
        self._transition = threading.Lock()
        self._calls = threading.Lock()  # one acquire() or release() at a time (_start_call)
        self.fence: int | None = None
        self.state = LockState.UNLOCKED
        self.lost_reason = ""
        self.acquired_at: float | None = None  # monotonic send time of the acquire
        self.pid = 0  # the process that acquired the lock (0: never); another is a forked copy
        # Local validity deadline (monotonic): send time of the last confirmed acquire/renew +
        # ttl - drift. Written by the renewal thread, read by the owner (float stores are atomic).
        self.valid_until = 0.0
        self.hold_until = math.inf  # max_hold as a monotonic deadline: no renewal after it
        self._owner = ("", "")

    def _begin(self, fence: int, sent: float, valid_for: float) -> None:
        """Record an acquisition confirmed by Redis, sent at monotonic ``sent``, valid for
        ``valid_for`` s (less than the TTL for a handed-over lock, until its first renewal)."""
        if self.pid != os.getpid():
            # First holding in this process: a forked child may have copied the guard while
            # the parent's renewal thread held it.
            self._transition = threading.Lock()
        self.fence = fence
        self.acquired_at = sent
        self.pid = os.getpid()
        self.valid_until = sent + valid_for - drift(valid_for)
        self.hold_until = math.inf if self.max_hold is None else sent + self.max_hold
        self.lost_reason = ""
        self.state = LockState.HELD

    def confirm_renewed(self, sent: float) -> None:
        """Record a renewal confirmed by Redis, sent at monotonic ``sent`` (SUSPECT -> HELD)."""
        with self._transition:
            self.valid_until = max(self.valid_until, sent + self.ttl - drift(self.ttl))
            if self.state is LockState.SUSPECT:
                self.state = LockState.HELD

    def mark_lost(self, reason: str) -> bool:
        """HELD / SUSPECT -> LOST with ``reason``. True if the state changed (once per
        holding); the caller then announces it (:meth:`Lock.announce_lost`)."""
        with self._transition:
            if self.state not in (LockState.HELD, LockState.SUSPECT):
                return False
            # Counted with the change: a thread that finds the lock LOST (a job's own, about
            # to flush its metrics and exit) finds the loss counted (CI: the count came after).
            metrics.count("lost", self.family, self.job_func)
            self.state = LockState.LOST
            self.lost_reason = reason
            return True

    def announce_lost(self, reason: str) -> None:
        """Tell everyone this holding was lost (after :meth:`mark_lost`, which counted it):
        warning, ``lock_lost`` signal, ``on_lost``. A receiver's or callback's exception is
        logged, never raised: the renewal thread calls this and must keep renewing other locks."""
        log_lock(logging.WARNING, "lost", self, f"lock lost: {reason}", reason=reason)
        try:
            lock_lost.send(sender=self.signal_sender, lock=self, reason=reason)
        except Exception:  # noqa: BLE001 - a receiver's bug must not stop other renewals
            logger.exception("lock_lost receiver failed for %s", self.key)
        if self.on_lost is not None:
            try:
                self.on_lost(self, reason)
            except Exception:  # noqa: BLE001 - same: logged, never fatal to the thread
                logger.exception("on_lost callback failed for %s", self.key)

    def renewal_failed(self, exc: BaseException) -> None:
        """A renewal failed (retried soon): HELD -> SUSPECT, logged once with the cause."""
        with self._transition:
            suspect = self.state is LockState.HELD
            if suspect:
                self.state = LockState.SUSPECT
        if suspect:
            cause = f"{type(exc).__name__}: {exc}"
            message = f"renewal failed ({cause}); retrying for {self.remaining():.2f}s"
            log_lock(logging.WARNING, "renew_failed", self, message, reason=cause)

    def mark_released(self) -> None:
        """Any state -> RELEASED (``lost_reason`` is kept: ``lost`` still says so)."""
        with self._transition:
            self.state = LockState.RELEASED

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    def _foreign(self) -> bool:
        """True in another process than the one that acquired the lock (a forked child)."""
        return self.pid != 0 and self.pid != os.getpid()

    def remaining(self) -> float:
        """Seconds of validity left by the local monotonic clock (0 when not held here)."""
        if self.state not in (LockState.HELD, LockState.SUSPECT) or self._foreign():
            return 0.0
        return max(0.0, self.valid_until - time.monotonic())

    @property
    def held(self) -> bool:
        """True while acquired by this process, neither released nor lost, before its deadline."""
        return self.remaining() > 0.0

    @property
    def lost(self) -> bool:
        """True once the lock is known lost, or its local validity deadline has passed; stays
        True after :meth:`release` (``lost_reason`` says why). False in a forked child."""
        if self._foreign() or self.state is LockState.UNLOCKED:
            return False
        if self.state is LockState.RELEASED:
            return bool(self.lost_reason)
        return self.state is LockState.LOST or self.remaining() <= 0.0

    def _error(self, kind: type[_E], message: str) -> _E:
        """A ``kind`` error naming this lock's resource, key and owner (never its token)."""
        return kind(message, resource=self.resource, key=self.key, owner=self.owner)

    @property
    def owner(self) -> str:
        """Short hash of the current token: safe to log and show (the token is not)."""
        if self._owner[0] != self.token:
            self._owner = (self.token, owner_hash(self.token))
        return self._owner[1]

    def index_entry(self) -> tuple[str, str, float, str, int]:
        """This holding's active-lock index entry: resource, owner, TTL (s), RQ job id, slot."""
        return (self.resource, self.owner, self.ttl, self.job_id, self.slot)

    def __repr__(self) -> str:
        return (
            f"<Lock resource={self.resource!r} state={self.state.value} owner={self.owner} "
            f"fence={self.fence}>"
        )
