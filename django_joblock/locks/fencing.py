"""Fenced writes: the database rejects a write from a holder whose lock has been superseded.

A lock alone cannot stop a paused holder (GC pause, SIGSTOP, a slow network) from writing after
its lock expired and a new holder took over. Each acquisition carries a fence that is strictly
greater than every earlier one for the resource; the row remembers the highest fence that wrote
it, and a write with a lower fence is refused by the ``UPDATE ... WHERE`` itself, so there is no
read-then-write window. A holder may write the same rows again under its own fence (fences are
never reused: an equal fence is the same holding).
"""

from __future__ import annotations

from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import models
from django.db.models import Max, Q

from .. import metrics
from ..exceptions import StaleFence
from .info import job_context
from .lock import current_lock

_M = TypeVar("_M", bound=models.Model)


def fenced_update(queryset: models.QuerySet[_M], fence: int, **values: Any) -> int:
    """``UPDATE`` the rows of ``queryset`` whose ``lock_fence`` is NULL or at most ``fence``.

    Sets ``lock_fence = fence`` with ``values`` in one statement; returns the rows updated.
    Raises :class:`StaleFence` (carrying the highest fence found) when no row qualified: a newer
    holder wrote them, or the queryset matched nothing; ``ValueError`` for a fence that is not
    a positive int (``None`` from a lock never acquired), and for the fence of the lock held
    here when it has several holders (``limit`` > 1: see :func:`_refuse_shared_fence`)."""
    if isinstance(fence, bool) or not isinstance(fence, int) or fence <= 0:
        raise ValueError(f"fenced_update: fence must be a positive int, got {fence!r}.")
    if "lock_fence" in values:
        raise ValueError(
            "fenced_update: lock_fence is set from the fence argument; do not pass it in values."
        )
    _refuse_shared_fence(fence)
    updated = queryset.filter(Q(lock_fence__isnull=True) | Q(lock_fence__lte=fence)).update(
        lock_fence=fence, **values
    )
    if updated == 0:
        held = current_lock()
        family = held.family if held is not None else ""
        metrics.count("stale_fence_rejections", family, job_context()[1])
        # Only on the rejection path: one more query so the error says what won.
        current = queryset.aggregate(current=Max("lock_fence"))["current"]
        if current is None and not queryset.exists():
            detail = "no row matched the queryset"
        else:
            detail = f"rows already carry fence {current}"
        raise StaleFence(
            f"Stale fence {fence} rejected for {queryset.model._meta.label}: {detail}",
            fence=fence,
            current=current,
        )
    return updated


def _refuse_shared_fence(fence: int) -> None:
    """``ValueError`` when ``fence`` is that of the lock held here and the lock has several
    holders at once (``lock(limit=N)``, ``@locked_job(concurrency=N)``).

    Their fences increase with each acquire, but a row several legitimate holders write cannot
    be guarded by them: a holder that wrote with a larger fence would make the others' valid
    writes look stale, and a stale holder could still write after a valid one with a smaller
    fence. Guarding would be pretending; the write is refused instead."""
    held = current_lock()
    if held is not None and held.limit > 1 and held.fence == fence:
        raise ValueError(
            f"fenced_update: the fence {fence} is of lock({held.resource!r}, "
            f"limit={held.limit}), which several holders hold at once: a fence cannot order "
            "their writes to shared rows (docs/locks.md, 'Several holders')"
        )


async def afenced_update(queryset: models.QuerySet[_M], fence: int, **values: Any) -> int:
    """:func:`fenced_update` from async code, as Django's ``QuerySet.aupdate()`` runs
    ``update()`` (``sync_to_async``, thread-sensitive: inside the transaction the caller opened
    the same way). Same statement, result and errors."""
    return await sync_to_async(fenced_update)(queryset, fence, **values)
