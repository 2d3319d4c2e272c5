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
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from asgiref.sync import async_to_sync

from . import abort


def call(
    func: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Await ``func(*args, **kwargs)`` to its end from the job's thread; its result, or what
    it raised (:class:`LockLost` when the job's abort cancelled it)."""
    try:
        return async_to_sync(_watched)(func, args, kwargs)
    except asyncio.CancelledError:
        error = abort.loss_error()
        if error is None:
            raise
        raise error from None


async def _watched(
    func: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    task = asyncio.current_task()
    if task is not None:
        abort.cancel_on_loss(asyncio.get_running_loop(), task)
    try:
        return await func(*args, **kwargs)
    finally:
        abort.stop_cancelling()  # before asgiref closes the loop
