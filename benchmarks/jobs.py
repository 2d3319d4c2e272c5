"""Job throughput: plain RQ against ``@locked_job``, on SimpleWorker and forking Worker.

    python benchmarks/jobs.py [--jobs N] [--fork-jobs N] [--rounds R] [--database-url URL]

Bodies: a no-op, and one ``UPDATE`` of a row (its own row per job, committed: the smallest job
that writes). Contenders per body: plain RQ, ``@locked_job`` with a lock, and with a lock and
an idempotency key (for the ``UPDATE`` body: its claim, effect and success record commit in
one transaction, docs/jobs.md). Each round enqueues N jobs of one kind and times a burst worker
draining them, for each kind in turn (interleaved, so machine noise hits all alike); jobs/s is
the median over rounds and ratios are medians of per-round ratios against plain RQ with the
same body. Every job has its own resource and idempotency key (no contention: this measures the
overhead of the safe flow itself).

The ``floor`` row (PostgreSQL) is a job written by hand that sends only the I/O any lock +
idempotency + one-commit flow needs (``SET NX PX``; ``BEGIN``, a guard-and-read statement, the
same ``UPDATE``, the record's ``INSERT``, ``COMMIT``; a compare-and-delete), with no fence,
heartbeat, metrics, timeline or error handling: the ceiling for *any* implementation of that
flow on this machine. The last line prints ``@locked_job`` against it.

Redis: a private redis-server when the binary is on PATH (else ``REDIS_URL``); database: a
throwaway PostgreSQL database next to ``--database-url`` (default ``DATABASE_URL``, else
postgres://postgres@127.0.0.1:5432/postgres), or a throwaway SQLite file with
``--database-url sqlite``.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from locks import private_redis

ROWS = 1000
FLOOR = "UPDATE: floor (hand-written, I/O only)"
OURS = "UPDATE: @locked_job (lock + idempotency)"
UNPARKED = "UPDATE: ... with admission=False"


def database(url: str) -> tuple[dict[str, Any], Callable[[], None]]:
    """A throwaway database: its Django settings and a function that drops it."""
    if url == "sqlite":
        db = tempfile.NamedTemporaryFile(suffix=".sqlite3", delete=False)
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": db.name}, lambda: os.unlink(db.name)
    import dj_database_url
    import psycopg

    base = dj_database_url.parse(url)
    name = f"joblock_bench_{os.getpid()}"
    admin = psycopg.connect(
        host=base["HOST"],
        port=base["PORT"] or 5432,
        user=base["USER"],
        dbname=base["NAME"],
        autocommit=True,
    )
    admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        from django.db import connections

        connections.close_all()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()

    return {**base, "NAME": name}, drop


def setup(url: str, db: dict[str, Any], *, create: bool = True) -> None:
    """Django for the benchmark on Redis ``url`` and database ``db``; with ``create``, the
    database migrated and the benchmark's tables made (once, by the process that drives)."""
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_joblock"],
        # Workers keep their database connection between jobs (persistent connections): with
        # Django's default CONN_MAX_AGE=0 every job that touches the database reconnects.
        DATABASES={"default": {**db, "CONN_MAX_AGE": 600}},
        CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}},
        USE_TZ=True,
        SECRET_KEY="bench",  # migrate claims KEY_PREFIX with it (W016)
    )
    django.setup()
    if not create:
        return
    from django.core.management import call_command
    from django.db import connection

    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE bench_row (id integer PRIMARY KEY, n bigint NOT NULL)")
        cursor.executemany("INSERT INTO bench_row VALUES (%s, 0)", [(i,) for i in range(ROWS)])
        cursor.execute("CREATE TABLE bench_record (key text PRIMARY KEY, result bigint)")


