"""The resource's transaction guard (PostgreSQL; docs/jobs.md): a lock holder does not read the
resource's rows while its previous holder, which lost the lock before its commit, is still in its
transaction (reads do not wait for row locks: a write computed from them would be a lost update).

Under a held lock, ``@locked_job``'s transaction on the records' database first takes an advisory
lock named after the lock's Redis key: in the claim statement (:mod:`.store`) or before a lock-only
job's first query (:func:`before_first_query`). A run that finds it taken waits for it (a worker's
run up to the lock's TTL, an inline one ``ACQUIRE_WAIT``), then has run nothing
(:class:`ResourceInTransaction`, ``on_conflict`` applies).

**A previous holder's transaction never outlives its lock by long.** The run holds the lock, so the
guard's holder lost it (or, inline in a request's transaction, released it before its commit).
One that sits idle in its transaction for more than half the lock's TTL (a process stopped or
paused: a pause of a whole worker lasts at least the TTL minus one heartbeat interval by the time
the next holder has the lock) has its transaction ended with ``pg_terminate_backend``: it rolls
back, which is what its lost lock asks of it anyway. Needs the right to signal that backend (the
same database role, as for workers of one project); without it the run waits, then requeues.

Assumes READ COMMITTED; not on SQLite (its write lock serialises), other databases,
``atomic=False`` jobs or ``lock()`` blocks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import DatabaseError, connections, transaction

from ..exceptions import ResourceInTransaction
from ..locks.lock import Lock
from ..logs import logger

# A 64-bit advisory lock per name and transaction (a hash collision only makes an unrelated
# name look busy); the idempotency key's guard (.store) uses it too, with other names.
GUARD_SQL = "pg_try_advisory_xact_lock(hashtextextended(%s, 0))"
_RETRY_EVERY = 0.05  # seconds before the second try of a run that waits (doubling to 0.5 s)
# The backend holding a guard, when it has sat idle in its transaction for more than %s seconds.
_IDLE_HOLDER_SQL = """
WITH guard AS (SELECT hashtextextended(%s, 0) AS k)
SELECT a.pid, EXTRACT(EPOCH FROM clock_timestamp() - a.state_change)
FROM guard, pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = ((guard.k >> 32) & 4294967295)::oid AND l.objid = (guard.k & 4294967295)::oid
  AND a.pid <> pg_backend_pid() AND a.state LIKE 'idle in transaction%%'
  AND a.state_change < clock_timestamp() - make_interval(secs => %s)
"""


def name_for(lock_key: str) -> str:
    """The guard's name for the lock whose Redis key is ``lock_key``."""
    return f"django_joblock.lock\x1f{lock_key}"


def guarded(using: str) -> bool:
    """True when transactions on database ``using`` take the guard (PostgreSQL)."""
    return bool(connections[using].vendor == "postgresql")


def refused(held: Lock) -> ResourceInTransaction:
    """The error of a run that found ``held``'s guard taken."""
    message = (
        "The resource's previous holder is still inside its database transaction (it "
        "lost its lock, or ran inline in a transaction not ended yet); this run ran nothing"
    )
    return ResourceInTransaction(message, resource=held.resource, key=held.key, owner=held.owner)


def try_name(using: str, name: str) -> bool:
    """Try the guard called ``name`` once in the current transaction on ``using``, never
    waiting: True when this transaction has it (again, or off PostgreSQL)."""
    if not guarded(using):
        return True
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT {GUARD_SQL}", [name])
        return bool(cursor.fetchone()[0])


def take(using: str, held: Lock, *, wait: float = 0.0) -> None:
    """Take ``held``'s guard in the current transaction on ``using``, trying for up to ``wait``
    seconds and ending a stale holder's transaction (:func:`end_idle_holder`);
    :class:`ResourceInTransaction` when it stays taken. Off PostgreSQL, nothing."""
    deadline = time.monotonic() + wait
    pause = _RETRY_EVERY
    may_end = True
    while not try_name(using, name_for(held.key)):
        if may_end:
            try:
                if end_idle_holder(using, held):
                    pause = _RETRY_EVERY  # its advisory locks go when its backend has exited
            except DatabaseError as exc:
                may_end = False  # said once; the run waits for that transaction instead
                message = "%s: the transaction of its previous holder cannot be ended: %s"
                logger.warning(
                    message, held.resource, exc, extra=_fields(held, "stale_transaction_kept")
                )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise refused(held)
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, 0.5)


def end_idle_holder(using: str, held: Lock) -> bool:
    """End the transaction of the backend holding ``held``'s guard if it has been idle in it for
    more than half the lock's TTL (see the module docs); True when one was ended. Without the
    right to signal that backend, the ``DatabaseError`` propagates; the caller's transaction can
    go on (the attempt ran in a savepoint)."""
    with connections[using].cursor() as cursor:
        cursor.execute(_IDLE_HOLDER_SQL, [name_for(held.key), held.ttl / 2])
        found = cursor.fetchone()
    if found is None:
        return False
    pid = int(found[0])
    idle = float(found[1])
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        ended = bool(cursor.fetchone()[0])
    if ended:
        message = (
            "%s: ended the transaction of its previous holder (backend %s), idle in it for %.1fs "
            "after losing the lock: it rolls back"
        )
        logger.warning(
            message, held.resource, pid, idle, extra=_fields(held, "stale_transaction_ended")
        )
    return ended


def _fields(held: Lock, outcome: str) -> dict[str, str]:
    return {"resource": held.resource, "lock_key": held.key, "outcome": outcome}


@contextlib.contextmanager
def before_first_query(using: str, held: Lock | None, *, wait: float = 0.0) -> Iterator[None]:
    """Take ``held``'s guard (:func:`take`) right before the block's first query on ``using``
    (PostgreSQL, with a lock). A refusal raises :class:`ResourceInTransaction` from that query,
    every later one and the block's end: a body that swallows it still cannot read or commit."""
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
