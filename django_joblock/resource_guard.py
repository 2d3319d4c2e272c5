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
lock was lost under a transaction still open. It is taken

- in the claim statement of a job with an idempotency key (no extra round trip,
  :mod:`django_joblock.idempotency_store`);
- just before the first query of a lock-only job's transaction (:func:`before_first_query`;
  a job that never touches the database pays nothing).

A run that finds it taken has read nothing: it raises :class:`ResourceInTransaction` (a
``LockNotAcquired``) and its ``on_conflict`` applies: ``"requeue"`` runs it again with backoff,
after the old transaction has ended. A hash collision can only make an unrelated resource look
busy (a requeue; 1 in 2**64).

Not guarded: SQLite (one writer at a time: with ``transaction_mode="IMMEDIATE"`` the next
holder's transaction waits for the old one to end), other databases, writes on another
database than the records', jobs with ``atomic=False`` and ``lock()`` blocks. There, read the
rows you will write with ``select_for_update()`` inside the transaction, or write ``F()``
expressions (docs/locks.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from django.db import connections

from .exceptions import ResourceInTransaction


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


def name_for(lock_key: str) -> str:
    """The guard's name for the lock whose Redis key is ``lock_key``."""
    return f"django_joblock.lock\x1f{lock_key}"


def guarded(using: str) -> bool:
    """True when transactions on database ``using`` take the guard (PostgreSQL)."""
    return bool(connections[using].vendor == "postgresql")


def refused(held: Held) -> ResourceInTransaction:
    """The error of a run that found ``held``'s guard taken."""
    return ResourceInTransaction(
        "The resource's previous holder, whose lock was lost, is still inside its database "
        "transaction; this run read nothing and waits for it to end",
        resource=held.resource,
        key=held.key,
        owner=held.owner,
    )


class _FirstQuery:
    """``execute_wrapper`` taking the guard before the transaction's first query."""

    def __init__(self, held: Held) -> None:
        self.held = held
        self.state: bool | None = None  # None: not asked yet; then the guard's answer
        self.asking = False

    def __call__(
        self,
        execute: Callable[..., Any],
        sql: str,
        params: Any,
        many: bool,
        context: dict[str, Any],
    ) -> Any:
        if self.state is None and not self.asking:
            self.asking = True  # the guard's own query comes through here too
            try:
                with context["connection"].cursor() as cursor:
                    cursor.execute(f"SELECT {GUARD_SQL}", [name_for(self.held.key)])
                    self.state = bool(cursor.fetchone()[0])
            finally:
                self.asking = False
        if self.state is False:
            raise refused(self.held)
        return execute(sql, params, many, context)


@contextlib.contextmanager
def before_first_query(using: str, held: Held) -> Iterator[None]:
    """Inside a transaction on ``using``: take ``held``'s guard before the block's first query
    there (PostgreSQL; elsewhere nothing). Every query of a refused run raises
    :class:`ResourceInTransaction`, and so does the block's end when the block swallowed that
    error, so a refused run can never commit."""
    if not guarded(using):
        yield
        return
    guard = _FirstQuery(held)
    with connections[using].execute_wrapper(guard):
        yield
    if guard.state is False:
        raise refused(held)
