"""A lock lost while its job's transaction commits does not interrupt the commit.

Review bug: with ``ON_LOCK_LOST = "abort"`` (the default) the renewal thread's abort signal raised
``LockLost`` wherever the job's thread was, ``COMMIT`` included. psycopg gave up waiting for a
commit PostgreSQL then completed (SQLite's commit returns first, and the error came right after
it): the job was reported failed with its effect kept, RQ's ``Retry`` ran it again, and a
lock-only job's effect landed twice. Once the last ``ensure_held()`` has passed, the run's
outcome is its commit's; the loss is still noticed and reported."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections

from django_joblock import LockLost, lock, locked_job
from django_joblock.jobs.abort import Abort, commit_begins
from tests.harness import expire_now, wait_for

TABLE = "test_slow_commit"
noticed: list[str] = []


@locked_job("default", lock="commit:{n}", ttl=3, on_lost=lambda held, why: noticed.append(why))
def insert_then_commit(n: int) -> int:
    """One INSERT; the table's deferred trigger makes the job's COMMIT take 4 s."""
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {TABLE} (n) VALUES (%s)", [n])
    return n


@pytest.fixture
def slow_commits() -> Iterator[None]:
    """A table whose inserted rows make ``COMMIT`` sleep 4 s (a deferred constraint trigger)."""
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {TABLE} (id serial PRIMARY KEY, n int)")
        cursor.execute(
            "CREATE FUNCTION test_slow_commit_fn() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(4); RETURN NULL; END $$"
        )
        cursor.execute(
            f"CREATE CONSTRAINT TRIGGER test_slow_commit_tr AFTER INSERT ON {TABLE} "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_slow_commit_fn()"
        )
    noticed.clear()
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TABLE IF EXISTS {TABLE}")
            cursor.execute("DROP FUNCTION IF EXISTS test_slow_commit_fn()")


def _expire_while_committing(rconn: Any, key: str, seen: list[bool]) -> None:
    """Expire ``key`` once another session's ``COMMIT`` of this database is running."""
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with connections["default"].cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE query = 'COMMIT' AND "
                    "state = 'active' AND datname = current_database() AND "
                    "pid <> pg_backend_pid()"
                )
                if cursor.fetchone()[0]:
                    seen.append(True)
                    expire_now(rconn, key)
                    return
            time.sleep(0.02)
    finally:
        connections["default"].close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="a COMMIT that takes seconds needs PostgreSQL (a deferred trigger); "
    "test_a_loss_found_once_the_commit_began_interrupts_nothing covers both",
)
def test_a_lock_lost_during_the_jobs_commit_leaves_the_commit_alone(rconn, slow_commits):
    seen: list[bool] = []
    expirer = threading.Thread(
        target=_expire_while_committing, args=(rconn, "joblock:{commit:1}:lock", seen)
    )
    expirer.start()
    try:
        assert insert_then_commit(1) == 1, "the commit went through: the run ran"
    finally:
        expirer.join()
    assert seen, "negative control: the lock was expired while the COMMIT ran"
    assert noticed, "negative control: the renewal thread found the lock lost meanwhile"
    with connection.cursor() as cursor:  # the connection is usable, not left mid-command
        cursor.execute(f"SELECT count(*) FROM {TABLE}")
        assert cursor.fetchone()[0] == 1


def test_a_loss_found_once_the_commit_began_interrupts_nothing(rconn):
    held = lock("abort:commit", ttl=5)
    with Abort() as armed:
        commit_begins()
        finder = threading.Thread(target=armed.lost, args=(held, "expired"))
        finder.start()
        finder.join()
        time.sleep(0.2)  # a signal sent to this thread would have been handled by now
        assert not armed.sent and armed.reason == "expired", "noticed, not signalled"
    # Negative control: before commit_begins() the same loss interrupts the job's thread.
    with pytest.raises(LockLost, match="aborted"):
        with Abort() as armed:
            finder = threading.Thread(target=armed.lost, args=(held, "expired"))
            finder.start()
            finder.join()
            assert wait_for(lambda: False, 2), "interrupted before this ends"
