"""@locked_job: decoration-time and enqueue-time errors, inline calls, and its checks."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from django.test import override_settings
from rq import Queue

from django_joblock import (
    IdempotencyRecord,
    InvalidResource,
    JoblockConfigError,
    LockNotAcquired,
    current_lock,
    lock,
    locked_job,
)
from django_joblock.checks import check_jobs, check_scheduler
from django_joblock.jobs import admission
from django_joblock.jobs.queues import get_queue
from tests import jobs
from tests.workers import Workers

pytestmark = pytest.mark.django_db(transaction=True)


def test_unknown_template_field_fails_at_decoration():
    with pytest.raises(ValueError, match="order_idd"):

        @locked_job("default", lock="order:{order_idd}")
        def refund(order_id: int) -> None: ...


def test_positional_template_field_is_refused():
    with pytest.raises(ValueError, match="positional"):

        @locked_job("default", lock="order:{0}")
        def refund(order_id: int) -> None: ...


def test_async_generators_are_refused_at_decoration():
    """RQ stores a job's return value: a generator's values would be lost. (``async def`` jobs
    are run: tests/test_async_jobs.py.)"""
    with pytest.raises(TypeError, match="an async generator is not a job"):

        @locked_job("default", lock="order:{order_id}")
        async def refund(order_id: int) -> AsyncIterator[int]:
            yield order_id


def test_bad_options_fail_at_decoration():
    with pytest.raises(ValueError, match="on_conflict"):
        locked_job("default", lock="x", on_conflict="retry")
    with pytest.raises(ValueError, match="ttl"):
        locked_job("default", lock="x", ttl=0)
    with pytest.raises(ValueError, match="lock resource, an idempotency_key"):
        locked_job("default")


def test_bad_arguments_fail_at_enqueue_not_in_the_worker(scratch_registry, rconn):
    @locked_job("default", lock="order:{order_id}")
    def refund(order_id: str) -> None: ...

    queue = get_queue("default")
    with pytest.raises(InvalidResource, match="order:1 2"):
        refund.delay("1 2")
    with pytest.raises(TypeError, match="order_id"):
        refund.delay()  # type: ignore[call-arg]
    assert queue.count == 0, "nothing may be enqueued after a bad call"


def test_delay_enqueues_with_metadata_and_rq_options(scratch_registry, rconn):
    @locked_job(
        "default", lock="order:{order_id}", idempotency_key="refund:{refund_id}", result_ttl=77
    )
    def refund(order_id: int, refund_id: str, description: str = "") -> None: ...

    job = refund.delay(1, "R-1", description="not an RQ option here")
    assert job.func_name == f"{__name__}.{refund.__qualname__}"
    assert job.args == (1, "R-1")
    assert job.kwargs == {"description": "not an RQ option here"}
    assert job.meta["joblock"] == {
        "resource": "order:1",
        "idempotency_key": "refund:R-1",
        "admission": "rate_limit" if admission.supported() else "requeue_only",
    }
    assert job.result_ttl == 77
    assert refund.enqueue_call((2, "R-2"), job_timeout=9).timeout == 9


def test_inline_call_runs_under_lock_and_idempotency(scratch_registry, rconn):
    seen = []

    @locked_job("default", lock="order:{order_id}", idempotency_key="refund:{refund_id}")
    def refund(order_id: int, refund_id: str) -> dict:
        held = current_lock()
        assert held is not None and held.resource == f"order:{order_id}"
        seen.append(held.fence)
        return {"refund": refund_id}

    assert refund(1, "R-1") == {"refund": "R-1"}
    assert refund(1, "R-1") == {"refund": "R-1"}, "second call replays"
    assert len(seen) == 1
    record = IdempotencyRecord.objects.get(key="refund:R-1")
    assert record.fence == seen[0] and record.lock_resource == "order:1"
    assert not rconn.exists("joblock:{order:1}:lock"), "released after the call"


def test_scope_keeps_the_records_across_a_rename(scratch_registry, rconn):
    """The records' scope was the function's dotted name: renaming or moving a job applied its
    effects again. ``scope=`` keeps the records' scope across a rename."""
    applied = []

    def refund(refund_id: str) -> str:
        applied.append(refund_id)
        return "done"

    def renamed(refund_id: str) -> str:
        return refund(refund_id)

    first = locked_job("default", idempotency_key="refund:{refund_id}", scope="shop.refund")
    second = locked_job("default", idempotency_key="refund:{refund_id}", scope="shop.refund")
    assert first(refund)("R-1") == "done"
    assert second(renamed)("R-1") == "done", "replayed"
    assert applied == ["R-1"]
    assert IdempotencyRecord.objects.get(key="refund:R-1").scope == "shop.refund"
    unscoped = locked_job("default", idempotency_key="refund:{refund_id}")
    unscoped(renamed)("R-1")
    assert applied == ["R-1", "R-1"], "negative control: without scope=, applied again"
    with pytest.raises(ValueError, match=r"scope= names the scope.*needs an idempotency_key"):
        locked_job("default", lock="r:{refund_id}", scope="shop.refund")
    with pytest.raises(ValueError, match="scope"):
        locked_job("default", idempotency_key="k:{refund_id}", scope="x" * 300)(refund)


