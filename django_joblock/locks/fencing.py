"""Fenced writes: the database rejects a write from a holder whose lock has been superseded.

A lock alone cannot stop a paused holder (GC pause, SIGSTOP, a slow network) from writing after
its lock expired and a new holder took over. Each acquisition carries a fence that is strictly
greater than every earlier one for the resource; the row remembers the highest fence that wrote
it, and a write with a lower fence is refused by the ``UPDATE ... WHERE`` itself, so there is no
read-then-write window. A holder may write the same rows again under its own fence (fences are
never reused: an equal fence is the same holding).

"Itself" means on the very row being written, whatever the queryset filters on. A plain
``queryset.filter(fence).update()`` does not do that for a queryset that joins (Django writes
``WHERE id IN (SELECT ... lock_fence <= %s)``, and PostgreSQL re-checks only the updated row's
own conditions once a newer holder's transaction commits, not the subquery's) nor with
multi-table inheritance (Django selects the ids first, then updates by id alone): those are
updated by primary key, with the fence condition on the row of the table that holds it.
"""

from __future__ import annotations

from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.core.exceptions import FieldDoesNotExist, FieldError
from django.db import NotSupportedError, connections, models
from django.db.models import Max, Q

from .. import metrics
from ..exceptions import StaleFence
from .info import job_context
from .lock import current_lock

_M = TypeVar("_M", bound=models.Model)


def fenced_update(queryset: models.QuerySet[_M], fence: int, **values: Any) -> int:
    """``UPDATE`` the rows of ``queryset`` whose ``lock_fence`` is NULL or at most ``fence``.

    Sets ``lock_fence = fence`` with ``values`` in one statement; returns the rows updated. The
    fence is compared on each row as that statement writes it (after waiting for the row lock of
    a concurrent writer: on the row that writer committed), whatever ``queryset`` filters on.
    A queryset of one table is updated as ``update()`` updates it, all its conditions on the
    row; one that joins, or whose model inherits ``lock_fence`` from a parent table, by primary
    key (see :func:`_update_by_key`).

    Raises :class:`StaleFence` (carrying the highest fence found) when no row qualified: a newer
    holder wrote them, or the queryset matched nothing; ``ValueError`` for a fence that is not
    a positive int (``None`` from a lock never acquired), for the fence of the lock held here
    when it has several holders (``limit`` > 1: see :func:`_refuse_shared_fence`), and for
    ``values`` that, with multi-table inheritance, are columns of another table than
    ``lock_fence`` (see :func:`_fence_table`); what ``QuerySet.update()`` refuses
    (a sliced queryset...) the same way it does."""
    if isinstance(fence, bool) or not isinstance(fence, int) or fence <= 0:
        raise ValueError(f"fenced_update: fence must be a positive int, got {fence!r}.")
    if "lock_fence" in values:
        raise ValueError(
            "fenced_update: lock_fence is set from the fence argument; do not pass it in values."
        )
    _refuse_shared_fence(fence)
    _refuse_what_update_refuses(queryset)
    table = _fence_table(queryset, values)
    fenced = queryset.filter(_not_newer_than(fence))
    if table is queryset.model._meta.concrete_model and fenced.query.count_active_tables() == 1:
        # One table, no join: Django writes every condition of the queryset, the fence
        # included, in the UPDATE's own WHERE, where PostgreSQL re-checks them all on the row a
        # concurrent writer committed (a compare-and-set such as filter(status="new") holds).
        updated = fenced.update(lock_fence=fence, **values)
    else:
        updated = _update_by_key(queryset, table, fence, values)
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


def _update_by_key(
    queryset: models.QuerySet[Any], table: type[models.Model], fence: int, values: dict[str, Any]
) -> int:
    """The fenced ``UPDATE`` of ``table`` (which holds ``lock_fence``) for a queryset that joins
    or inherits ``lock_fence`` from a parent table: on those, ``queryset.update()`` would put
    the fence inside a subquery or in an earlier ``SELECT``, not on the row it writes.

    Only the rows' primary keys come from ``queryset``; the ``UPDATE`` itself has no join and
    compares the fence on each row it writes. The queryset's other conditions are evaluated
    when the statement starts (as ``update()`` does for a queryset that joins): they are not
    re-checked on a row a concurrent writer changed meanwhile, the fence is."""
    # The database queryset.update() would write to: its using(), else the router's write
    # database. select_for_update() marks a copy for writing as update() does; it is never run.
    database = queryset.select_for_update().db
    keys: Any = queryset.values("pk")
    if not connections[database].features.update_can_self_select:
        # MySQL refuses a subquery on a table the UPDATE writes: read the keys first (the UPDATE
        # below still compares the fence on each row it writes).
        keys = list(queryset.using(database).values_list("pk", flat=True))
    return (
        table._meta.base_manager.using(database)
        .filter(pk__in=keys)
        .filter(_not_newer_than(fence))
        .update(lock_fence=fence, **values)
    )


def _not_newer_than(fence: int) -> Q:
    """The rows ``fence`` may write: never written under a fence, or under one not above it."""
    return Q(lock_fence__isnull=True) | Q(lock_fence__lte=fence)


def _refuse_what_update_refuses(queryset: models.QuerySet[Any]) -> None:
    """Raise what ``queryset.update()`` raises for a queryset it cannot update (a slice,
    ``distinct(*fields)``, ``union()``...): :func:`fenced_update` only takes the queryset's
    primary keys, which such a queryset would still give."""
    query = queryset.query
    if query.is_sliced:
        raise TypeError("Cannot update a query once a slice has been taken.")
    if query.distinct_fields:
        raise TypeError("Cannot call update() after .distinct(*fields).")
    if query.combinator:
        raise NotSupportedError(
            f"Calling QuerySet.update() after {query.combinator}() is not supported."
        )


def _fence_table(queryset: models.QuerySet[Any], values: dict[str, Any]) -> type[models.Model]:
    """The model whose table holds ``lock_fence``: the queryset's, or with multi-table
    inheritance the ancestor that inherits :class:`~django_joblock.fenced.FencedModel`.

    One ``UPDATE`` writes one table and compares the fence on that table's row, so ``values``
    for another table's columns cannot be fenced; they are refused (``ValueError``) rather than
    written unguarded. ``FieldError`` when the model has no ``lock_fence`` at all."""
    meta = queryset.model._meta
    try:
        table: type[models.Model] = meta.get_field("lock_fence").model
    except FieldDoesNotExist:
        raise FieldError(
            f"fenced_update: {meta.label} has no lock_fence field (inherit FencedModel)."
        ) from None
    elsewhere = []
    for name in values:
        try:
            field = meta.get_field(name)
        except FieldDoesNotExist:
            continue  # update() reports it below, as it always has
        if field.model is not table:
            elsewhere.append(name)
    if elsewhere:
        raise ValueError(
            f"fenced_update: the lock_fence of {meta.label} is in the table of "
            f"{table._meta.label} (multi-table inheritance), but {', '.join(sorted(elsewhere))} "
            f"{'is a column' if len(elsewhere) == 1 else 'are columns'} of another table: one "
            "UPDATE cannot compare the fence and write them, so nothing was written. Inside "
            f"transaction.atomic(), call fenced_update() with {table._meta.label}'s fields only "
            "(or none): it locks the row and checks the fence; then update the other fields "
            "with QuerySet.update() in the same transaction (docs/locks.md, 'Fencing')."
        )
    return table


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