def job_kinds(queue: Any, *, floor: bool) -> dict[str, Callable[[str], Callable[[int], Any]]]:
    """Kind of job -> for a run's tag, a function enqueueing the kind's i-th job on ``queue``
    (each with a resource and key of its own); the floor only with ``floor`` (its guard
    statement is PostgreSQL's)."""
    from bench_jobs import (
        floor_update,
        lock_and_idempotency,
        lock_and_idempotency_update,
        lock_and_idempotency_update_unparked,
        lock_only,
        plain,
        plain_update,
    )

    kinds: dict[str, Callable[[str], Callable[[int], Any]]] = {
        "no-op: plain RQ": lambda run: lambda i: queue.enqueue(plain, i),
        "no-op: @locked_job (lock)": lambda run: lambda i: lock_only.delay(i),
        "no-op: @locked_job (lock + idempotency)": lambda run: (
            lambda i: lock_and_idempotency.delay(i, run)
        ),
        "UPDATE: plain RQ": lambda run: lambda i: queue.enqueue(plain_update, i % ROWS),
        OURS: lambda run: lambda i: lock_and_idempotency_update.delay(i % ROWS, run, i),
        UNPARKED: lambda run: (
            lambda i: lock_and_idempotency_update_unparked.delay(i % ROWS, run, i)
        ),
    }
    if floor:
        kinds[FLOOR] = lambda run: lambda i: queue.enqueue(floor_update, i % ROWS, run, i)
    return kinds


def drain(queue: Any, worker_class: Any, n: int, enqueue: Callable[[int], Any]) -> float:
    from rq.utils import now

    for i in range(n):
        enqueue(i)
    worker = worker_class([queue], connection=queue.connection)
    # A long-lived worker runs RQ's maintenance once a minute; a burst worker would run it at
    # its start, once per batch, and with admission that walks the rate-limit keys of every
    # job of the batch still queued (RQ's per-key clean-up): a per-batch artifact, not a
    # per-job cost. Every contender skips it alike.
    worker.last_cleaned_at = now()
    started = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING")
    elapsed = time.perf_counter() - started
    if queue.count or len(queue.failed_job_registry):
        raise SystemExit(f"jobs left or failed: {queue.count}, {len(queue.failed_job_registry)}")
    return n / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=400, help="jobs per round, SimpleWorker")
    parser.add_argument("--fork-jobs", type=int, default=100, help="jobs per round, Worker")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres",
        help="a PostgreSQL server to create a throwaway database on, or 'sqlite'",
    )
    args = parser.parse_args()
    url, server = private_redis()
    db, drop = database(args.database_url)
    try:
        setup(url, db)
        logging.getLogger("rq").setLevel(logging.WARNING)
        from django.db import connection

        from django_joblock.jobs.queues import get_queue
        from django_joblock.worker import JoblockSimpleWorker, JoblockWorker

        queue = get_queue("bench")
        kinds = job_kinds(queue, floor=connection.vendor == "postgresql")
        print(
            f"Python {sys.version.split()[0]}; database {connection.vendor}; {args.rounds} "
            "interleaved rounds; jobs/s is the median, ratios are medians of per-round ratios "
            "to plain RQ with the same body\n"
        )
        header = f"{'worker':13} {'job':42} {'jobs/s':>8} {'vs plain':>9}"
        print(header)
        print("-" * len(header))
        floor_notes = []
        for label, worker_class, n in (
            ("SimpleWorker", JoblockSimpleWorker, args.jobs),
            ("Worker (fork)", JoblockWorker, args.fork_jobs),
        ):
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            drain(queue, worker_class, 20, kinds["no-op: plain RQ"]("warm"))
            for round_no in range(args.rounds):
                for kind, make in kinds.items():
                    rates[kind].append(
                        drain(queue, worker_class, n, make(f"{label}{round_no}{os.getpid()}"))
                    )
            for kind, values in rates.items():
                plain_kind = kind.split(":", 1)[0] + ": plain RQ"
                ratio = statistics.median(
                    a / b for a, b in zip(values, rates[plain_kind], strict=True)
                )
                print(f"{label:13} {kind:42} {statistics.median(values):8.0f} {ratio:8.2f}x")
            if FLOOR in rates:
                of_floor = [
                    statistics.median(a / b for a, b in zip(rates[k], rates[FLOOR], strict=True))
                    for k in (OURS, UNPARKED)
                ]
                note = f"{label}: {of_floor[0]:.2f}x of the floor"
                floor_notes.append(f"{note} ({of_floor[1]:.2f}x without admission)")
        if floor_notes:
            print(f"\n{OURS.split(': ', 1)[1]} against the floor: " + "; ".join(floor_notes))
    finally:
        drop()
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
