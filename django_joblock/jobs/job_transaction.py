"""The transaction a lock-only ``@locked_job`` body runs in (``atomic=True``, no idempotency key;
docs/jobs.md, "The job's transaction").

The body's queries on the records' database run in one transaction, committed after the body
returned and only while the lock is still held (``ensure_held()``; a lost lock rolls it back),
with the resource's guard taken before its first query (:mod:`..idempotency.resource_guard`).

**A body that never queries opens no connection.** When the database connection is not open yet
(a forking worker's horse: the worker closes connections before each fork), the transaction
begins at the body's first query, not before the body: a job that only uses Redis or an HTTP
API costs no database session. When the connection is open (a ``SimpleWorker``, an inline
call), the transaction begins before the body, as ``transaction.atomic()`` does.

A body whose first database use is its own ``transaction.atomic()`` block, before any query,
in a horse: that block is the outermost one and commits itself (the guard is taken in it, so
its reads still wait for a previous holder's transaction); the job's end checks the lock only
for a transaction the job began."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from django.db import connections, transaction

from ..idempotency import resource_guard
from ..locks.lock import Lock


@contextlib.contextmanager
def job_transaction(using: str, held: Lock | None, *, wait: float) -> Iterator[None]:
    """Run the block in the job's transaction on database ``using`` (see the module docs):
    ``held``'s guard is taken before its first query (waiting up to ``wait`` s), and the
    transaction commits only if ``held`` is still held (:class:`LockLost` rolls it back).
    Exceptions of the block roll the transaction back and propagate."""
    connection = connections[using]
    if connection.connection is not None or connection.in_atomic_block:
        with transaction.atomic(using=using):
            with resource_guard.before_first_query(using, held, wait=wait):
                yield
            if held is not None:
                held.ensure_held()  # never commit the effect of a job that lost its lock
        return
    with contextlib.ExitStack() as stack:
        first_query = _FirstQuery(using, stack)
        with connection.execute_wrapper(first_query):
            with resource_guard.before_first_query(using, held, wait=wait):
                yield
        if held is not None and first_query.began:
            held.ensure_held()  # as above; the transaction commits when the stack closes


class _FirstQuery:
    """An execute wrapper beginning the job's transaction (entered in ``stack``) right before
    the first query on ``using``, unless the body is inside its own transaction by then."""

    def __init__(self, using: str, stack: contextlib.ExitStack) -> None:
        self.using = using
        self.stack = stack
        self.seen = False
        self.began = False

    def __call__(self, execute: Callable[..., Any], sql: str, *args: Any) -> Any:
        if not self.seen:
            self.seen = True  # first: the BEGIN below comes through here too
            # SQLite: the body's own atomic() sends BEGIN itself, before it is in its block.
            beginning = sql.lstrip()[:5].upper() == "BEGIN"
            if not beginning and not connections[self.using].in_atomic_block:
                self.stack.enter_context(transaction.atomic(using=self.using))
                self.began = True
        return execute(sql, *args)
