"""What a ``@locked_job`` costs beyond its guarantees, counted (never timed), on real worker
processes: a lock-only job whose body never queries opens no database connection."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from django.db import connection
from rq import Queue, SimpleWorker, Worker
from rq.job import JobStatus

from django_joblock import metrics
from django_joblock.locks import renewal
from django_joblock.worker import JoblockSimpleWorker
from tests import harness, jobs
from tests.counting import CommandCounter
from tests.harness import wait_for
from tests.testapp.models import Account
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


def _sessions() -> int:
    """Sessions PostgreSQL counted on the test database (each horse that connects adds one)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def _results(queue_jobs: list[object], workers: Workers) -> list[object]:
    for job in queue_jobs:
        assert wait_status(job, DONE, 30) is JobStatus.FINISHED, workers.logs()
    return [job.return_value() for job in queue_jobs]  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("simple", [False, True], ids=["Worker", "SimpleWorker"])
def test_a_lock_only_body_that_never_queries_opens_no_database_connection(workers, simple):
    workers.start(simple=simple)
    assert _results([jobs.report_connection.delay(0, False)], workers) == [False]  # warmed up
    before = _sessions() if connection.vendor == "postgresql" else 0
    quiet = [jobs.report_connection.delay(n, False) for n in range(1, 6)]
    assert _results(quiet, workers) == [False] * 5, "the body ran without a connection"
    if connection.vendor == "postgresql":
        time.sleep(1)  # a backend's session counts once it has ended: none may come late
        assert _sessions() == before, "no job opened a PostgreSQL session"
    # Negative control: a body that queries connects (the job's transaction, then its query).
    querying = [jobs.report_connection.delay(n, True) for n in range(6, 9)]
    assert _results(querying, workers) == [True] * 3
    if connection.vendor == "postgresql" and not simple:
        assert wait_for(lambda: _sessions() >= before + 3, 10), "each horse's session counted"


@pytest.mark.slow
def test_a_body_whose_first_database_use_is_its_own_transaction_commits_it(workers):
    """In a horse the connection opens inside the body's own ``atomic()``: that block is the
    outermost one and commits its read-modify-write, as many as the jobs."""
    Account.objects.create(name="own", balance=0)
    workers.start()
    added = [jobs.add_in_own_transaction.delay("own", 1) for _ in range(4)]
    assert sorted(_results(added, workers)) == [1, 2, 3, 4]  # type: ignore[type-var]
    assert Account.objects.get(name="own").balance == 4


# -- round trips, counted on the wire -----------------------------------------------------------
# What a client sends when it connects (redis-py's handshake), counted apart from the job's work.
HANDSHAKE = frozenset({"CLIENT", "SELECT", "HELLO", "AUTH"})


@pytest.fixture
def counted(settings) -> Iterator[CommandCounter]:  # type: ignore[no-untyped-def]
    """Locks and queue through one counting relay: one server and database, as most deploy."""
    port = int(harness.redis_url().rsplit(":", 1)[1].split("/")[0])
    counter = CommandCounter(port)
    cache = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": counter.url}
    settings.CACHES = {**settings.CACHES, "counted": cache}
    settings.JOBLOCK = {**settings.JOBLOCK, "REDIS_ALIAS": "counted"}
    yield counter
    counter.close()


def _drain(
    counter: CommandCounter,
    fork: bool,
    func: str,
    first: int,
    args: tuple[object, ...] = (),
    jobs: int = 5,
) -> tuple[list[tuple[str, ...]], int]:
    """Run ``func(n, *args)`` for ``jobs`` values of n in one burst of RQ's own worker (no sweep
    of ours): the round trips sent (handshakes apart) and the connections made meanwhile. A
    locked job's outcome is recorded in the round trip of its lock's release."""
    import redis

    connection = redis.Redis.from_url(counter.url)
    queue = Queue(f"cost-{first}", connection=connection)
    enqueued = [queue.enqueue(func, n, *args) for n in range(first, first + jobs)]
    counter.take_flights()
    worker_class = Worker if fork else SimpleWorker
    worker_class([queue], connection=connection).work(burst=True)
    flights, connections = counter.take_flights()
    for job in enqueued:
        assert job.get_status(refresh=True) is JobStatus.FINISHED, job.latest_result()
        if func.startswith("tests.jobs.locked"):
            assert job.get_meta(refresh=True)["joblock"]["outcome"] == "ran"
    # The release and the outcome's meta and run history (a script each): one flight.
    riding = [f for f in flights if f.count("EVALSHA") >= 3 and "EVAL" not in f]
    if func.startswith("tests.jobs.locked"):
        assert len(riding) == jobs, f"outcome and history ride each release: {flights}"
    return [tuple(f) for f in flights if not HANDSHAKE.issuperset(f)], connections


def _beyond(locked: list[tuple[str, ...]], plain: list[tuple[str, ...]]) -> str:
    """The failure message: the round trips of the locked jobs that plain RQ's lack."""
    extra = Counter(locked) - Counter(plain)
    return f"{len(locked)} round trips against plain RQ's {len(plain)}; beyond them: {extra}"


