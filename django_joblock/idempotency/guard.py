"""The resource's transaction guard (PostgreSQL): a run that holds a lock does not read the
resource's rows while the resource's previous holder is still inside its transaction.

Why. A lock can be lost after its holder's last :meth:`~django_joblock.Lock.ensure_held`
and before its commit (a pause, an expiry during a slow commit, a failover that forgot the
lock). That holder's transaction then commits later, and the next holder, which took the lock
meanwhile, may have *read* the rows before that commit: PostgreSQL's reads do not wait for row
locks. The fence orders *writes*: the next holder's write is newer, so it is accepted, and,
computed from what it read, it overwrites the committed one. A lost update, with no stale write
ever refused.

So under a held lock, ``@locked_job``'s transaction (on the database of the idempotency records)
first takes a transaction-scoped advisory lock on the lock's Redis key, never waiting
(``pg_try_advisory_xact_lock`` of a 64-bit hash). The commit or rollback frees it, and the
runner releases the Redis lock only after that, so a next holder finds it free unless the
lock was lost under a transaction still open. It is taken before the job reads anything: in
the claim statement of a job with an idempotency key (no extra round trip, :mod:`.store`),
and right before the first query of a lock-only job's body (:func:`before_first_query`), so a
lock-only job that never queries sends no statement at all. Such a body should keep effects
outside the database after its first query, or send them with ``send_after_commit``: a
refusal at its first query rolls back and requeues the run.

A run that finds it taken has run nothing: it raises :class:`ResourceInTransaction` (a
``LockNotAcquired``) and its ``on_conflict`` applies: ``"requeue"`` runs it again with backoff,
after the old transaction has ended. A run without a worker (an inline call, a synchronous
queue) first waits for it up to ``ACQUIRE_WAIT``, as it does for the lock. A hash collision can
only make an unrelated resource look busy (a requeue; 1 in 2**64).

The guard assumes PostgreSQL's default isolation, READ COMMITTED, where each statement reads
what was committed before it. Under REPEATABLE READ or SERIALIZABLE the transaction's snapshot
is taken by its first statement, the guard's own, so an old holder that commits just before
the guard is granted stays invisible to the whole transaction (its writes to the same rows
then fail with a serialization error instead of being lost).

An inline call inside an enclosing transaction (``ATOMIC_REQUESTS``, a caller's ``atomic()``)
runs in a savepoint: its effects, and the guard, stay with the enclosing transaction until
that ends, while the Redis lock is released when the call returns. A worker that takes the
lock meanwhile is refused until that commit, which is right (the effects are not committed
yet), and says so.

Not guarded: SQLite (one writer at a time: with ``transaction_mode="IMMEDIATE"`` the next
holder's transaction waits for the old one to end), other databases, writes on another
database than the records', jobs with ``atomic=False`` and ``lock()`` blocks. There, read the
rows you will write with ``select_for_update()`` inside the transaction, or write ``F()``
expressions (docs/locks.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from django.db import connections

from ..exceptions import ResourceInTransaction


class Held(Protocol):
    """What the guard needs of a held lock (:class:`~django_joblock.Lock`)."""

    @property
    def resource(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def owner(self) -> str: ...


# One 64-bit advisory lock per name, scoped to the transaction; shared with the idempotency
# key's guard (idempotency_store), whose names start differently.
GUARD_SQL = "pg_try_advisory_xact_lock(hashtextextended(%s, 0))"
# How often a run without a worker asks again while it waits (seconds).
_RETRY_EVERY = 0.05


def name_for(lock_key: str) -> str:
    """The guard's name for the lock whose Redis key is ``lock_key``."""
    return f"django_joblock.lock\x1f{lock_key}"


def guarded(using: str) -> bool:
    """True when transactions on database ``using`` take the guard (PostgreSQL)."""
    return bool(connections[using].vendor == "postgresql")


def refused(held: Held) -> ResourceInTransaction:
    """The error of a run that found ``held``'s guard taken."""
    return ResourceInTransaction(
        "The resource's previous holder is still inside its database transaction (its lock "
        "was lost, or it ran inline inside an enclosing transaction that has not ended); this "
        "run ran nothing",
        resource=held.resource,
        key=held.key,
        owner=held.owner,
    )


def try_name(using: str, name: str) -> bool:
    """Try the guard called ``name`` once in the current transaction on ``using``, never
    waiting: True when this transaction has it now (always True off PostgreSQL). Taking it
    again in the same transaction succeeds at once."""
    if not guarded(using):
        return True
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {GUARD_SQL}", [name])
        return bool(cursor.fetchone()[0])


def take(using: str, held: Held, *, wait: float = 0.0) -> None:
    """Take ``held``'s guard in the current transaction on ``using`` (PostgreSQL; elsewhere
    nothing), trying for up to ``wait`` seconds; raises :class:`ResourceInTransaction` when
    it stays taken. Taking it again in the same transaction succeeds at once."""
    deadline = time.monotonic() + wait
    while not try_name(using, name_for(held.key)):
        if time.monotonic() >= deadline:
            raise refused(held)
        time.sleep(min(_RETRY_EVERY, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def before_first_query(using: str, held: Held | None, *, wait: float = 0.0) -> Iterator[None]:
    """Take ``held``'s guard (see :func:`take`) right before the first query sent on
    database ``using`` inside the block (PostgreSQL; elsewhere, or without a lock, nothing).

    A refusal raises :class:`ResourceInTransaction` from that query, and from every later
    one, and again when the block ends: a body that swallows it still cannot read or commit.
    """
    if held is None or not guarded(using):
        yield
        return
    state: dict[str, Any] = {"taken": False, "refused": None}

    def first(execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if state["refused"] is not None:
            raise state["refused"]
        if not state["taken"]:
            state["taken"] = True  # before the guard's own query, which comes through here
            try:
                take(using, held, wait=wait)
            except ResourceInTransaction as exc:
                state["refused"] = exc
                raise
        return execute(sql, *args)

    with connections[using].execute_wrapper(first):
        yield
    if state["refused"] is not None:
        raise state["refused"]
