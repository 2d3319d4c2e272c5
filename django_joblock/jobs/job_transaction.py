"""The transaction a lock-only ``@locked_job`` body runs in (``atomic=True``, no idempotency key;
docs/jobs.md, "The job's transaction").

The body's queries on the records' database run in one transaction, committed after the body
returned and only while the lock is still held (``ensure_held()``; a lost lock rolls it back),
with the resource's guard taken before its first query (:mod:`..idempotency.resource_guard`).

**A body that never queries opens no connection.** When the database connection is not open yet
(a forking worker's horse: the worker closes connections before each fork), the transaction
begins when the body opens the connection (Django's ``connection_created``), not before the
body: a job that only uses Redis or an HTTP API costs no database session. Opening it is the
first thing any database use does, so the transaction has begun before the body's first
query, before Django checks that ``select_for_update()`` runs in a transaction, and before the
body's own ``transaction.atomic()`` block, which nests in it (a savepoint) as it does when the
connection is open. When the connection is open (a ``SimpleWorker``, an inline call), the
transaction begins before the body, as ``transaction.atomic()`` does. A body's
``atomic(durable=True)`` is therefore refused by Django on an open connection and, on one the
body opens, runs as a savepoint of the job's transaction: a job that needs a durable block
takes ``atomic=False``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.db import connections, transaction
from django.db.backends.signals import connection_created

from ..idempotency import resource_guard
from ..locks.lock import Lock
from .abort import commit_begins


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
                commit_begins()  # a loss from here on is reported, not raised inside COMMIT
        return
    with contextlib.ExitStack() as stack:
        opened = _BeginWhenOpened(connection, using, stack)
        connection_created.connect(opened, weak=False)
        try:
            with resource_guard.before_first_query(using, held, wait=wait):
                yield
        finally:
            connection_created.disconnect(opened)
        if held is not None and opened.began:
            held.ensure_held()  # as above; the transaction commits when the stack closes
            commit_begins()


class _BeginWhenOpened:
    """A ``connection_created`` receiver that begins the job's transaction (entered in
    ``stack``) when this thread's ``connection`` (of alias ``using``) opens. Other threads'
    connections and other aliases are not its business."""

    def __init__(self, connection: Any, using: str, stack: contextlib.ExitStack) -> None:
        self.connection = connection
        self.using = using
        self.stack = stack
        self.began = False

    def __call__(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        if connection is self.connection and not self.began:
            self.began = True
            self.stack.enter_context(transaction.atomic(using=self.using))
