"""Jobs for benchmarks/jobs.py and benchmarks/hot_key.py (RQ refuses functions defined in
``__main__``)."""

from __future__ import annotations

import time

from django_joblock import locked_job


def plain(i: int) -> int:
    return i


@locked_job("bench", lock="bench:{i}")
def lock_only(i: int) -> int:
    return i


@locked_job("bench", lock="bench:{i}", idempotency_key="bench:{run}:{i}")
def lock_and_idempotency(i: int, run: str) -> int:
    return i


def _update(row: int) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("UPDATE bench_row SET n = n + 1 WHERE id = %s", [row])


def plain_update(row: int) -> int:
    """One UPDATE, committed on its own (autocommit)."""
    _update(row)
    return row


@locked_job("bench", lock="bench:{i}", idempotency_key="bench:{run}:{i}")
def lock_and_idempotency_update(row: int, run: str, i: int) -> int:
    """The same UPDATE, committed with the claim and the success record."""
    _update(row)
    return row


@locked_job("bench", lock="bench:{i}", idempotency_key="bench:{run}:{i}", admission=False)
def lock_and_idempotency_update_unparked(row: int, run: str, i: int) -> int:
    """The same, enqueued without admission (RQ's RateLimit slot bookkeeping, which the floor
    does not do either)."""
    _update(row)
    return row


# -- benchmarks/hot_key.py: jobs of D ms on a few hot resources -------------------------------
def _work(ms: float) -> tuple[float, float]:
    started = time.time()
    time.sleep(ms / 1000)
    return started, time.time()


def hot_plain(k: int, ms: float, tag: str) -> tuple[float, float]:
    """Plain RQ (enqueued with RQ's own RateLimit(concurrency=1) by the benchmark)."""
    return _work(ms)


@locked_job("hot", lock="hot:{k}")
def hot_locked(k: int, ms: float, tag: str) -> tuple[float, float]:
    """@locked_job as a new user writes it: admission (the default)."""
    return _work(ms)


@locked_job("hot", lock="quota:{k}", concurrency=3)
def hot_limited(k: int, ms: float, tag: str) -> tuple[float, float]:
    """@locked_job with three runs per resource at once (admission: RateLimit(concurrency=3))."""
    return _work(ms)


@locked_job("hot", lock="hot:{k}", admission=False)
def hot_requeue(k: int, ms: float, tag: str) -> tuple[float, float]:
    """@locked_job on the requeue-only path (rq 2.x, or admission=False)."""
    return _work(ms)


# -- benchmarks/jobs.py: the floor of the safe flow's I/O, written by hand -------------------
def floor_update(row: int, run: str, i: int) -> int:
    """What any lock + idempotency + one-commit flow must send, and nothing else: ``SET NX PX``
    (acquire), ``BEGIN``, one guard-and-read statement, the same ``UPDATE``, the record's
    ``INSERT``, ``COMMIT``, the compare-and-delete of ``benchmarks/locks.py``'s floor
    (release, by ``EVALSHA``). No fence, heartbeat, metrics, timeline or error handling: not
    a usable job, a ceiling for one."""
    import secrets

    from django.db import connection, transaction
    from locks import RELEASE  # benchmarks/ is on the path of jobs.py and its workers
    from rq import get_current_job

    redis = get_current_job().connection
    key, token = f"floor:{i}", secrets.token_hex(16)
    if not redis.set(key, token, nx=True, px=30_000):
        raise RuntimeError("floor: resource busy")
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_try_advisory_xact_lock(hashtextextended(%s, 0)), "
                "(SELECT 1 FROM bench_record WHERE key = %s)",
                [key, f"{run}:{i}"],
            )
            cursor.execute("UPDATE bench_row SET n = n + 1 WHERE id = %s", [row])
            cursor.execute(
                "INSERT INTO bench_record (key, result) VALUES (%s, %s)", [f"{run}:{i}", row]
            )
    finally:
        redis.register_script(RELEASE)(keys=[key], args=[token])
    return row
