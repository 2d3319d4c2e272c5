"""Interrupt the running job when its lock is lost (``JOBLOCK["ON_LOCK_LOST"] = "abort"``).

Loss is noticed by the renewal thread, but the job runs in the main thread of the work horse,
possibly blocked in a socket read or ``time.sleep``. A real signal (``SIGUSR2``, which RQ does
not use) sent to the main thread with ``pthread_kill`` interrupts such a call; its handler
raises :class:`LockLost` there, so the job's own ``transaction.atomic()`` rolls back and the job
fails visibly instead of finishing its work without the lock.

The handler is installed once per process and only raises while a job is armed, so a late
signal after the job ended is harmless (never the default action, which would kill the
process). Outside the main thread (e.g. an inline call from a web request thread) signals
cannot be used: the lock is then only flagged lost, and fenced writes still refuse stale data.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

from .exceptions import LockLost
from .locks import Lock

ABORT_SIGNAL = signal.SIGUSR2

_armed: Abort | None = None
_installed = False


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
        self.active = threading.current_thread() is threading.main_thread()
        self._main_ident = threading.main_thread().ident

    def __enter__(self) -> Abort:
        global _armed, _installed
        if self.active:
            if not _installed:
                signal.signal(ABORT_SIGNAL, _handler)
                _installed = True
            _armed = self
        return self

    def lost(self, lock: Lock, reason: str) -> None:
        """``on_lost`` hook (renewal thread): interrupt the main thread if still armed."""
        self.lock = lock
        self.reason = reason or "lost"
        if (
            self.active
            and _armed is self
            and self._main_ident is not None
            # Noticed by the job's own thread (ensure_held): it raises LockLost itself; a
            # signal to ourselves could land in the middle of the rollback that follows.
            and threading.get_ident() != self._main_ident
        ):
            signal.pthread_kill(self._main_ident, ABORT_SIGNAL)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _armed
        if _armed is self:
            _armed = None


def _reset_after_fork() -> None:
    # A forked child inherits the handler but not the parent's armed job.
    global _armed
    _armed = None


os.register_at_fork(after_in_child=_reset_after_fork)
