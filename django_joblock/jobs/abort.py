"""Interrupt the running job when its lock is lost (``JOBLOCK["ON_LOCK_LOST"] = "abort"``).

Loss is noticed by the renewal thread, but the job runs in the main thread of the work horse,
possibly blocked in a socket read or ``time.sleep``. A real signal (``SIGUSR2``, which RQ does
not use) sent to the main thread with ``pthread_kill`` interrupts such a call; its handler
raises :class:`LockLost` there, so the job's own ``transaction.atomic()`` rolls back and the job
fails visibly instead of finishing its work without the lock.

The handler is installed when a job is armed and the previous one put back when it ends (an
inline ``@locked_job`` call in a process that uses ``SIGUSR2`` itself leaves it as it was). It
only raises while a job is armed. Disarming and the signal's sending are serialised, and a
signal sent to a job that ended meanwhile is taken off the pending set before the previous
handler returns, so it can never reach the default action (which would kill the process).
Outside the main thread (e.g. an inline call from a web request thread) signals cannot be used:
the lock is then only flagged lost, and fenced writes still refuse stale data.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from ..exceptions import LockLost
from ..locks.lock import Lock

ABORT_SIGNAL = signal.SIGUSR2

_armed: Abort | None = None
# Serialises "is this job still armed? then signal it" (renewal thread) with disarming (main
# thread), so no signal is sent once a job has been disarmed.
_guard = threading.Lock()


def _handler(signum: int, frame: FrameType | None) -> None:
    armed = _armed
    held = armed.lock if armed is not None else None
    if armed is not None and held is not None and armed.reason:
        armed.fired = True
        raise LockLost(
            f"Job aborted: its lock was lost ({armed.reason})",
            resource=held.resource,
            key=held.key,
            owner=held.owner,
        )


class Abort:
    """Context manager arming the abort around the job body; :meth:`lost` is its trigger."""

    def __init__(self) -> None:
        self.lock: Lock | None = None
        self.reason = ""
        self.fired = False
        self.sent = False
        self.active = threading.current_thread() is threading.main_thread()
        self._main_ident = threading.main_thread().ident
        self._outer: Abort | None = None
        self._previous: signal.Handlers | Callable[[int, FrameType | None], Any] | int | None = None

    def __enter__(self) -> Abort:
        global _armed
        if self.active:
            self._previous = signal.signal(ABORT_SIGNAL, _handler)
            with _guard:
                self._outer, _armed = _armed, self
        return self

    def lost(self, lock: Lock, reason: str) -> None:
        """``on_lost`` hook (renewal thread): interrupt the main thread if still armed."""
        self.lock = lock
        self.reason = reason or "lost"
        if (
            not self.active
            or self._main_ident is None
            # Noticed by the job's own thread (ensure_held): it raises LockLost itself; a
            # signal to ourselves could land in the middle of the rollback that follows.
            or threading.get_ident() == self._main_ident
        ):
            return
        with _guard:
            if _armed is self:
                self.sent = True
                signal.pthread_kill(self._main_ident, ABORT_SIGNAL)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _armed
        if not self.active:
            return
        with _guard:
            if _armed is self:
                _armed = self._outer
        # From here no signal is sent for this job; one sent before may still be pending.
        self._restore()

    def _restore(self) -> None:
        """Put the previous ``SIGUSR2`` handler back (main thread, job disarmed)."""
        previous = signal.SIG_DFL if self._previous is None else self._previous
        if not self.sent:
            signal.signal(ABORT_SIGNAL, previous)  # no signal of ours can be in flight
            return
        if not hasattr(signal, "sigtimedwait"):
            return  # a late signal cannot be drained here (macOS): keep ours, it is harmless
        # The signal we sent may not have been delivered yet: block it, take it off the
        # pending set, then restore the handler, so it can never meet SIG_DFL (process exit).
        signal.pthread_sigmask(signal.SIG_BLOCK, {ABORT_SIGNAL})
        try:
            signal.sigtimedwait({ABORT_SIGNAL}, 0)
            signal.signal(ABORT_SIGNAL, previous)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {ABORT_SIGNAL})


def _reset_after_fork() -> None:
    # A forked child inherits the handler but not the parent's armed job (nor its guard,
    # which the parent's renewal thread may have held at the moment of the fork).
    global _armed, _guard
    _armed = None
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
