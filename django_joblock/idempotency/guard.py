"""The resource's transaction guard (PostgreSQL; docs/jobs.md): a lock holder does not read the
resource's rows while its previous holder, which lost the lock before its commit, is still in its
transaction (reads do not wait for row locks: a write computed from them would be a lost update).

Under a held lock, ``@locked_job``'s transaction on the records' database first takes an advisory
lock named after the lock's Redis key, never waiting: in the claim statement (:mod:`.store`) or
before a lock-only job's first query (:func:`before_first_query`). A run that finds it taken ran
nothing (:class:`ResourceInTransaction`, ``on_conflict`` applies). Assumes READ COMMITTED; not on
SQLite (its write lock serialises), other databases, ``atomic=False`` jobs or ``lock()`` blocks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections

from ..exceptions import ResourceInTransaction
from ..locks.lock import Lock

# A 64-bit advisory lock per name and transaction (a hash collision only makes an unrelated
# name look busy); the idempotency key's guard (.store) uses it too, with other names.
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
    message = "The resource's previous holder is still inside its database transaction (it "
    message += "lost its lock, or ran inline in a transaction not ended yet); this run ran nothing"
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
    seconds; :class:`ResourceInTransaction` when it stays taken. Off PostgreSQL, nothing."""
    deadline = time.monotonic() + wait
    while not try_name(using, name_for(held.key)):
        if time.monotonic() >= deadline:
            raise refused(held)
        time.sleep(min(_RETRY_EVERY, max(0.0, deadline - time.monotonic())))


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
