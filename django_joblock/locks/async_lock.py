"""``AsyncLock`` and ``alock()``: the :class:`~.lock.Lock` for asyncio code.

The same lock, on ``redis.asyncio``: one holder per resource, TTL, owner token, fence, FIFO
waiting with hand-over, heartbeat and loss detection, with the same Redis structures and
scripts as the sync :class:`~.lock.Lock` (its flows, :mod:`django_joblock.redis_steps`), so
a sync and an async holder of one resource exclude each other.

- **The loop never blocks.** Each Redis call is awaited; a waiting acquire awaits its
  ``BLPOP`` on a connection of its own. The heartbeat is the renewal thread every lock has:
  it renews async holders too, off the loop.
- **Cancellation is clean.** A task cancelled while waiting in line leaves the line at once
  (giving back a lock handed over meanwhile); cancelled in its one-try acquire, it gives
  back the lock the acquire may have got; a lock got is given back too when the task is
  cancelled before ``aacquire`` returned it. Either way the ``CancelledError`` propagates.
- **A lost lock is noticed** as for sync holders (``held``, :meth:`~.lock.Lock.ensure_held`,
  ``on_lost``, which the renewal thread calls: to cancel the body, have it call
  ``loop.call_soon_threadsafe(task.cancel)``), and leaving ``async with`` raises
  :class:`~django_joblock.exceptions.LockLost` as leaving ``with`` does.

One Redis server only (not Sentinel or Cluster): see :mod:`django_joblock.async_backend`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, ParamSpec

from .. import async_backend
from ..backend import REDIS_ERRORS
from ..exceptions import LockBackendUnavailable, LockNotAcquired
from . import index, waiting
from .current import set_current_lock
from .lock import Lock
from .state import OnLost

__all__ = ["AsyncLock", "alock"]

P = ParamSpec("P")


class AsyncLock(Lock):
    """A :class:`~.lock.Lock` used from asyncio code: ``async with alock("order:1") as held:``,
    ``@alock("report")`` on an ``async def``, or ``await held.aacquire()`` /
    ``await held.arelease()``. Arguments and guarantees are :class:`~.lock.Lock`'s; so are the
    sync methods, for use outside a running event loop."""

    async def aacquire(self, wait: float | None = None) -> bool:
        """:meth:`~.lock.Lock.acquire`, awaited: waiting in line awaits, never blocking the
        loop. Cancelled, it leaves the line (or gives back a lock it may have got) and
        re-raises ``CancelledError``. Raises as ``acquire`` does."""
        self._start_call()
        # The turn taken, once known: a lock got is given back unless this returns it held.
        turn: waiting.Turn | None = None
        try:
            wait, args = self._prepare_acquire(wait)
            entry = self.index_entry()
            started = time.monotonic()
            try:
                found = async_backend.client(self.cache)
                if wait > 0 or self.limit > 1:  # with a limit, a one-try is a wait's last call
                    async with async_backend.blocking_client(self.cache) as blocking:
                        turn = await self._await_in_line(found, blocking, args, started + wait)
                    if turn.reply > 0:
                        self._take_slot(turn.slot)
                        if not turn.indexed:  # handed over
                            await async_backend.drive(self._add_to_index(self.index_entry()), found)
                else:
                    turn = await self._try_once_cancellable(found, args, entry, started)
            except REDIS_ERRORS as exc:
                raise self._failed_attempt(exc) from exc
            return await async_backend.drive(self._taken(found, turn, started, wait), found)
        except LockBackendUnavailable:
            raise  # a failed attempt (kept for a repeat), or a lock _taken gave back itself
        except BaseException:
            # Got, but this does not return it held (cancelled, or a lock_acquired receiver
            # raised): nobody else would give it back.
            if turn is not None and turn.reply > 0:
                await self._give_back_got(found, turn)
            raise
        finally:
            self._calls.release()

    async def _give_back_got(self, found: Any, turn: waiting.Turn) -> None:
        """Give back the lock of ``turn``, got by an acquire that ends raising, shielded from a
        second cancellation. Best effort: a Redis error is ignored (the lock then expires
        after its TTL)."""
        self._forget_got(turn)
        await asyncio.shield(async_backend.drive(self._give_back(), found))

    async def _try_once_cancellable(
        self, found: Any, args: list[Any], entry: index.Entry, started: float
    ) -> waiting.Turn:
        """One ACQUIRE; cancelled meanwhile, the lock it may have got is given back first."""
        try:
            return await async_backend.drive(self._try_once(found, args, entry, started), found)
        except asyncio.CancelledError:
            await asyncio.shield(async_backend.drive(self._give_back(), found))
            raise

    async def _await_in_line(
        self, found: Any, blocking: Any, args: list[Any], deadline: float
    ) -> waiting.Turn:
        """:meth:`~.lock.Lock._wait_in_line`, awaited (``BLPOP`` on ``blocking``), up to the
        turn taken: the caller indexes a lock handed over. Redis errors are raised (the ticket
        expires on its own, and a repeat keeps the place); anything else (a cancellation)
        leaves the line first, shielded from a second cancellation."""
        waiter = waiting.Waiter(
            self.keys,
            self.owner,
            args,
            confirm=not self.heartbeat,
            limit=self.limit,
            index_call=index.in_wait_script(found, self.keys.prefix, self.index_entry()),
        )
        try:
            return await async_backend.drive(waiter.take_turn(deadline), found, blocking)
        except REDIS_ERRORS:
            raise
        except BaseException:
            with contextlib.suppress(*REDIS_ERRORS):
                await asyncio.shield(async_backend.drive(waiter.leave(), found))
            raise

    async def arelease(self) -> bool:
        """:meth:`~.lock.Lock.release`, awaited."""
        self._start_call()
        try:
            if not self._releasable():
                return False
            found = async_backend.client(self.cache)
            released, _ = await async_backend.drive(self._release_steps(found, []), found)
            return released
        finally:
            self._calls.release()

    async def arenew(self) -> bool:
        """:meth:`~.lock.Lock.renew`, awaited."""
        sent = self._renewal_start()
        if sent is None:
            return False
        return await async_backend.drive(self._renewing(sent), async_backend.client(self.cache))

    async def __aenter__(self) -> AsyncLock:
        if not await self.aacquire():
            raise LockNotAcquired(
                f"Lock busy after waiting {self.wait:g}s", resource=self.resource, key=self.key
            )
        self._context_token = set_current_lock(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        released_in_block = self._leave_context()
        try:
            await self.arelease()
        except LockBackendUnavailable as error:
            self._release_failed_on_leaving(exc, error)
            return
        self._check_kept(exc, released_in_block)

    def __call__(self, func: Callable[P, Any]) -> Callable[P, Any]:
        """Use the lock as a decorator of an ``async def``: each call runs inside ``async with``
        a new :class:`AsyncLock` made with this one's arguments. ``TypeError`` for a plain
        function (decorate it with :func:`~.lock.lock`)."""
        if not inspect.iscoroutinefunction(func):
            raise TypeError(
                f"alock({self.resource!r}) decorates async def functions; "
                f"{func.__qualname__} is not one: use lock({self.resource!r})"
            )

        @functools.wraps(func)
        async def locked(*args: P.args, **kwargs: P.kwargs) -> Any:
            async with AsyncLock(self.resource, **self._arguments):
                return await func(*args, **kwargs)

        return locked


def alock(
    resource: str,
    *,
    ttl: float | None = None,
    wait: float | None = None,
    heartbeat: bool = True,
    max_hold: float | None = None,
    on_lost: OnLost | None = None,
    cache: str | None = None,
    limit: int = 1,
) -> AsyncLock:
    """An :class:`AsyncLock` on ``resource``: ``async with alock("order:1") as held:``, or as a
    decorator of an ``async def`` (``@alock("report")``). The arguments are :func:`~.lock.lock`'s.
    Nothing is sent to Redis until it is acquired. Raises ``ValueError`` for a bad resource or
    number, :class:`~django_joblock.exceptions.JoblockConfigError` at the first acquire when
    the cache is a Redis Cluster or Sentinel connection."""
    return AsyncLock(
        resource,
        ttl=ttl,
        wait=wait,
        heartbeat=heartbeat,
        max_hold=max_hold,
        on_lost=on_lost,
        cache=cache,
        limit=limit,
    )