def test_inline_conflict_raises_instead_of_requeueing(scratch_registry, rconn):
    @locked_job("default", lock="order:{order_id}")
    def refund(order_id: int) -> None:
        pytest.fail("must not run while the lock is held")

    with lock("order:5", ttl=5), pytest.raises(LockNotAcquired, match="inline"):
        refund(5)


def test_callable_templates(scratch_registry, rconn):
    @locked_job("default", lock=lambda tenant, **_: f"tenant:{tenant.lower()}")
    def rebuild(tenant: str) -> str:
        held = current_lock()
        assert held is not None
        return held.resource

    assert rebuild("ACME") == "tenant:acme"


def test_queue_resolution(settings):
    assert get_queue("default").__class__.__module__.startswith("django_rq")
    with pytest.raises(
        JoblockConfigError, match=r"'not-in-rq-queues' is not in settings\.RQ_QUEUES"
    ):
        get_queue("not-in-rq-queues")
    mine = Queue("mine", connection=get_queue("default").connection)
    assert get_queue(mine) is mine
    with pytest.raises(ValueError, match="queue"):
        get_queue("")
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "django_rq"]
    plain = get_queue("not-in-rq-queues")
    assert type(plain) is Queue and plain.name == "not-in-rq-queues", "without django-rq"


def test_w002_ttl_shorter_than_job_timeout_without_heartbeat(scratch_registry):
    @locked_job("default", lock="x:{a}", ttl=30, heartbeat=False, job_timeout=600)
    def slow(a: int) -> None: ...

    messages = [m for m in check_jobs() if m.id == "django_joblock.W002"]
    assert len(messages) == 1 and "slow" in messages[0].msg

    @locked_job("default", lock="x:{a}", ttl=30, heartbeat=True, job_timeout=600)
    def slow_but_renewed(a: int) -> None: ...

    assert len([m for m in check_jobs() if m.id == "django_joblock.W002"]) == 1


@override_settings(JOBLOCK={"IDEMPOTENCY_TTL": 3600, "REQUEUE_MAX_WAIT": 60})
def test_w004_job_waits_longer_than_records_live(scratch_registry):
    @locked_job("default", lock="x:{a}", idempotency_key="k:{a}", max_wait=7200)
    def late(a: int) -> None: ...

    messages = [m for m in check_jobs() if m.id == "django_joblock.W004"]
    assert [m.msg.split(":")[0] for m in messages] == [late.spec.name]


@pytest.mark.slow
def test_w012_no_scheduler_for_a_requeueing_queue(rconn):
    assert [m.id for m in check_scheduler()] == ["django_joblock.W012"]
    crew = Workers()
    try:
        crew.start(scheduler=True)
        from tests.harness import wait_for

        assert wait_for(lambda: rconn.exists("rq:scheduler-lock:default"), 20), crew.logs()
        assert check_scheduler() == [], "negative control: a scheduler is running now"
    finally:
        crew.stop()


def test_a_retry_that_meets_contention_again_has_its_own_max_wait(rconn):
    """Regression (review): ``max_wait`` counted from the job's first contention ever. A job
    requeued once, run, failed and retried by RQ's ``Retry`` gave up at its retry's first
    busy lock (``gave_up`` without one requeue) once ``max_wait`` had passed since then."""
    import time

    from rq import Retry

    from django_joblock import lock
    from django_joblock.testing import run_jobs

    def outcome() -> str:
        return str(job.get_meta(refresh=True)["joblock"]["outcome"])

    with lock("episode:1", ttl=30):
        job = jobs.fails_once.enqueue(kwargs={"k": 1}, retry=Retry(max=1, interval=[1]))
        run_jobs(max_rounds=1)
        assert outcome() == "requeued"
    time.sleep(2.5)  # longer than max_wait (2 s) since that contention
    run_jobs(max_rounds=1)  # free: it runs, fails, and RQ's Retry brings it back
    assert outcome() == "failed" and int(rconn.get("test:fails_once:1")) == 1
    with lock("episode:1", ttl=30):
        run_jobs(max_rounds=1)
        assert outcome() == "requeued", job.get_meta(refresh=True)["joblock"]
    run_jobs()
    assert outcome() == "ran" and job.return_value(refresh=True) == 2
