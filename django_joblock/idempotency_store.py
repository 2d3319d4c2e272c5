"""The idempotency record's SQL: insert-or-read in one statement, and bounded waits on its key.

- :func:`insert_or_read`: ``INSERT ... ON CONFLICT (scope, key) DO NOTHING``, and when the key
  exists, the existing row. On PostgreSQL one statement (a data-modifying CTE ``UNION ALL`` a
  read of the row): a first claim and a replay are each **one** query. On SQLite two (SQLite
  has no data-modifying CTEs: ``INSERT ... RETURNING``, then a ``SELECT`` when it inserted
  nothing); other databases use a savepoint and ``IntegrityError``.
- :func:`bounded_wait`: inside a transaction, an insert of a key that another *uncommitted*
  transaction inserted waits for that transaction (the unique key is the arbiter). That
  happens only after a lock loss (a paused holder still inside its transaction), and must not
  wait forever: on PostgreSQL a transaction-local ``lock_timeout`` for the claim's statements
  only (set, and set back to the value it had, by two short statements: the job's own
  statements run with the session's setting); on SQLite the connection's busy
  timeout (``OPTIONS["timeout"]``, Django's default 5 s) bounds it. Either way the wait ends in
  :class:`~django_joblock.exceptions.IdempotencyInProgress`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.db import DatabaseError, IntegrityError, OperationalError, connections, transaction

from .exceptions import IdempotencyInProgress

ROW_FIELDS = (
    "id",
    "status",
    "fingerprint",
    "owner",
    "attempts",
    "lease_expires_at",
    "result",
    "fence",
    "lock_resource",
)
_LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL: lock_timeout expired


def _select_row(model: Any, using: str, scope: str, key: str) -> dict[str, Any] | None:
    row: dict[str, Any] | None = (
        model.objects.using(using).filter(scope=scope, key=key).values(*ROW_FIELDS).first()
    )
    return row


def insert_or_read(
    model: Any, using: str, values: dict[str, Any]
) -> tuple[int | None, dict[str, Any] | None]:
    """Insert the row unless (scope, key) exists: ``(new id, None)``, ``(None, existing row)``,
    or ``(None, None)`` when a concurrent insert committed too late for this statement to see
    it (ask again)."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        return _insert_or_read_postgresql(model, connection, values)
    inserted = insert(model, using, values)
    if inserted is not None:
        return inserted, None
    return None, _select_row(model, using, values["scope"], values["key"])


def insert(model: Any, using: str, values: dict[str, Any]) -> int | None:
    """Insert the row unless (scope, key) exists; its id, or None on conflict."""
    connection = connections[using]
    if connection.vendor not in ("postgresql", "sqlite"):
        try:
            with transaction.atomic(using=using):
                return int(model.objects.using(using).create(**values).pk)
        except IntegrityError:
            return None
    sql, params = _insert_sql(model, connection, values)
    pk = connection.ops.quote_name(model._meta.pk.column)
    with connection.cursor() as cursor:
        cursor.execute(f"{sql} RETURNING {pk}", params)
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def _insert_sql(model: Any, connection: Any, values: dict[str, Any]) -> tuple[str, list[Any]]:
    meta = model._meta
    quote = connection.ops.quote_name
    columns, params = [], []
    for name, value in values.items():
        model_field = meta.get_field(name)
        columns.append(quote(model_field.column))
        params.append(model_field.get_db_prep_save(value, connection))
    conflict = ", ".join(quote(meta.get_field(f).column) for f in ("scope", "key"))
    sql = (
        f"INSERT INTO {quote(meta.db_table)} ({', '.join(columns)}) "
        f"VALUES ({', '.join(['%s'] * len(params))}) "
        f"ON CONFLICT ({conflict}) DO NOTHING"
    )
    return sql, params


def _insert_or_read_postgresql(
    model: Any, connection: Any, values: dict[str, Any]
) -> tuple[int | None, dict[str, Any] | None]:
    # One statement. The CTE's INSERT and the read of the table share one snapshot: after an
    # insert the read sees nothing (only the CTE's row comes back, with a NULL status: the
    # column is NOT NULL, so that marks "inserted"); on a conflict with a row committed before
    # the statement began, only the existing row comes back.
    meta = model._meta
    quote = connection.ops.quote_name
    insert_sql, params = _insert_sql(model, connection, values)
    pk = quote(meta.pk.column)
    columns = ", ".join(quote(meta.get_field(name).column) for name in ROW_FIELDS)
    nulls = ", ".join(["NULL"] * (len(ROW_FIELDS) - 1))
    sql = (
        f"WITH ins AS ({insert_sql} RETURNING {pk}) "
        f"SELECT {pk}, {nulls} FROM ins "
        f"UNION ALL SELECT {columns} FROM {quote(meta.db_table)} "
        f"WHERE {quote(meta.get_field('scope').column)} = %s "
        f"AND {quote(meta.get_field('key').column)} = %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, values["scope"], values["key"]])
        found = cursor.fetchone()
    if found is None:
        return None, None
    row = dict(zip(ROW_FIELDS, found, strict=True))
    if row["status"] is None:
        return int(row["id"]), None
    result_field = meta.get_field("result")
    row["result"] = result_field.from_db_value(row["result"], None, connection)
    return None, row


def _is_lock_wait_timeout(exc: DatabaseError, vendor: str) -> bool:
    if vendor == "postgresql":
        return getattr(exc.__cause__, "sqlstate", None) == _LOCK_NOT_AVAILABLE
    if vendor == "sqlite":
        return isinstance(exc, OperationalError) and "locked" in str(exc)
    return False


@contextlib.contextmanager
def bounded_wait(using: str, seconds: float, *, scope: str, key: str) -> Iterator[None]:
    """Bound how long the statements in the block wait for another transaction's lock on the
    record (see the module docs). Must run inside ``transaction.atomic(using=using)``.

    A wait that runs out raises :class:`IdempotencyInProgress` (the transaction is then
    unusable on PostgreSQL: let the exception leave the atomic block).
    """
    connection = connections[using]
    postgresql = connection.vendor == "postgresql"
    previous = ""
    if postgresql:
        with connection.cursor() as cursor:
            # The old value first (left to right), then the bound, local to the transaction.
            cursor.execute(
                "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, true)",
                [f"{seconds * 1000:.0f}"],
            )
            previous = cursor.fetchone()[0]
    try:
        yield
    except DatabaseError as exc:
        if not _is_lock_wait_timeout(exc, connection.vendor):
            raise
        raise IdempotencyInProgress(
            f"Idempotency key {key!r} (scope {scope!r}) is being written by another "
            f"transaction that did not end within {seconds:g}s (a run whose lock was lost is "
            "still inside its transaction); treated as in progress.",
            key=key,
            scope=scope,
        ) from exc
    if postgresql:
        with connection.cursor() as cursor:
            # Back to the previous value for the job's own statements.
            cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])
