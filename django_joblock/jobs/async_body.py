"""The body of an ``async def`` ``@locked_job``, run inside the job's sync flow.

RQ awaits a coroutine only after the job function returned, which would be after the lock's
release and the commit. So the flow (lock, heartbeat, claim, transaction, record, release)
stays in the job's thread, and the body is awaited there through asgiref's ``async_to_sync``:
its event loop runs in another thread while the job's thread serves the body's
``sync_to_async`` calls, Django's async ORM included. Those run in the job's thread, on its
database connection: inside the job's transaction, committed once with the record.

A lost lock (``ON_LOCK_LOST = "abort"``) cancels the body's task (a signal to the job's thread
would leave the body running); the ``CancelledError`` leaves the body as :class:`LockLost`, so
the transaction rolls back and the job fails, as a sync body's does.

The body never runs on after its job: when the job's thread is interrupted while it waits for
the body (RQ's ``job_timeout``, a signal), the body's task is cancelled and the thread waits
for it to end (up to :data:`STOP_WAIT` s) before the interruption goes on to the flow, which
rolls back and releases the lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from asgiref.sync import async_to_sync

from ..logs import logger
from . import abort

# How long (s) an interrupted job's thread waits for its cancelled body to end. A body whose
# cancellation does not end it in time (it blocks its loop, or catches ``CancelledError``) is
# left to run, with a warning: the thread cannot be kept waiting for a body that may never end.
STOP_WAIT = 5.0


class _Body:
    """The running body of one call: its loop and task once started, whether it ended, and
    whether it was stopped (a body stopped before it started never starts)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None
        self.ended = threading.Event()
        self.stopped = False

    def stop(self) -> None:
        """Cancel the body if it is still running, and wait up to :data:`STOP_WAIT` s for it
        to end (called from the job's thread)."""
        self.stopped = True  # set before reading task: _watched sets task before reading this
        if self.loop is None or self.task is None or self.ended.is_set():
            return
        task = self.task
        try:
            self.loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # its loop closed meanwhile: the body has ended
            return
        if not self.ended.wait(STOP_WAIT):
            logger.warning(
                "the async body of an interrupted job did not end within %gs of its "
                "cancellation; it runs on without the job's lock",
                STOP_WAIT,
            )


def call(
    func: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Await ``func(*args, **kwargs)`` to its end from the job's thread; its result, or what
    it raised (:class:`LockLost` when the job's abort cancelled it). Interrupted meanwhile
    (RQ's job timeout), the body is cancelled and waited for before the interruption is
    raised again."""
    body = _Body()
    try:
        return async_to_sync(_watched)(func, args, kwargs, body)
    except asyncio.CancelledError:
        error = abort.loss_error()
        if error is None:
            raise
        raise error from None
    except BaseException:
        body.stop()  # the body's own error: it has ended, and this does nothing
        raise


async def _watched(
    func: Callable[..., Coroutine[Any, Any, Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    body: _Body,
) -> Any:
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    body.loop = loop
    body.task = task
    if task is not None:
        abort.cancel_on_loss(loop, task)
    try:
        if body.stopped:  # the job's thread was interrupted before the body started
            raise asyncio.CancelledError
        return await func(*args, **kwargs)
    finally:
        abort.stop_cancelling()  # before asgiref closes the loop
        body.ended.set()
