"""``.delay()`` inside ``transaction.atomic()`` enqueues when the transaction commits: a worker
never runs the job before the rows it reads are visible, and a rollback enqueues nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.db import transaction
from rq import Worker
from rq.job import JobStatus

from django_joblock import locked_job
from django_joblock.jobs.queues import get_queue
from tests import jobs
from tests.harness import wait_for
from tests.testapp.models import Account
from tests.workers import DONE, Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def crew(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


@pytest.mark.slow
@pytest.mark.parametrize("on_commit", [True, False], ids=["on commit", "negative control: at once"])
def test_a_worker_racing_the_commit_finds_the_row(on_commit, crew, rconn):
    """The job is delayed in the transaction that creates its account, and the commit comes
    4 s later while a worker waits for work. Enqueued at once (``on_commit=False``), the job
    runs first and fails with Account.DoesNotExist; on commit, it runs after the commit."""
    crew.start("default")
    assert wait_for(lambda: len(Worker.all(connection=rconn)) == 1, 30), crew.logs()
    queue = get_queue("default")
    with transaction.atomic():
        Account.objects.create(name="fresh", balance=0)
        if on_commit:
            job = jobs.credit.delay("fresh", "C-1", 5)
            assert queue.count == 0, "not before the commit"
        else:
            job = jobs.read_account_at_once.delay("fresh")
        time.sleep(4.0)  # the waiting worker runs it meanwhile, on a busy machine too
    status = wait_status(job, DONE, 30, crew)
    if not on_commit:
        assert status is JobStatus.FAILED, crew.logs()
        assert "DoesNotExist" in str(job.latest_result().exc_string)
        return
    assert status is JobStatus.FINISHED, crew.logs()
    assert Account.objects.get(name="fresh").balance == 5


def test_a_rollback_enqueues_nothing(rconn):
    queue = get_queue("default")
    with pytest.raises(RuntimeError), transaction.atomic():
        job = jobs.credit.delay("gone", "C-2", 5)
        raise RuntimeError("the view failed")
    assert queue.count == 0 and rconn.exists(job.key) == 0


def test_outside_a_transaction_and_with_on_commit_false_it_enqueues_at_once(rconn):
    @locked_job("default", lock="account:{name}", on_commit=False)
    def at_once(name: str) -> None: ...

    queue = get_queue("default")
    first = jobs.credit.delay("a", "C-3", 1)  # no transaction: enqueued at once
    assert queue.get_job_ids() == [first.id]
    with transaction.atomic():
        second = at_once.delay("b")
        assert queue.get_job_ids() == [first.id, second.id], "opted out"
    with pytest.raises(ValueError, match="on_commit must be True or False"):
        locked_job("default", lock="x", on_commit="yes")  # type: ignore[arg-type]


def test_the_handle_is_the_job_once_committed(rconn):
    with transaction.atomic():
        handle = jobs.credit.delay("c", "C-4", 1)
        nested = transaction.atomic()
        with nested:  # a savepoint: still the outer commit that enqueues
            inner = jobs.credit.delay("d", "C-5", 1)
        assert get_queue("default").count == 0
    assert get_queue("default").get_job_ids() == [handle.id, inner.id]
    assert handle.get_status(refresh=True) == JobStatus.QUEUED


def test_a_failed_enqueue_at_the_commit_loses_no_other_job(rconn, caplog):
    """Regression (review): the enqueue at the commit raised out of the ``atomic()`` block (a
    ``dedupe`` key delayed twice in it with other arguments: IdempotencyKeyMismatch; a Redis
    error), and Django dropped the commit's later callbacks: a valid job delayed after it in
    the same transaction was never enqueued. Now the failure is logged and the others go."""
    from tests import admission_jobs

    queue = get_queue("default")
    with transaction.atomic():
        first = admission_jobs.send_once.delay(18, "twice")
        admission_jobs.send_once.delay(19, "twice")  # same key, other arguments
        other = jobs.credit.delay("e", "C-6", 1)
    assert queue.get_job_ids() == [first.id, other.id], "the valid jobs are enqueued"
    failed = [r for r in caplog.records if "not enqueued at the commit" in r.getMessage()]
    assert len(failed) == 1 and "IdempotencyKeyMismatch" in failed[0].getMessage()


def test_the_job_gets_its_arguments_as_they_were_at_the_call(rconn):
    """Review bug: a job sent at the commit kept the caller's own dict, and RQ serialized it only
    then. A caller that changed the dict before the commit had its job run on another account
    (and idempotency key) than the ones its resource, admission and job meta were planned with.
    An argument the serializer refuses now fails in the caller, as at once."""
    queue = get_queue("default")
    with transaction.atomic():
        kwargs = {"name": "f", "credit_id": "C-7", "amount": 1}
        handle = jobs.credit.enqueue_call(kwargs=kwargs)
        kwargs["name"] = "g"  # reused before the commit
        with pytest.raises(Exception, match="pickle"):
            jobs.credit.enqueue_call(kwargs={"name": "h", "credit_id": "C-8", "amount": lambda: 1})
    job = queue.fetch_job(handle.id)
    assert job is not None and job.kwargs["name"] == "f", job.kwargs
    assert job.meta["joblock"]["resource"] == "account:f"
    assert queue.get_job_ids() == [handle.id], "the refused call enqueued nothing"
