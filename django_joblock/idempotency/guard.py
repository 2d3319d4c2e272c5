"""The resource's transaction guard (PostgreSQL): a run that holds a lock does not read the
resource's rows while the resource's previous holder is still inside its transaction.

Why: a holder that lost its lock before its commit commits late, and PostgreSQL's reads do not
wait for row locks, so the next holder could compute a write from rows read before that commit;
its newer fence is accepted, and the update is lost. So under a held lock ``@locked_job``'s
transaction (on the records' database) first takes a transaction-scoped advisory lock named
after the lock's Redis key, never waiting (``pg_try_advisory_xact_lock`` of a 64-bit hash; a
collision only makes an unrelated resource look busy). The commit or rollback frees it, and
the Redis lock is released only after that. It is taken in the claim statement of a job with
an idempotency key (:mod:`.store`, no extra round trip), or right before a lock-only job's
first query (:func:`before_first_query`).

A run that finds it taken has run nothing: :class:`ResourceInTransaction` (a
``LockNotAcquired``), and its ``on_conflict`` applies. Assumes READ COMMITTED. Not guarded:
SQLite (its write lock serialises the transactions), other databases, other databases than the
records', ``atomic=False`` jobs and ``lock()`` blocks. The whole story, inline calls inside an
enclosing transaction included: docs/jobs.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections

from ..exceptions import ResourceInTransaction
from ..locks.lock import Lock

# One 64-bit advisory lock per name, scoped to the transaction; shared with the idempotency
# key's guard (.store), whose names start differently.
GUARD_SQL = "pg_try_advisory_xact_lock(hashtextextended(%s, 0))"
_RETRY_EVERY = 0.05  # seconds between two tries of a run that waits


def name_for(lock_key: str) -> str:
    """The guard's name for the lock whose Redis key is ``lock_key``."""
    return f"django_joblock.lock\x1f{lock_key}"


def guarded(using: str) -> bool:
    """True when transactions on database ``using`` take the guard (PostgreSQL)."""
    return bool(connections[using].vendor == "postgresql")


def refused(held: Lock) -> ResourceInTransaction:
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
    waiting: True when this transaction has it (again, or off PostgreSQL)."""
    if not guarded(using):
        return True
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {GUARD_SQL}", [name])
        return bool(cursor.fetchone()[0])


def take(using: str, held: Lock, *, wait: float = 0.0) -> None:
    """Take ``held``'s guard in the current transaction on ``using``, trying for up to
    ``wait`` seconds; :class:`ResourceInTransaction` when it stays taken. Off PostgreSQL,
    nothing."""
    deadline = time.monotonic() + wait
    while not try_name(using, name_for(held.key)):
        if time.monotonic() >= deadline:
            raise refused(held)
        time.sleep(min(_RETRY_EVERY, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def before_first_query(using: str, held: Lock | None, *, wait: float = 0.0) -> Iterator[None]:
    """Take ``held``'s guard (:func:`take`) right before the first query sent on ``using``
    inside the block (PostgreSQL, with a lock). A refusal raises :class:`ResourceInTransaction`
    from that query, every later one, and the block's end: a body that swallows it still cannot
    read or commit."""
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
