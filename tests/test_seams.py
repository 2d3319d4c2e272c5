"""Idempotency records, results, keys, transactions and outcomes,
on the real database (PostgreSQL with DATABASE_URL, else SQLite) and real RQ workers."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.utils import timezone
from rq.job import JobStatus

from django_joblock import (
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyRecord,
    idempotent,
    lock,
    locked_job,
)
from django_joblock.jobs.queues import get_queue
from tests import seam_jobs
from tests.harness import expire_now, wait_for
from tests.testapp.models import Account
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 1, "max": 1}}
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


def _purge() -> str:
    out = StringIO()
    call_command("joblock_purge", stdout=out)
    return out.getvalue()


# -- item 4: a running claim with a live lease is never purged ------------------------------
def test_taken_over_record_is_not_purged_while_its_claim_runs():
    with pytest.raises(RuntimeError), idempotent("refund:R-4"):
        raise RuntimeError("first attempt failed")
    # The failed record is old: it expired long ago.
    long_ago = timezone.now() - timedelta(days=30)
    IdempotencyRecord.objects.filter(key="refund:R-4").update(
        created_at=long_ago, updated_at=long_ago, expires_at=long_ago + timedelta(days=7)
    )
    running = idempotent("refund:R-4", lease=300).__enter__()  # a retry takes it over
    assert running.attempts == 2 and not running.done
    _purge()
    record = IdempotencyRecord.objects.get(key="refund:R-4")
    assert record.status == "running" and record.expires_at > timezone.now()
    with pytest.raises(IdempotencyInProgress):
        idempotent("refund:R-4").__enter__()  # a duplicate must not start alongside it


def test_purge_keeps_a_live_claim_whatever_its_expiry(settings):
    settings.JOBLOCK = {"IDEMPOTENCY_TTL": 60, "IDEMPOTENCY_LEASE": 600, "REQUEUE_MAX_WAIT": 10}
    idempotent("refund:R-5").__enter__()  # running, lease 600 s, expires after 60 s
    IdempotencyRecord.objects.filter(key="refund:R-5").update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert "Deleted 0 expired" in _purge()
    assert IdempotencyRecord.objects.filter(key="refund:R-5").exists()
    # Negative control: once its lease ends, the expired record goes.
    IdempotencyRecord.objects.filter(key="refund:R-5").update(
        lease_expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert "Deleted 1 expired" in _purge()


# -- item 5: results that are not plain JSON ------------------------------------------------
def test_decimal_datetime_uuid_results_are_stored_and_replayed_as_strings(rconn):
    first = seam_jobs.rich_result(1)
    assert first["amount"].__class__.__name__ == "Decimal", "the first run returns its value"
    replay = seam_jobs.rich_result(1)
    expected = {
        "amount": "10.50",
        "at": "2024-05-01T12:00:00Z",
        "id": "00000000-0000-0000-0000-000000000001",
    }
    assert replay == expected
    record = IdempotencyRecord.objects.get(key="rich:1")
    assert record.status == "succeeded" and record.result == expected


def _nested(depth: int) -> list[Any]:
    outer: list[Any] = []
    inner = outer
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


# "\udc00": a lone surrogate (a str that is not UTF-8, e.g. from surrogateescape), which
# PostgreSQL refuses: a raw DataError from succeed() before (review); _nested(5000): JSON's
# encoder raised RecursionError out of succeed() (review).
@pytest.mark.parametrize(
    "bad",
    [
        math.nan,
        math.inf,
        object(),
        "a\x00b",
        ["x", {"y": "\x00"}],
        "a\udc00",
        {"\ud800": 1},
        _nested(5000),
    ],
)
def test_results_the_database_cannot_store_fail_clearly(bad):
    with pytest.raises(IdempotencyError, match="cannot be stored as JSON"):
        with idempotent(f"bad:{type(bad).__name__}") as claim:  # (a deep list has no repr)
            claim.succeed({"value": bad})
    assert IdempotencyRecord.objects.get().status == "failed"


# -- item 6: keys and scopes are validated at enqueue ---------------------------------------
@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("k" * 256, "1 to 255 characters"),
        ("a\x00b", "NUL"),
        ("", "1 to 255 characters"),
        ("a\udc00", "lone surrogate"),  # a UnicodeEncodeError in the worker before (review)
    ],
)
def test_bad_idempotency_key_fails_at_delay_not_in_the_worker(scratch_registry, key, message):
    @locked_job("default", idempotency_key="{key}")
    def keyed(key: str) -> None: ...

    queue = get_queue("default")
    with pytest.raises(ValueError, match=message):
        keyed.delay(key)
    assert queue.count == 0, "nothing may be enqueued after a bad key"
    keyed.delay("fine")
    assert queue.count == 1, "negative control: a good key is enqueued"


def test_scope_too_long_for_the_column_fails_at_decoration(scratch_registry):
    def make() -> object:
        def job(a: int) -> None: ...

        job.__qualname__ = "J" * 120
        return locked_job("default", idempotency_key="k:{a}")(job)

    with pytest.raises(ValueError, match="scope must be at most 100"):
        make()


# -- item 7: lock-only jobs run in a transaction --------------------------------------------
@pytest.mark.slow
def test_lock_only_job_that_loses_its_lock_leaves_no_write(workers, rconn):
    workers.start()
    job = seam_jobs.write_then_wait.delay(7)
    assert wait_for(lambda: rconn.get("test:pid:seam7"), 30), workers.logs()
    expire_now(rconn, "joblock:{seam:7}:lock")  # the lock is lost mid-job
    assert wait_status(job, DONE, 30) is JobStatus.FAILED, workers.logs()
    assert "LockLost" in (job.latest_result().exc_string or "")
    assert not Account.objects.filter(name="seam-7").exists(), "the write must roll back"
    # Negative control: the same job keeps its write when its lock stays.
    kept = seam_jobs.write_then_wait.delay(8)
    assert wait_for(lambda: rconn.get("test:pid:seam8"), 30), workers.logs()
    rconn.set("test:go:seam8", 1)
    assert wait_status(kept, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert Account.objects.filter(name="seam-8").exists()


# -- item 11: an outcome for every run ------------------------------------------------------
def _outcome(job) -> str | None:  # type: ignore[no-untyped-def]
    return job.get_meta(refresh=True).get("joblock", {}).get("outcome")


@pytest.mark.slow
def test_every_outcome_is_recorded_in_job_meta(workers, rconn):
    workers.start(scheduler=True)
    ran = seam_jobs.plain.delay(1)
    first = seam_jobs.plain_once.delay(2)
    assert wait_status(ran, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    again = seam_jobs.plain_once.delay(2)
    broken = seam_jobs.raises.delay(3)
    assert wait_status(again, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(broken, DONE, 30) is JobStatus.FAILED, workers.logs()
    with lock("plain:9", ttl=60):
        skipped = seam_jobs.plain_or_skip.delay(9)
        failed = seam_jobs.plain_or_fail.delay(9)
        gave_up = seam_jobs.plain_short_wait.delay(9)
        waiting = seam_jobs.plain.delay(9)
        for job in (skipped, failed, gave_up):
            wait_status(job, DONE, 60)
        assert wait_for(lambda: _outcome(waiting) == "requeued", 30), workers.logs()
    assert wait_status(waiting, DONE, 60) is JobStatus.FINISHED, workers.logs()
    seen = {
        "ran": _outcome(ran),
        "ran once": _outcome(first),
        "replayed": _outcome(again),
        "raised": _outcome(broken),
        "skipped": _outcome(skipped),
        "fail policy": _outcome(failed),
        "gave up": _outcome(gave_up),
        "ran after requeues": _outcome(waiting),
    }
    assert seen == {
        "ran": "ran",
        "ran once": "ran",
        "replayed": "replayed",
        "raised": "failed",
        "skipped": "skipped",
        "fail policy": "failed",
        "gave up": "gave_up",
        "ran after requeues": "ran",
    }, workers.logs()
    assert "LockNotAcquired" in failed.get_meta()["joblock"]["reason"]
    assert "RuntimeError: job 3 broke" in broken.get_meta()["joblock"]["reason"]
    assert "reason" not in waiting.get_meta()["joblock"], "no stale busy reason after it ran"
    assert waiting.get_meta()["joblock"]["requeues"] >= 1


# -- item 4 (per-call timeouts) -------------------------------------------------------------
def test_per_call_job_timeout_is_checked_at_enqueue(scratch_registry, caplog):
    @locked_job("default", lock="x:{a}", ttl=30, heartbeat=False)
    def unrenewed(a: int) -> None: ...

    @locked_job("default", idempotency_key="k:{a}")
    def claim_only(a: int) -> None: ...

    with caplog.at_level(logging.WARNING, logger="django_joblock"):
        unrenewed.enqueue_call((1,), job_timeout=600)
        claim_only.enqueue_call((1,), job_timeout="1h")
        unrenewed.enqueue_call((2,), job_timeout=10)  # negative control: shorter than the TTL
        claim_only.enqueue_call((2,), job_timeout=60)  # and shorter than the lease
    found = [r.getMessage() for r in caplog.records if "[django_joblock.W00" in r.getMessage()]
    assert len(found) == 2, found
    assert "[django_joblock.W002]" in found[0] and "unrenewed" in found[0]
    assert "[django_joblock.W006]" in found[1] and "3600s" in found[1]
    assert json.dumps(found)  # plain text, no objects


def test_atomic_false_is_refused_for_a_job_with_an_idempotency_key(scratch_registry):
    with pytest.raises(ValueError, match="atomic=False is only for jobs without"):
        locked_job("default", lock="x:{a}", idempotency_key="k:{a}", atomic=False)


# -- item 9: queue names unknown to django-rq fail loudly ----------------------------------
def test_queue_missing_from_rq_queues_fails_loudly_with_the_known_names(scratch_registry, rconn):
    from django.core.management.base import CommandError

    from django_joblock import JoblockConfigError

    @locked_job("low", lock="low:{a}")
    def on_low(a: int) -> None: ...

    with pytest.raises(JoblockConfigError, match=r"'low' is not in settings\.RQ_QUEUES"):
        on_low.delay(1)
    with pytest.raises(
        CommandError, match=r"'low' is not in settings\.RQ_QUEUES \(known: default, other\)"
    ):
        call_command("joblock_worker", "low", "--burst")
    assert not rconn.exists("rq:queue:low"), "nothing went to a queue on the cache Redis"
    # Negative control: a known queue runs (a burst worker on an empty queue just returns).
    call_command("joblock_worker", "default", "--burst", "--simple")


def test_one_worker_cannot_serve_queues_on_two_connections(settings):
    from django.core.management.base import CommandError

    settings.RQ_QUEUES = {
        "default": {"USE_REDIS_CACHE": "default"},
        "elsewhere": {"URL": "redis://127.0.0.1:1/3"},
    }
    with pytest.raises(CommandError, match="different Redis connections"):
        call_command("joblock_worker", "default", "elsewhere", "--burst")
