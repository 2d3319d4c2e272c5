"""Our workers and Django's database connections in a user's tests: a ``TestCase`` that runs a
burst worker in-process (django-rq's own testing pattern) keeps its connection, and a test
without database access can run jobs that never use the database."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import TestCase
from rq import Queue
from rq.job import JobStatus

from django_joblock.worker import JoblockSimpleWorker, JoblockWorker
from tests.testapp.models import Account


def _burst(worker_class: type, rconn: Any) -> Any:
    queue = Queue("default", connection=rconn)
    job = queue.enqueue(len, "abc")
    worker_class([queue], connection=rconn).work(burst=True)
    return job


class BurstWorkersInATestCase(TestCase):
    """Each worker used to close the test's connection (inside its transaction): this test
    and every later test of its class failed with "the connection is closed"."""

    def _check(self, worker_class: type) -> None:
        from django_redis import get_redis_connection

        Account.objects.create(name="kept", balance=1)
        job = _burst(worker_class, get_redis_connection("default"))
        assert job.get_status(refresh=True) == JobStatus.FINISHED
        assert Account.objects.get(name="kept").balance == 1, "the test's connection is open"

    def test_a_simple_worker_keeps_the_tests_connection(self) -> None:
        self._check(JoblockSimpleWorker)

    @pytest.mark.slow  # forks a work horse
    def test_a_forking_worker_keeps_the_tests_connection(self) -> None:
        self._check(JoblockWorker)


def test_a_simple_worker_runs_a_job_without_database_access(django_db_blocker, rconn):
    """No database access allowed (pytest-django), a connection left open by an earlier test:
    the worker quit with "unhandled exception" and the job stayed queued."""
    with django_db_blocker.unblock():
        connection.ensure_connection()
    assert connection.connection is not None
    try:
        job = _burst(JoblockSimpleWorker, rconn)
        assert job.get_status(refresh=True) == JobStatus.FINISHED
    finally:
        with django_db_blocker.unblock():
            connection.close()


@pytest.mark.slow  # forks a work horse
def test_a_forking_worker_prepares_its_horses_without_a_database_connection(rconn):
    """Before each fork the worker builds the idempotency records' statements (so that no
    horse builds them again) from the model and the backend's quoting alone: with database
    access refused (pytest-django), a connection would raise in the worker and the job would
    not run."""
    job = _burst(JoblockWorker, rconn)
    assert job.get_status(refresh=True) == JobStatus.FINISHED, job.latest_result()
    assert connection.connection is None


@pytest.mark.django_db(transaction=True)
def test_a_stale_connection_is_still_closed_around_a_job(settings, rconn):
    """Outside a transaction the simple worker still drops a connection past its max age."""
    connection.ensure_connection()
    connection.close_at = 0.0  # past CONN_MAX_AGE
    _burst(JoblockSimpleWorker, rconn)
    assert connection.connection is None


@pytest.mark.django_db(transaction=True)
def test_a_lock_only_job_that_never_queries_sends_no_statement(rconn):
    """Seen by the database: the worker's open connection stays idle through a lock-only job
    whose body never queries (on PostgreSQL no BEGIN, no guard, no COMMIT: the backend's
    ``state_change`` stays; on SQLite, whose transactions Django begins eagerly, sqlite3's trace
    shows only the BEGIN and COMMIT); one whose body reads does query."""
    from django.db import connections

    from tests.jobs import hold_resource, read_balance

    Account.objects.create(name="idle", balance=7)
    connection.close_at = None  # a persistent connection (CONN_MAX_AGE=None): kept between jobs
    opened = connection.connection
    watcher = connections.create_connection("default")
    statements: list[str] = []
    if connection.vendor == "postgresql":
        backend = opened.info.backend_pid

        def seen() -> Any:
            with watcher.cursor() as cursor:
                query = "SELECT state_change FROM pg_stat_activity WHERE pid = %s"
                cursor.execute(query, [backend])
                return cursor.fetchone()[0]
    else:
        opened.set_trace_callback(statements.append)

        def seen() -> Any:  # the queries: not the job's transaction's BEGIN and COMMIT
            return [sql for sql in statements if not sql.startswith(("BEGIN", "COMMIT"))]

    try:
        queue = Queue("default", connection=rconn)
        before = seen()
        quiet = hold_resource.delay(1, "quiet", 0.0)
        JoblockSimpleWorker([queue], connection=rconn).work(burst=True)
        assert quiet.get_status(refresh=True) == JobStatus.FINISHED
        assert connection.connection is opened, "the same connection"
        assert seen() == before, "the lock-only no-op job sent a statement"
        # Negative control: a lock-only job that reads is seen (BEGIN, guard, SELECT, COMMIT).
        reads = read_balance.delay("idle")
        JoblockSimpleWorker([queue], connection=rconn).work(burst=True)
        assert reads.get_status(refresh=True) == JobStatus.FINISHED
        assert reads.return_value() == 7
        assert seen() != before
    finally:
        watcher.close()
