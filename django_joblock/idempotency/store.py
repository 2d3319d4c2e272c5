"""The idempotency record's SQL: insert-or-read in one statement, and a key guard for claims
made inside a job's transaction.

- :func:`insert_or_read`: ``INSERT ... ON CONFLICT (scope, key) DO NOTHING``, and when the key
  exists, the existing row. On PostgreSQL one statement (a data-modifying CTE ``UNION ALL`` a
  read of the row): a first claim and a replay are each **one** query. On SQLite two (SQLite
  has no data-modifying CTEs: ``INSERT ... RETURNING``, then a ``SELECT`` when it inserted
  nothing); other databases use a savepoint and ``IntegrityError``.
- ``guard=True`` (claims inside a job's transaction, §4.9): a claim row inserted by a
  transaction that has not committed yet makes a second insert of the same key *wait* for that
  transaction. That happens only after a lock loss (a paused holder still inside its
  transaction), and must not wait for long. On PostgreSQL the same statement first takes a
  transaction-scoped advisory lock on the key (``pg_try_advisory_xact_lock`` of a 64-bit hash
  of scope and key, never waiting): a second transaction on the key finds it taken and is "in
  progress" at once, without a wait, without an extra statement, and without touching the
  session's ``lock_timeout``. The unique key stays the arbiter (a hash collision can only make
  an unrelated key look in progress: a requeue, 1 in 2**64). On SQLite a writer waits for the
  database's write lock instead, at most the connection's busy timeout
  (``OPTIONS["timeout"]``, Django's default 5 s); :func:`in_progress_on_busy` turns that
  timeout into :class:`~django_joblock.exceptions.IdempotencyInProgress`.
- ``lock_key`` (with ``guard``, on PostgreSQL): the same statement also takes the guard of the
  lock's resource (:mod:`django_joblock.resource_guard`); taken by another transaction, the
  answer is ``RESOURCE_GUARDED``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from django.db import IntegrityError, OperationalError, connections, transaction

from ..exceptions import IdempotencyInProgress
from .guard import GUARD_SQL, name_for, try_name

ROW_FIELDS = (
    "id",
    "status",
    "fingerprint",
    "token",
    "attempts",
    "lease_expires_at",
    "result",
    "fence",
    "lock_resource",
)
# What insert_or_read found: a new row, an existing one, neither (ask again), the key's guard
# taken by another transaction, or (PostgreSQL, guard=True) no row: insert it at the end; or
# the lock's resource guard taken by another transaction.
INSERTED, EXISTING, NOTHING, GUARDED, ABSENT, RESOURCE_GUARDED = (
    "inserted",
    "existing",
    "nothing",
    "guarded",
    "absent",
    "resource guarded",
)


def _select_row(model: Any, using: str, scope: str, key: str) -> dict[str, Any] | None:
    row: dict[str, Any] | None = (
        model.objects.using(using).filter(scope=scope, key=key).values(*ROW_FIELDS).first()
    )
    return row


def insert_or_read(
    model: Any,
    using: str,
    values: dict[str, Any],
    *,
    guard: bool = False,
    lock_key: str | None = None,
) -> tuple[str, int | None, dict[str, Any] | None]:
    """Insert the row unless (scope, key) exists: ``(INSERTED, id, None)``, ``(EXISTING, None,
    row)``, ``(NOTHING, None, None)`` when a concurrent insert committed too late for this
    statement to see it (ask again), or ``(GUARDED, None, None)`` (see the module docs).

    With ``guard`` on PostgreSQL nothing is inserted: one statement takes the key's guard and
    reads the row; without a row the answer is ``(ABSENT, None, None)`` and the caller inserts
    the row at the end of its transaction (:func:`insert`), with the job's result: one
    statement fewer than an insert now and an update of the result later. The guard keeps
    every other guarded claim of the key out meanwhile; the unique key still decides. With
    ``lock_key`` too, the statement also takes that lock's resource guard (module docs).
    """
    connection = connections[using]
    if connection.vendor == "postgresql":
        if guard:
            return _guard_and_read_postgresql(model, connection, values, lock_key)
        return _insert_or_read_postgresql(model, connection, values, guard)
    inserted = insert(model, using, values)
    if inserted is not None:
        return INSERTED, inserted, None
    row = _select_row(model, using, values["scope"], values["key"])
    return (EXISTING, None, row) if row is not None else (NOTHING, None, None)


def insert(model: Any, using: str, values: dict[str, Any]) -> int | None:
    """Insert the row unless (scope, key) exists; its id, or None on conflict."""
    connection = connections[using]
    if connection.vendor not in ("postgresql", "sqlite"):
        try:
            with transaction.atomic(using=using):
                return int(model.objects.using(using).create(**values).pk)
        except IntegrityError:
            return None
    with connection.cursor() as cursor:
        sql = _insert_sql(model, connection, tuple(values))
        cursor.execute(sql, _params(model, connection, values))
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def set_result(model: Any, using: str, record_id: int, token: str, result: Any) -> None:
    """``UPDATE`` the result of record ``record_id`` (still claimed with ``token``): one statement
    without the ORM's compilation, on the hot path of every job with a result."""
    connection = connections[using]
    meta = model._meta
    quote = connection.ops.quote_name
    result_field = meta.get_field("result")
    sql = (
        f"UPDATE {quote(meta.db_table)} SET {quote(result_field.column)} = %s "
        f"WHERE {quote(meta.pk.column)} = %s AND {quote(meta.get_field('token').column)} = %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [result_field.get_db_prep_save(result, connection), record_id, token])


def try_guard(using: str, scope: str, key: str) -> bool:
    """Take the key's transaction-scoped guard on PostgreSQL without waiting (True elsewhere).
    Must run inside a transaction."""
    return try_name(using, _guard_name(scope, key))


def _guard_name(scope: str, key: str) -> str:
    return f"django_joblock\x1f{scope}\x1f{key}"


def _columns(model: Any, connection: Any, values: dict[str, Any]) -> tuple[str, list[Any]]:
    return _column_list(model, connection, tuple(values)), _params(model, connection, values)


def _params(model: Any, connection: Any, values: dict[str, Any]) -> list[Any]:
    meta = model._meta
    return [meta.get_field(name).get_db_prep_save(v, connection) for name, v in values.items()]


# The statements' text depends only on the model, the backend (its quoting) and the columns:
# built once per process, not on every job with an idempotency key. Few entries: one per
# statement, backend and column set.
_SQL: dict[tuple[Any, ...], str] = {}


def _cached_sql(kind: str, model: Any, connection: Any, names: tuple[str, ...]) -> str:
    key = (kind, model, connection.vendor, names)
    sql = _SQL.get(key)
    if sql is None:
        sql = _SQL[key] = _BUILDERS[kind](model, connection, names)
    return sql


def _column_list(model: Any, connection: Any, names: tuple[str, ...]) -> str:
    return _cached_sql("columns", model, connection, names)


def _insert_sql(model: Any, connection: Any, names: tuple[str, ...]) -> str:
    return _cached_sql("insert", model, connection, names)


def _build_columns(model: Any, connection: Any, names: tuple[str, ...]) -> str:
    quote = connection.ops.quote_name
    return ", ".join(quote(model._meta.get_field(name).column) for name in names)


def _build_insert(model: Any, connection: Any, names: tuple[str, ...]) -> str:
    quote = connection.ops.quote_name
    return (
        f"INSERT INTO {quote(model._meta.db_table)} ({_column_list(model, connection, names)}) "
        f"VALUES ({', '.join(['%s'] * len(names))}) {_on_conflict(model, connection)} "
        f"RETURNING {quote(model._meta.pk.column)}"
    )


def _build_guard_and_read(model: Any, connection: Any, names: tuple[str, ...]) -> str:
    meta = model._meta
    quote = connection.ops.quote_name
    fields = ", ".join(f"t.{quote(meta.get_field(name).column)}" for name in ROW_FIELDS)
    resource = GUARD_SQL if names else "TRUE"  # names: ("lock",) with a resource guard
    return (
        f"SELECT {resource}, {GUARD_SQL}, {fields} FROM (SELECT 1) AS one "
        f"LEFT JOIN {quote(meta.db_table)} t "
        f"ON t.{quote(meta.get_field('scope').column)} = %s "
        f"AND t.{quote(meta.get_field('key').column)} = %s"
    )


_BUILDERS = {
    "columns": _build_columns,
    "insert": _build_insert,
    "guard_and_read": _build_guard_and_read,
}


def _on_conflict(model: Any, connection: Any) -> str:
    quote = connection.ops.quote_name
    conflict = ", ".join(quote(model._meta.get_field(f).column) for f in ("scope", "key"))
    return f"ON CONFLICT ({conflict}) DO NOTHING"


def _insert_or_read_postgresql(
    model: Any, connection: Any, values: dict[str, Any], guard: bool
) -> tuple[str, int | None, dict[str, Any] | None]:
    # One statement. The guard CTE is evaluated first (the INSERT reads from it); the INSERT
    # runs only with the guard. The CTE's INSERT and the read of the table share one snapshot:
    # after an insert the read sees nothing (only the CTE's row comes back, marked 1); on a
    # conflict with a row committed before the statement began, only the existing row (2); no
    # guard: only the marker row 3.
    meta = model._meta
    quote = connection.ops.quote_name
    table = quote(meta.db_table)
    columns, params = _columns(model, connection, values)
    placeholders = ", ".join(["%s"] * len(params))
    fields = ", ".join(quote(meta.get_field(name).column) for name in ROW_FIELDS)
    nulls = ", ".join(["NULL"] * (len(ROW_FIELDS) - 1))
    ok = GUARD_SQL if guard else "TRUE"
    sql = (
        f"WITH g AS MATERIALIZED (SELECT {ok} AS ok), "
        f"ins AS (INSERT INTO {table} ({columns}) SELECT {placeholders} FROM g WHERE g.ok "
        f"{_on_conflict(model, connection)} RETURNING {quote(meta.pk.column)}) "
        f"SELECT 1, {quote(meta.pk.column)}, {nulls} FROM ins "
        f"UNION ALL SELECT 2, {fields} FROM {table}, g WHERE g.ok "
        f"AND {quote(meta.get_field('scope').column)} = %s "
        f"AND {quote(meta.get_field('key').column)} = %s "
        f"UNION ALL SELECT 3, NULL, {nulls} FROM g WHERE NOT g.ok"
    )
    head = [_guard_name(values["scope"], values["key"])] if guard else []
    with connection.cursor() as cursor:
        cursor.execute(sql, [*head, *params, values["scope"], values["key"]])
        found = cursor.fetchone()
    if found is None:
        return NOTHING, None, None
    kind, *rest = found
    if kind == 3:
        return GUARDED, None, None
    row = dict(zip(ROW_FIELDS, rest, strict=True))
    if kind == 1:
        return INSERTED, int(row["id"]), None
    result_field = meta.get_field("result")
    row["result"] = result_field.from_db_value(row["result"], None, connection)
    return EXISTING, None, row


def _guard_and_read_postgresql(
    model: Any, connection: Any, values: dict[str, Any], lock_key: str | None
) -> tuple[str, int | None, dict[str, Any] | None]:
    # One read-only statement: the guards (never waiting) and the row, if there is one. A
    # replay is this one query.
    meta = model._meta
    names = ("lock",) if lock_key is not None else ()
    sql = _cached_sql("guard_and_read", model, connection, names)
    head = [name_for(lock_key)] if lock_key is not None else []
    with connection.cursor() as cursor:
        cursor.execute(
            sql,
            [*head, _guard_name(values["scope"], values["key"]), values["scope"], values["key"]],
        )
        resource_ok, ok, *rest = cursor.fetchone()
    if not resource_ok:
        return RESOURCE_GUARDED, None, None
    if not ok:
        return GUARDED, None, None
    row = dict(zip(ROW_FIELDS, rest, strict=True))
    if row["id"] is None:
        return ABSENT, None, None
    result_field = meta.get_field("result")
    row["result"] = result_field.from_db_value(row["result"], None, connection)
    return EXISTING, None, row


def in_progress(scope: str, key: str, why: str) -> IdempotencyInProgress:
    return IdempotencyInProgress(
        f"Idempotency key {key!r} (scope {scope!r}) is being claimed by another transaction "
        f"({why}; a run whose lock was lost may still be inside its transaction); treated as "
        "in progress.",
        key=key,
        scope=scope,
    )


@contextlib.contextmanager
def in_progress_on_busy(using: str, *, scope: str, key: str) -> Iterator[None]:
    """SQLite: a write that waited out the busy timeout becomes :class:`IdempotencyInProgress`
    (another transaction holds the database's write lock; see the module docs)."""
    try:
        yield
    except OperationalError as exc:
        if connections[using].vendor != "sqlite" or "locked" not in str(exc):
            raise
        raise in_progress(scope, key, f"the database stayed locked: {exc}") from exc
