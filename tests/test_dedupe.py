"""``@locked_job(..., dedupe=True)``: a duplicate ``.delay()`` of a live logical job
returns the existing job; after it finished, a new delivery is enqueued and replays."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest
from rq.job import JOB_ID_PATTERN, JobStatus

from django_joblock import IdempotencyKeyMismatch, lock, locked_job, metrics
from django_joblock.jobs import admission
from django_joblock.jobs.decorator import registry
from django_joblock.jobs.dedupe import LIVE, job_id_for
from django_joblock.jobs.queues import get_queue
from tests import admission_jobs
from tests.harness import wait_for
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 2}}
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


def _blocked() -> int:
    return metrics.totals().total("blocked_at_enqueue")


def test_job_id_is_stable_and_in_rqs_characters():
    job_id = job_id_for("shop.jobs.send", "receipt:42")
    assert job_id == job_id_for("shop.jobs.send", "receipt:42")
    assert job_id != job_id_for("shop.jobs.send", "receipt:43")
    assert job_id != job_id_for("shop.jobs.other", "receipt:42"), "scoped by the job's name"
    assert JOB_ID_PATTERN.fullmatch(job_id) and re.fullmatch(r"joblock-[0-9a-f]{40}", job_id)


def test_dedupe_needs_a_key_and_no_job_id():
    with pytest.raises(ValueError, match="dedupe=True needs an idempotency_key"):
        locked_job("default", lock="x", dedupe=True)
    with pytest.raises(ValueError, match="job_id"):
        locked_job("default", idempotency_key="k", dedupe=True, job_id="mine")


def test_the_old_unique_keyword_is_refused_with_its_new_name():
    with pytest.raises(ValueError, match="renamed dedupe="):
        locked_job("default", idempotency_key="k", unique=True)
    with pytest.raises(ValueError, match="job_id='mine'"):
        admission_jobs.send_once.enqueue_call((1, "x"), job_id="mine")


@pytest.mark.slow
def test_duplicates_return_the_live_job_while_queued_waiting_and_running(workers, rconn):
    queue = get_queue("default")
    # Queued (no worker yet).
    first = admission_jobs.send_once.delay(10, "queued")
    again = admission_jobs.send_once.delay(10, "queued")
    assert again.id == first.id == job_id_for(admission_jobs.send_once.spec.name, "send:queued")
    assert queue.count == 1 and _blocked() == 1
    rconn.set("test:go:queued", 1)  # on SQLite its transaction would hold the others back
    workers.start(scheduler=True)
    workers.start()
    # Waiting: another job holds resource 11 (parked by admission; scheduled on rq 2.x).
    holder = admission_jobs.hot_hold.delay(11, "holder")
    assert wait_for(lambda: rconn.get("test:pid:holder"), 60), workers.logs()
    waiting = admission_jobs.send_once.delay(11, "waiting")
    expected = {"rate_limited"} if admission.supported() else {"queued", "scheduled"}
    assert wait_for(lambda: waiting.get_status(refresh=True) in expected, 20)
    assert admission_jobs.send_once.delay(11, "waiting").id == waiting.id
    # Requeued (scheduled): a lock() holder outside admission.
    with lock("hot:13", ttl=10):
        requeued = admission_jobs.send_once.delay(13, "requeued")
        assert wait_status(requeued, {JobStatus.SCHEDULED}, 20), workers.logs()
        assert admission_jobs.send_once.delay(13, "requeued").id == requeued.id
    # Running.
    running = admission_jobs.send_once.delay(12, "running")
    assert wait_for(lambda: b"running" in rconn.lrange("test:sent", 0, -1), 20), workers.logs()
    assert running.get_status(refresh=True) == JobStatus.STARTED
    assert admission_jobs.send_once.delay(12, "running").id == running.id
    assert _blocked() == 4
    for flag in ("queued", "waiting", "requeued", "running", "holder"):
        rconn.set(f"test:go:{flag}", 1)
    for job in (first, holder, waiting, requeued, running):
        assert wait_status(job, DONE, 40) is JobStatus.FINISHED, workers.logs()
    sent = [raw.decode() for raw in rconn.lrange("test:sent", 0, -1)]
    assert sorted(sent) == ["queued", "requeued", "running", "waiting"], "each sent once"


@pytest.mark.slow
def test_after_it_finished_a_duplicate_is_enqueued_again_and_replays(workers, rconn):
    workers.start()
    rconn.set("test:go:done", 1)
    first = admission_jobs.send_once.delay(14, "done")
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    again = admission_jobs.send_once.delay(14, "done")
    assert again.id == first.id, "the same logical job keeps its id"
    assert wait_status(again, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert again.get_meta(refresh=True)["joblock"]["outcome"] == "replayed"
    assert again.return_value() == "sent done"
    assert rconn.lrange("test:sent", 0, -1) == [b"done"], "the idempotency record replayed it"
    assert _blocked() == 0


RESULT_TTL = 10


@pytest.mark.slow
def test_a_job_enqueued_again_keeps_nothing_of_its_last_calls_options(workers, rconn):
    """Review finding: RQ's enqueue writes the new job's fields over the old hash and keeps the
    others, so a ``retry=`` given to the call before made a later plain ``.delay()`` of the
    same logical job retry on failure."""
    from rq import Retry

    workers.start()
    rconn.set("test:go:retried", 1)
    first = admission_jobs.send_once.enqueue_call((22, "retried"), retry=Retry(max=2))
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert rconn.hget(first.key, "retries_left") == b"2", "negative control: it had retries"
    again = admission_jobs.send_once.delay(22, "retried")
    assert again.id == first.id
    again.refresh()
    assert again.retries_left is None, "the new call gave no retry="


@pytest.mark.slow
def test_a_job_enqueued_again_does_not_keep_the_expiry_of_its_last_end(workers, rconn):
    """Found by a deployment test: the new job vanished while it waited, never ran."""
    rconn.set("test:go:short", 1)
    # A result_ttl the burst worker's exit stays within, on a busy machine too.
    first = admission_jobs.send_once.enqueue_call((15, "short"), result_ttl=RESULT_TTL)
    workers.start(burst=True).wait(30)  # gone before the job is enqueued again
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert 0 < rconn.ttl(first.key) <= RESULT_TTL, "negative control: its end set an expiry"
    again = admission_jobs.send_once.delay(15, "short")  # waits for a worker past that expiry
    assert again.id == first.id and rconn.ttl(again.key) == -1
    wait_for(lambda: False, RESULT_TTL + 1.0)
    assert rconn.exists(again.key), "the job waiting for a worker is still there"
    workers.start(burst=True)
    assert wait_status(again, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert again.get_meta(refresh=True)["joblock"]["outcome"] == "replayed"


def test_concurrent_duplicate_delays_enqueue_one_job(rconn):
    queue = get_queue("default")
    found: list[str] = []
    barrier = threading.Barrier(8)

    def deliver() -> None:
        barrier.wait()
        found.append(admission_jobs.send_once.delay(15, "racing").id)

    threads = [threading.Thread(target=deliver) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(found) == 8 and len(set(found)) == 1, found
    assert queue.count == 1
    assert _blocked() == 7


def test_a_duplicate_with_other_arguments_is_refused_not_swallowed(rconn):
    """Same key, other arguments, while the first job is live: it used to return the first
    job, so the caller believed its call was queued. Now refused at ``.delay()``."""
    queue = get_queue("default")
    first = admission_jobs.send_once.delay(16, "other-args")
    assert admission_jobs.send_once.delay(16, "other-args").id == first.id, "same call"
    with pytest.raises(IdempotencyKeyMismatch, match=rf"send:other-args.*{first.id}") as caught:
        admission_jobs.send_once.delay(17, "other-args")
    assert caught.value.key == "send:other-args"
    assert queue.count == 1 and queue.get_job_ids() == [first.id]
    assert _blocked() == 1


def test_dedupe_job_in_the_registry_is_checked_like_the_others():
    assert registry[admission_jobs.send_once.spec.name].dedupe is True


def test_a_canceled_job_enqueued_again_leaves_the_canceled_registry(rconn):
    """Review bug: only a failed or finished job's old registry entry was dropped; a canceled
    one stayed listed as canceled while it ran again (an operator's clean-up would act on it)."""
    queue = get_queue("default")
    first = admission_jobs.send_once.delay(20, "canceled")
    first.cancel()
    assert first.id in queue.canceled_job_registry, "negative control: RQ lists it as canceled"
    again = admission_jobs.send_once.delay(20, "canceled")
    assert again.id == first.id and again.get_status(refresh=True) in LIVE
    assert first.id not in queue.canceled_job_registry


@pytest.mark.slow
def test_a_stopped_job_enqueued_again_leaves_the_failed_registry(workers, rconn):
    """As above for a job stopped by RQ's stop command, which RQ keeps in its failed registry."""
    from rq.command import send_stop_job_command

    queue = get_queue("default")
    workers.start()
    first = admission_jobs.send_once.delay(21, "stopped")  # waits for test:go:stopped
    assert wait_for(lambda: rconn.lrange("test:sent", 0, -1) == [b"stopped"], 30), workers.logs()
    send_stop_job_command(rconn, first.id)
    assert wait_status(first, {JobStatus.STOPPED}, 30) is JobStatus.STOPPED, workers.logs()
    assert first.id in queue.failed_job_registry, "negative control: RQ lists it as failed"
    rconn.set("test:go:stopped", 1)
    again = admission_jobs.send_once.delay(21, "stopped")
    assert again.id == first.id
    assert first.id not in queue.failed_job_registry, "listed as failed while it runs again"
    assert wait_status(again, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert first.id not in queue.failed_job_registry


@pytest.mark.parametrize("argument", [{1: "a", "x": 1}, {10: "a", 2: "b"}, {True: 1, "k": 2}])
def test_the_same_call_on_a_json_queue_returns_the_live_job(scratch_registry, rconn, argument):
    """Review bug: ``.delay()`` fingerprinted its arguments as given and the live job's as RQ's
    ``JSONSerializer`` gives them back (a dict's int keys as str, which sort otherwise), so the
    same call made twice raised :class:`IdempotencyKeyMismatch`, in the caller or logged at the
    commit. Both are now compared as the queue's serializer delivers them."""
    from django.db import transaction
    from rq import Queue
    from rq.serializers import JSONSerializer

    json_queue = Queue("default", connection=rconn, serializer=JSONSerializer)

    @locked_job(json_queue, idempotency_key="json:{k}", dedupe=True)
    def json_job(k: int, m: dict) -> int:
        return k

    first = json_job.delay(1, argument)
    assert json_job.delay(1, argument).id == first.id
    with pytest.raises(IdempotencyKeyMismatch):
        json_job.delay(1, {"other": 1})
    with transaction.atomic():  # at the commit, the same comparison
        json_job.delay(2, argument)
        json_job.delay(2, argument)
    assert json_queue.count == 2 and _blocked() == 2
