"""The idempotency record's SQL: insert-or-read, and the key's guard.

:func:`insert_or_read`: ``INSERT ... ON CONFLICT (scope, key) DO NOTHING``, then a read of an
existing row; one statement on PostgreSQL (a first claim and a replay are one query each), two on
SQLite, a savepoint elsewhere. With ``guard=True`` (inside a job's transaction) a second transaction
on the key never waits for the first's uncommitted row: on PostgreSQL one read-only statement takes
the key's advisory lock (and with ``lock_key`` the resource's, :mod:`.guard`) without waiting and
reads the row, inserted at the commit (the unique key decides); on SQLite
:func:`in_progress_on_busy` turns the busy timeout into :class:`IdempotencyInProgress`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, OperationalError, connections, transaction

from .. import conf
from ..exceptions import IdempotencyInProgress
from .inputs import error_for
from .resource_guard import GUARD_SQL, name_for, try_name

# The columns read back, in the order of the statements' select lists.
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
# What insert_or_read found: a new row; an existing one; neither (a concurrent insert committed
# too late for the statement: ask again); the key's guard taken by another transaction; with
# guard=True on PostgreSQL, no row (insert it at the end); the lock's resource guard taken.
INSERTED = "inserted"
EXISTING = "existing"
NOTHING = "nothing"
GUARDED = "guarded"
ABSENT = "absent"
RESOURCE_GUARDED = "resource guarded"
Row = dict[str, Any]  # column values by field name
Found = tuple[str, int | None, Row | None]  # what, a new row's id, an existing row


def record_model() -> Any:
    """``IdempotencyRecord``, imported late (models load with the app registry)."""
    from ..models import IdempotencyRecord

    return IdempotencyRecord


def cut_job_id(model: Any, job_id: str) -> str:
    """``job_id`` cut to the length of ``model``'s ``rq_job_id`` column. RQ allows ids of any
    length; the column only tells the admin and the doctor which job wrote the row (the doctor
    looks an id up cut the same way), and a longer id would fail the job's every write."""
    return job_id[: model._meta.get_field("rq_job_id").max_length]


def expiry(now: datetime) -> datetime:
    """When a record claimed or finished ``now`` may be purged."""
    return now + timedelta(seconds=conf.get().IDEMPOTENCY_TTL)


def insert_or_read(
    model: Any, using: str, values: Row, *, guard: bool = False, lock_key: str | None = None
) -> Found:
    """Insert the row unless (scope, key) exists (see the module docs): ``(INSERTED, id,
    None)``, ``(EXISTING, None, row)``, or ``(what, None, None)`` for the other answers."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        if guard:
            return _guard_and_read_postgresql(model, connection, values, lock_key)
        return _insert_or_read_postgresql(model, connection, values)
    if (inserted := insert(model, using, values)) is not None:
        return INSERTED, inserted, None
    row = model.objects.using(using).filter(scope=values["scope"], key=values["key"])
    found: Row | None = row.values(*ROW_FIELDS).first()
    return (EXISTING, None, found) if found is not None else (NOTHING, None, None)


def insert(model: Any, using: str, values: Row) -> int | None:
    """Insert the row unless (scope, key) exists; its id, or None on conflict. Columns missing
    from ``values`` take the model's defaults, as with ``create()``."""
    connection = connections[using]
    if connection.vendor not in ("postgresql", "sqlite"):
        try:
            with transaction.atomic(using=using):
                return int(model.objects.using(using).create(**values).pk)
        except IntegrityError:
            return None
    with connection.cursor() as cursor:
        cursor.execute(*_insert_sql(model, connection, values))
        row = cursor.fetchone()
    return None if row is None else int(row[0])


def try_guard(using: str, scope: str, key: str) -> bool:
    """Take the key's guard in the current transaction, never waiting (True off PostgreSQL)."""
    return try_name(using, _guard_name(scope, key))


def _guard_name(scope: str, key: str) -> str:
    return f"django_joblock\x1f{scope}\x1f{key}"


def _table(model: Any, connection: Any) -> str:
    return str(connection.ops.quote_name(model._meta.db_table))


def _columns(model: Any, connection: Any, names: Any, prefix: str = "") -> str:
    columns = (model._meta.get_field(name).column for name in names)
    return ", ".join(prefix + connection.ops.quote_name(column) for column in columns)


def _insert_sql(model: Any, connection: Any, values: Row) -> tuple[str, list[Any]]:
    fields = _insert_fields(model)
    params = []
    for name, field in fields:
        value = values[name] if name in values else field.get_default()
        params.append(field.get_db_prep_save(value, connection))
    return _statement("insert", model, connection), params


@functools.cache
def _insert_fields(model: Any) -> list[tuple[str, Any]]:
    """(name, field) of the columns an insert writes: every concrete field but the id."""
    return [(f.name, f) for f in model._meta.concrete_fields if not f.primary_key]


def _insert_statement(model: Any, connection: Any) -> str:
    names = [name for name, _ in _insert_fields(model)]
    return (
        f"INSERT INTO {_table(model, connection)} ({_columns(model, connection, names)}) "
        f"VALUES ({', '.join(['%s'] * len(names))}) "
        f"ON CONFLICT ({_columns(model, connection, ('scope', 'key'))}) DO NOTHING "
        f"RETURNING {_columns(model, connection, ['id'])}"
    )


