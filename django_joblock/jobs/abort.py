"""Interrupt the running job when its lock is lost (``ON_LOCK_LOST = "abort"``; docs/jobs.md): the
renewal thread sends ``SIGUSR2`` (unused by RQ) to the main thread, whose handler raises
:class:`LockLost` even in a blocking call, so the transaction rolls back and the job fails. The
previous handler is restored after each job, a late signal drained first (never the default action:
exit). An ``async def`` job's body, awaited in another thread (:mod:`.async_body`), has its task
cancelled instead. Outside the main thread the lock is only flagged; fences still refuse
writes.

Once the job's transaction passed its last ``ensure_held()`` and commits (:func:`commit_begins`),
a loss no longer interrupts it: raised inside ``COMMIT``, :class:`LockLost` would abandon a
commit the database completes (psycopg gives up waiting for it) or come right after it (SQLite),
and the job would be reported failed, and retried, with its effect kept. The loss is still
noticed and reported as any loss is; the run's outcome is its commit's."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from ..exceptions import LockLost
from ..locks.lock import Lock

ABORT_SIGNAL = signal.SIGUSR2

_armed: Abort | None = None
# Serialises "is this job still armed? then signal it" (renewal thread) with disarming.
_guard = threading.Lock()


def _handler(signum: int, frame: FrameType | None) -> None:
    error = loss_error()
    if error is not None:
        raise error


def loss_error() -> LockLost | None:
    """The :class:`LockLost` that aborts the armed job, once its lock was lost and unless its
    commit has begun; else None."""
    armed = _armed
    if armed is None or armed.lock is None or not armed.reason or armed.committing:
        return None
    held = armed.lock
    message = f"Job aborted: its lock was lost ({armed.reason})"
    return LockLost(message, resource=held.resource, key=held.key, owner=held.owner)


def cancel_on_loss(loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any]) -> None:
    """Have the armed job's abort cancel ``task`` (an ``async def`` job's body, running on
    ``loop`` in another thread) instead of interrupting the main thread, which waits for it."""
    with _guard:
        if _armed is not None:
            _armed.task = (loop, task)


def stop_cancelling() -> None:
    """The async body ended: a loss from here on interrupts the main thread again."""
    with _guard:
        if _armed is not None:
            _armed.task = None


def commit_begins() -> None:
    """The armed job's transaction passed its last ``ensure_held()`` and commits now: from here
    on a loss of its lock does not interrupt the job (see the module docs). Call it as the last
    statement inside the transaction's block; without an armed job (none is armed outside the
    main thread) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return  # the armed job, if any, is the main thread's, not this thread's
    with _guard:
        if _armed is not None:
            _armed.committing = True


class Abort:
    """Arms the abort around the job body; :meth:`lost` is the lock's ``on_lost`` hook."""

    def __init__(self, then: Callable[[Lock, str], Any] | None = None) -> None:
        self.then = then
        self.lock: Lock | None = None
        self.reason = ""
        self.sent = False
        self.committing = False  # the job's commit has begun: no interrupt (commit_begins)
        self.active = threading.current_thread() is threading.main_thread()
        self._main_ident = threading.main_thread().ident
        self._outer: Abort | None = None
        self.task: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None
        self._previous: signal.Handlers | Callable[[int, FrameType | None], Any] | int | None = None

    def __enter__(self) -> Abort:
        global _armed
        if self.active:
            self._previous = signal.signal(ABORT_SIGNAL, _handler)
            with _guard:
                self._outer = _armed
                _armed = self
        return self

    def lost(self, lock: Lock, reason: str) -> None:
        """Interrupt the main thread if still armed, then call ``then`` (the job's ``on_lost``)."""
        self.lock = lock
        self.reason = reason or "lost"
        # Noticed by the job's own thread (ensure_held), it raises LockLost: no signal mid-rollback.
        ident = self._main_ident
        with _guard:
            if _armed is not self or self.committing:
                pass  # disarmed, or committing: the loss is reported, the run not interrupted
            elif self.task is not None:  # an async body: cancel its task
                loop, task = self.task
                loop.call_soon_threadsafe(task.cancel)
            elif self.active and ident not in (None, threading.get_ident()):
                self.sent = True
                signal.pthread_kill(ident, ABORT_SIGNAL)
        if self.then is not None:
            self.then(lock, reason)

    def __exit__(self, *exc: object) -> None:
        global _armed
        if not self.active:
            return
        with _guard:
            if _armed is self:
                _armed = self._outer
        # No signal is sent for this job from here on; one sent before may still be pending.
        previous = signal.SIG_DFL if self._previous is None else self._previous
        if not self.sent:
            signal.signal(ABORT_SIGNAL, previous)
            return
        if not hasattr(signal, "sigtimedwait"):
            return  # a late signal cannot be drained here (macOS): keep ours, it is harmless
        # Block it, take it off the pending set, then restore, so it never meets SIG_DFL.
        signal.pthread_sigmask(signal.SIG_BLOCK, {ABORT_SIGNAL})
        try:
            signal.sigtimedwait({ABORT_SIGNAL}, 0)
            signal.signal(ABORT_SIGNAL, previous)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {ABORT_SIGNAL})


def _reset_after_fork() -> None:
    # A forked child has neither the parent's armed job nor its guard (maybe held at the fork).
    global _armed, _guard
    _armed = None
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
