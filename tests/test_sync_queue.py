"""Synchronous queues (``Queue(is_async=False)``, django-rq's ``ASYNC: False``, the usual test
setting): there is no worker to requeue to, so a busy resource behaves like an inline call; a
job never "finishes" without running, and no RateLimit is applied (RQ refuses it there)."""

from __future__ import annotations

import pytest
from django.test import override_settings
from rq.job import JobStatus

from django_joblock import lock
from tests import admission_jobs

pytestmark = pytest.mark.django_db(transaction=True)

# django-rq's usual test setting.
SYNC_QUEUES = {
    "default": {"USE_REDIS_CACHE": "default", "ASYNC": False},
    "other": {"USE_REDIS_CACHE": "default"},
}


def _exc(job) -> str:  # type: ignore[no-untyped-def]
    result = job.latest_result()
    return str(getattr(result, "exc_string", "") or "")


def test_contended_job_on_a_synchronous_queue_fails_instead_of_finishing(rconn):
    assert not admission_jobs.SYNC.is_async
    with lock("res:1", ttl=5):
        job = admission_jobs.sync_work.delay(1)
    # Before: FINISHED with a Retry(...) object as its result, and the body never ran.
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert "LockNotAcquired" in _exc(job) and "cannot requeue" in _exc(job)
    state = job.get_meta(refresh=True)["joblock"]
    assert (state["admission"], state["outcome"]) == ("sync", "failed"), state
    assert not getattr(job, "rate_limit_key", None), "no RateLimit on a synchronous queue"
    # The same job, free: it runs.
    again = admission_jobs.sync_work.delay(1)
    assert again.get_status(refresh=True) == JobStatus.FINISHED
    assert again.return_value() == "ran"


def test_skip_policy_on_a_synchronous_queue_still_skips(rconn):
    with lock("res:2", ttl=5):
        job = admission_jobs.sync_skip.delay(2)
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert job.return_value() is None
    assert job.get_meta(refresh=True)["joblock"]["outcome"] == "skipped"


def test_a_synchronous_queue_waits_acquire_wait_like_an_inline_call(rconn, settings):
    import threading

    settings.JOBLOCK = {"ACQUIRE_WAIT": 5}
    held = lock("res:3", ttl=5)
    held.acquire()
    timer = threading.Timer(0.3, held.release)
    timer.start()
    try:
        job = admission_jobs.sync_work.delay(3)
    finally:
        timer.join()
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert job.return_value() == "ran"


@override_settings(RQ_QUEUES=SYNC_QUEUES)
def test_django_rq_async_false_queue(rconn):
    with lock("res:4", ttl=5):
        job = admission_jobs.django_rq_work.delay(4)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert "LockNotAcquired" in _exc(job)
    assert admission_jobs.django_rq_work.delay(4).return_value() == "ran"
