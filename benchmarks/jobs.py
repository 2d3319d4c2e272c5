"""No-op job throughput: plain RQ against ``@locked_job``, on SimpleWorker and forking Worker.

    python benchmarks/jobs.py [--jobs N] [--fork-jobs N] [--rounds R]

Each round enqueues N no-op jobs of one kind and times a burst worker draining them, for each
kind in turn (interleaved, so machine noise hits all alike); figures are medians over rounds
and ratios are medians of per-round ratios against plain RQ. Every job gets its own resource
and idempotency key (no contention: this measures the overhead of the safe flow itself).
Redis: a private redis-server when the binary is on PATH (else ``REDIS_URL``); database: a
throwaway SQLite file, migrated.
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


def setup(url: str, db_path: str) -> None:
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_joblock"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": db_path}},
        CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}},
        USE_TZ=True,
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def drain(queue: Any, worker_class: Any, n: int, enqueue: Callable[[int], Any]) -> float:
    for i in range(n):
        enqueue(i)
    worker = worker_class([queue], connection=queue.connection)
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
    args = parser.parse_args()
    url, proc = private_redis()
    db = tempfile.NamedTemporaryFile(suffix=".sqlite3", delete=False)
    try:
        setup(url, db.name)
        logging.getLogger("rq").setLevel(logging.WARNING)
        from bench_jobs import lock_and_idempotency, lock_only, plain

        from django_joblock.queues import get_queue
        from django_joblock.worker import JoblockSimpleWorker, JoblockWorker

        queue = get_queue("bench")
        kinds: dict[str, Callable[[str], Callable[[int], Any]]] = {
            "plain RQ": lambda run: lambda i: queue.enqueue(plain, i),
            "@locked_job (lock)": lambda run: lambda i: lock_only.delay(i),
            "@locked_job (lock + idempotency)": lambda run: (
                lambda i: lock_and_idempotency.delay(i, run)
            ),
        }
        print(
            f"Python {sys.version.split()[0]}; {args.rounds} interleaved rounds; jobs/s is "
            "the median, ratios are medians of per-round ratios to plain RQ\n"
        )
        header = f"{'worker':13} {'job':34} {'jobs/s':>8} {'vs plain':>9}"
        print(header)
        print("-" * len(header))
        for label, worker_class, n in (
            ("SimpleWorker", JoblockSimpleWorker, args.jobs),
            ("Worker (fork)", JoblockWorker, args.fork_jobs),
        ):
            rates: dict[str, list[float]] = {kind: [] for kind in kinds}
            drain(queue, worker_class, 20, kinds["plain RQ"]("warm"))
            for round_no in range(args.rounds):
                for kind, make in kinds.items():
                    rates[kind].append(
                        drain(queue, worker_class, n, make(f"{label}{round_no}{os.getpid()}"))
                    )
            for kind, values in rates.items():
                ratio = statistics.median(
                    a / b for a, b in zip(values, rates["plain RQ"], strict=True)
                )
                print(f"{label:13} {kind:34} {statistics.median(values):8.0f} {ratio:8.2f}x")
    finally:
        if proc is not None:
            proc.kill()
        os.unlink(db.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