def _insert_or_read_statement(model: Any, connection: Any) -> str:
    # One statement. The CTE's INSERT and the read of the table share one snapshot: after an
    # insert the read sees nothing (only the CTE's row comes back, marked 1); on a conflict
    # with a row committed before the statement began, only the existing row (2).
    pk = _columns(model, connection, ["id"])
    nulls = ", ".join(["NULL"] * (len(ROW_FIELDS) - 1))
    return (
        f"WITH ins AS ({_statement('insert', model, connection)}) SELECT 1, {pk}, {nulls} "
        f"FROM ins UNION ALL SELECT 2, {_columns(model, connection, ROW_FIELDS)} "
        f"FROM {_table(model, connection)} WHERE {_by_key(model, connection)}"
    )


def _guard_and_read_statement(model: Any, connection: Any, resource: str) -> str:
    return (
        f"SELECT {resource}, {GUARD_SQL}, {_columns(model, connection, ROW_FIELDS, 't.')} "
        f"FROM (SELECT 1) AS one LEFT JOIN {_table(model, connection)} t "
        f"ON {_by_key(model, connection, 't.')}"
    )


# The statements, by name: the same text for every job of a model and database vendor.
_BUILDERS: dict[str, Callable[[Any, Any], str]] = {
    "insert": _insert_statement,
    "insert_or_read": _insert_or_read_statement,
    "guard_and_read": functools.partial(_guard_and_read_statement, resource="TRUE"),
    "guard_resource_and_read": functools.partial(_guard_and_read_statement, resource=GUARD_SQL),
}
_STATEMENTS: dict[tuple[str, Any, str], str] = {}


def _statement(name: str, model: Any, connection: Any) -> str:
    """Statement ``name`` for ``model`` on ``connection``'s vendor, built once per process."""
    key = (name, model, connection.vendor)
    found = _STATEMENTS.get(key)
    if found is None:
        found = _STATEMENTS[key] = _BUILDERS[name](model, connection)
    return found


def warm(using: str) -> None:
    """Build the statements for the records' database ``using`` now, without a query or a
    connection: a forking worker calls it before it forks, so that no work horse builds them
    again (each would, and throw them away at its exit)."""
    connection = connections[using]
    model = record_model()
    _insert_fields(model)
    for name in _BUILDERS:
        _statement(name, model, connection)


def _by_key(model: Any, connection: Any, prefix: str = "") -> str:
    both = (_columns(model, connection, [name], prefix) for name in ("scope", "key"))
    return " AND ".join(f"{column} = %s" for column in both)


def _read(model: Any, connection: Any, fields: Any) -> Row:
    row = dict(zip(ROW_FIELDS, fields, strict=True))
    row["result"] = model._meta.get_field("result").from_db_value(row["result"], None, connection)
    return row


def _insert_or_read_postgresql(model: Any, connection: Any, values: Row) -> Found:
    _, params = _insert_sql(model, connection, values)
    sql = _statement("insert_or_read", model, connection)
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, values["scope"], values["key"]])
        found = cursor.fetchone()
    if found is None:
        return NOTHING, None, None
    if found[0] == 1:
        return INSERTED, int(found[1]), None
    return EXISTING, None, _read(model, connection, found[1:])


def _guard_and_read_postgresql(
    model: Any, connection: Any, values: Row, lock_key: str | None
) -> Found:
    # One read-only statement: the guards (never waiting) and the row. Its snapshot is taken before
    # its guards: a run that committed the row in between (it let the guards go) is not seen, and
    # this run goes on as the first. It cannot commit a second record: its INSERT at the end meets
    # the unique key (one_commit.record_result), and the run is rolled back and goes again, finding
    # the row. Re-reading every "no row" under the guards would cost every first run a statement
    # for a race of two runs of one key within one statement's time.
    name = "guard_resource_and_read" if lock_key is not None else "guard_and_read"
    sql = _statement(name, model, connection)
    head = [name_for(lock_key)] if lock_key is not None else []
    scope = values["scope"]
    key = values["key"]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*head, _guard_name(scope, key), scope, key])
        resource_ok, ok, *rest = cursor.fetchone()
    if not resource_ok:
        return RESOURCE_GUARDED, None, None
    if not ok:
        return GUARDED, None, None
    if rest[0] is None:
        return ABSENT, None, None
    return EXISTING, None, _read(model, connection, rest)


def in_progress(scope: str, key: str, why: str) -> IdempotencyInProgress:
    why = f"is being claimed by another transaction ({why}; maybe a run that lost its lock)."
    return error_for(IdempotencyInProgress, key, scope, why)


@contextlib.contextmanager
def in_progress_on_busy(using: str, *, scope: str, key: str) -> Iterator[None]:
    """SQLite: a write that waited out the busy timeout becomes :class:`IdempotencyInProgress`
    (another transaction holds the database's write lock)."""
    try:
        yield
    except OperationalError as exc:
        if connections[using].vendor != "sqlite" or "locked" not in str(exc):
            raise
        raise in_progress(scope, key, f"the database stayed locked: {exc}") from exc