@pytest.mark.slow  # the forking case forks the test process
@pytest.mark.parametrize("fork", [False, True], ids=["SimpleWorker", "Worker"])
def test_a_lock_only_job_costs_two_round_trips_beyond_plain_rq(counted, fork):
    """DESIGN 4.16: the acquire, and one release round trip that carries the job's outcome, its
    run history and the metrics (locks and queue on one server and database)."""
    _drain(counted, fork, "tests.jobs.locked_noop", 0)  # scripts loaded, pools warm
    plain, plain_connections = _drain(counted, fork, "tests.jobs.plain_noop", 10)
    locked, locked_connections = _drain(counted, fork, "tests.jobs.locked_noop", 20)
    assert len(locked) - len(plain) == 2 * 5, _beyond(locked, plain)
    if not fork:
        assert locked_connections == plain_connections, "the worker's connections are reused"


@pytest.mark.slow
def test_a_job_longer_than_a_metrics_flush_interval_still_costs_two_round_trips(
    counted, monkeypatch
):
    """Its metrics wait for its release: the renewal thread flushes a running job's metrics
    only once they are ``renewal.JOB_FLUSH_INTERVAL`` old, however long ago the last flush was.
    (A 1.5 s job paid a third round trip for them: the thread flushed a second after the last
    flush, or, with that rule stretched to the job interval, after a quiet spell.)"""
    monkeypatch.setattr(renewal, "JOB_FLUSH_INTERVAL", 2.5 * metrics.FLUSH_INTERVAL)
    nap = 1.5 * metrics.FLUSH_INTERVAL
    _drain(counted, False, "tests.jobs.locked_noop", 0)  # scripts loaded, pools warm
    plain, _ = _drain(counted, False, "tests.jobs.plain_nap", 10, (nap,), jobs=2)
    time.sleep(renewal.JOB_FLUSH_INTERVAL)  # quiet: the last flush is older than that
    locked, _ = _drain(counted, False, "tests.jobs.locked_nap", 20, (nap,), jobs=2)
    assert len(locked) - len(plain) == 2 * 2, _beyond(locked, plain)


@pytest.mark.slow
def test_an_in_process_workers_jobs_flush_their_metrics_when_due_not_one_flush_per_job(counted):
    """A work horse flushes its job's metrics in the job's release (it ``os._exit``\\ s next);
    :class:`JoblockSimpleWorker` runs job after job in its own process: a release carries them
    once they are a flush interval old, and the rest go out when its ``work()`` ends. Negative
    control: RQ's own ``SimpleWorker`` flushes in every release (a fourth EVALSHA in the flight
    that carries the outcome)."""
    import redis

    def flushes_in_releases(worker_class: type, first: int) -> tuple[int, float, int]:
        """Of 5 jobs' releases, how many carried a flush; the drain's seconds; the count of
        acquires in Redis after it."""
        connection = redis.Redis.from_url(counted.url)
        queue = Queue(f"flush-{first}", connection=connection)
        for n in range(first, first + 5):
            queue.enqueue("tests.jobs.locked_noop", n)
        counted.take_flights()
        started = time.monotonic()
        worker_class([queue], connection=connection).work(burst=True)
        took = time.monotonic() - started
        flights, _ = counted.take_flights()
        releases = [f for f in flights if f.count("EVALSHA") >= 3 and "EVAL" not in f]
        assert len(releases) == 5, flights
        # The release, the outcome's meta, the run history; and the metrics' flush, if any.
        flushed = sum(f.count("EVALSHA") == 4 for f in releases)
        return flushed, took, metrics.totals().total("acquired")

    _drain(counted, False, "tests.jobs.locked_noop", 0)  # scripts loaded, pools warm
    metrics.flush_now()
    before = metrics.totals().total("acquired")
    per_job, _, after_rq = flushes_in_releases(SimpleWorker, 10)
    assert (per_job, after_rq) == (5, before + 5), "RQ's SimpleWorker: a flush per release"
    when_due, took, after_ours = flushes_in_releases(JoblockSimpleWorker, 20)
    at_most = min(4, 1 + int(took / metrics.FLUSH_INTERVAL))  # one a second (a busy machine)
    assert when_due <= at_most, f"{when_due} of 5 releases carried a flush in {took:.1f}s"
    assert after_ours == after_rq + 5, "every count is in Redis once the worker's work() ended"


@pytest.mark.slow
@pytest.mark.parametrize("simple", [False, True], ids=["Worker", "SimpleWorker"])
def test_a_body_whose_first_query_is_select_for_update_runs_in_the_jobs_transaction(
    workers, simple
):
    """Django refuses ``select_for_update()`` outside a transaction, and checks before the query
    is sent: in a work horse (no connection open) the job's transaction must have begun by then.
    It began at the first query, after the check, and every run failed."""
    Account.objects.create(name="row", balance=0)
    workers.start(simple=simple)
    added = [jobs.add_to_locked_row.delay("row", 1) for _ in range(3)]
    assert sorted(_results(added, workers)) == [1, 2, 3]  # type: ignore[type-var]
    assert Account.objects.get(name="row").balance == 3
