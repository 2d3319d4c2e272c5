"""@locked_job under real RQ worker processes, with real faults (SIGKILL, SIGSTOP, timeouts)."""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from rq import Retry, Worker
from rq.job import JobStatus
from rq.results import Result

from django_joblock import IdempotencyRecord, lock, metrics
from django_joblock.backoff import ceiling
from django_joblock.jobs.queues import get_queue
from django_joblock.jobs.requeue import delay_for
from django_joblock.monitor import alerts
from django_joblock.monitor.health import record_deliveries
from tests import jobs
from tests.harness import wait_for
from tests.testapp.models import Account
from tests.workers import Workers, exited, intervals, pid_of, wait_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

BACKOFF = {"base": 1, "factor": 2, "max": 8}
DONE = {JobStatus.FINISHED, JobStatus.FAILED}


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": BACKOFF}
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


def _ceiling(attempt: int) -> int:
    """The largest whole-second delay the workers' REQUEUE_BACKOFF allows for ``attempt``."""
    cap = ceiling(attempt, base=BACKOFF["base"], factor=BACKOFF["factor"], max_delay=BACKOFF["max"])
    return max(1, math.ceil(cap))


def test_two_jobs_on_one_resource_never_overlap_and_the_second_backs_off(workers, rconn):
    """The requeue path (admission=False, and every job on rq 2.x)."""
    workers.start(scheduler=True)
    workers.start()
    first = jobs.hold_requeue_only.delay(1, "first", 6.0)
    pid_of(rconn, "first")
    second = jobs.hold_requeue_only.delay(1, "second", 0.2)
    assert first.id != second.id
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    spans = intervals(rconn)
    assert spans["first"][1] <= spans["second"][0], f"jobs overlapped: {spans}"
    state = second.get_meta(refresh=True)["joblock"]
    delays = state["delays"]
    assert state["requeues"] == len(delays) >= 2, state
    # RQ's own record of the tries (not our meta): one "retried" result per requeue, then the
    # run that succeeded, oldest first.
    second.refresh()
    tries = list(reversed(second.results()))
    kinds = [result.type for result in tries]
    assert kinds == [Result.Type.RETRIED] * len(delays) + [Result.Type.SUCCESSFUL], kinds
    assert second.number_of_retries == len(delays)
    # The holder heartbeats, so each delay is the backoff's own draw: whole seconds, at least
    # 1, under the ceiling the workers' REQUEUE_BACKOFF gives that attempt (1, 2, 4, 8 s).
    for attempt, delay in enumerate(delays):
        assert 1 <= delay <= _ceiling(attempt), (attempt, delay, delays)
    # Each try after a requeue came no sooner than its delay allowed: the job waited, it did
    # not spin on the busy lock. Slack by design: RQ schedules at whole seconds (up to 1 s
    # early) and a result's time is when Redis stored it (the worker's pipeline, 0.5 s here).
    for delay, before, after in zip(delays, tries, tries[1:], strict=False):
        gap = (after.created_at - before.created_at).total_seconds()
        assert gap >= delay - 1.5, (delay, gap, delays)
    assert second.retries_left is None, "contention must not spend the exception-retry budget"


def test_requeue_delay_ceilings_grow_with_each_attempt(settings):
    """The backoff the test above sees one sample of: over many draws, attempt n's delays
    cover exactly 1 .. its ceiling, and the ceilings double (1, 2, 4, 8 s) up to the cap."""
    settings.JOBLOCK = {"REQUEUE_BACKOFF": BACKOFF}
    seen = {attempt: {delay_for(attempt, None, 3600) for _ in range(500)} for attempt in range(5)}
    assert [max(seen[attempt]) for attempt in range(5)] == [1, 2, 4, 8, 8], seen
    assert all(min(draws) == 1 for draws in seen.values()), seen
    assert all(draws == set(range(1, _ceiling(n) + 1)) for n, draws in seen.items()), seen


def test_duplicate_delivery_applies_the_effect_once(workers, rconn):
    Account.objects.create(name="acct", balance=0)
    workers.start(scheduler=True)
    workers.start(simple=True)
    deliveries = [jobs.credit.delay("acct", "C-1", 10) for _ in range(3)]
    assert len({job.id for job in deliveries}) == 3
    for job in deliveries:
        assert wait_status(job, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert Account.objects.get(name="acct").balance == 10
    assert int(rconn.get("test:effects:C-1")) == 1
    outcomes = [job.get_meta(refresh=True)["joblock"].get("outcome") for job in deliveries]
    assert outcomes.count("replayed") == 2, outcomes
    assert all(job.return_value() == {"credited": 10} for job in deliveries)
    record = IdempotencyRecord.objects.get(key="credit:C-1")
    assert record.status == "succeeded" and record.attempts == 1


def test_sigkilled_horse_frees_the_lock_after_ttl_and_the_retry_applies_once(workers, rconn):
    Account.objects.create(name="acct", balance=0)
    workers.start(scheduler=True)
    job = jobs.credit_then_hang.enqueue_call(("acct", "K-1", 10), retry=Retry(max=2, interval=1))
    horse = pid_of(rconn, "K-1")
    assert horse not in {p.pid for p in workers.procs}, "expected a forked work horse"
    lock_key = "joblock:{account:acct}:lock"
    assert rconn.exists(lock_key)
    os.kill(horse, signal.SIGKILL)
    killed_at = time.monotonic()
    rconn.set("test:go:K-1", 1)  # the retry may finish
    assert wait_for(lambda: not rconn.exists(lock_key), 10), "lock never freed"
    assert time.monotonic() - killed_at <= 2.0 + 1.0, "freed by TTL (2 s), not held on"
    assert wait_status(job, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert int(rconn.get("test:runs:K-1")) == 2, "negative control: the first run did write"
    assert Account.objects.get(name="acct").balance == 10, "the killed run's write rolled back"
    record = IdempotencyRecord.objects.get(key="credit:K-1")
    # One commit per job: the killed run's claim rolled back with its effect, so the retry
    # made the record's first (and only) claim.
    assert (record.status, record.attempts) == ("succeeded", 1)


def test_orphaned_horse_keeps_its_lock_and_blocks_redelivery(workers, rconn):
    parent = workers.start()
    orphan = jobs.hold_resource.delay(2, "orphan", 6.0)
    horse = pid_of(rconn, "orphan")
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    workers.start(scheduler=True)
    redelivered = jobs.hold_resource.delay(2, "redelivered", 0.1)
    assert wait_status(redelivered, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert wait_status(orphan, DONE, 30) is JobStatus.FINISHED, "the orphan finished its job"
    spans = intervals(rconn)
    assert spans["orphan"][1] <= spans["redelivered"][0], spans
    # Negative control: the orphan held the lock three times its TTL, by heartbeat alone.
    assert spans["orphan"][1] - spans["orphan"][0] >= 3 * 2.0
    state = redelivered.get_meta(refresh=True)["joblock"]
    if state["admission"] == "rate_limit":
        # Parked behind the orphan's job (still running in RQ's eyes), not requeued.
        assert state.get("requeues", 0) == 0 and state["waited"] > 0, state
    else:
        assert state["requeues"] >= 1, state
    assert wait_for(lambda: exited(horse), 10), "the orphan should exit after its job"


def _stop_horse_past_ttl(workers, rconn, func, pause_mode: str):  # type: ignore[no-untyped-def]
    Account.objects.create(name="acct", balance=0)
    workers.start()
    workers.start()
    paused = func.delay("acct", "P", 1)
    horse = pid_of(rconn, "P")
    os.kill(horse, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # past the 2 s TTL: the lock expires on the server
        rconn.set("test:go:Q", 1)
        newer = func.delay("acct", "Q", 2)
        assert wait_status(newer, DONE, 30) is JobStatus.FINISHED, workers.logs()
        assert Account.objects.get(name="acct").balance == 2
        if pause_mode == "release":
            rconn.set("test:go:P", 1)  # resume straight into the write
    finally:
        os.kill(horse, signal.SIGCONT)
    return paused


def test_sigstopped_horse_is_aborted_with_lock_lost(workers, rconn):
    paused = _stop_horse_past_ttl(workers, rconn, jobs.paused_write, "hold")
    assert wait_status(paused, DONE, 20) is JobStatus.FAILED, workers.logs()
    assert "LockLost" in paused.latest_result().exc_string
    assert Account.objects.get(name="acct").balance == 2
    assert rconn.lrange("test:written", 0, -1) == [b"Q"]
    # The horse counted its loss (flushed at the end of its job): the alert fires.
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert "locks_lost" in fired and "account 1" in fired["locks_lost"].message, fired


def test_stale_fenced_write_is_rejected_when_only_flagged(workers, rconn, settings):
    settings.JOBLOCK = {**settings.JOBLOCK, "ON_LOCK_LOST": "flag"}
    workers.joblock = settings.JOBLOCK
    paused = _stop_horse_past_ttl(workers, rconn, jobs.paused_write, "release")
    assert wait_status(paused, DONE, 20) is JobStatus.FAILED, workers.logs()
    assert "StaleFence" in paused.latest_result().exc_string
    assert Account.objects.get(name="acct").balance == 2, "the newer holder's write stands"


def test_without_fencing_the_stale_write_lands(workers, rconn, settings):
    """Negative control for the two tests above."""
    settings.JOBLOCK = {**settings.JOBLOCK, "ON_LOCK_LOST": "flag"}
    workers.joblock = settings.JOBLOCK
    paused = _stop_horse_past_ttl(workers, rconn, jobs.unfenced_write, "release")
    assert wait_status(paused, DONE, 20) is JobStatus.FINISHED, workers.logs()
    assert Account.objects.get(name="acct").balance == 1, "the stale write overwrote 2"


def test_resource_held_forever_fails_visibly_after_max_wait(workers, rconn):
    with lock("res:9", ttl=5):
        workers.start(scheduler=True)
        job = jobs.hold_with_short_wait.delay(9, "never", 0.1)
        assert wait_status(job, DONE, 40) is JobStatus.FAILED, workers.logs()
    assert "LockContentionTimeout" in job.latest_result().exc_string
    assert job.id in job.failed_job_registry.get_job_ids(cleanup=False)
    assert job.get_meta(refresh=True)["joblock"]["outcome"] == "gave_up"
    assert rconn.lrange("test:intervals", 0, -1) == []
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert "given_up" in fired and "res 1" in fired["given_up"].message, fired


def test_skip_and_fail_policies(workers, rconn):
    with lock("res:5", ttl=5):
        workers.start(simple=True)
        skipped = jobs.hold_or_skip.delay(5, "skipped", 0.1)
        failed = jobs.hold_or_fail.delay(5, "failed", 0.1)
        assert wait_status(skipped, DONE, 30) is JobStatus.FINISHED, workers.logs()
        assert wait_status(failed, DONE, 30) is JobStatus.FAILED, workers.logs()
    assert skipped.return_value() is None
    assert skipped.get_meta(refresh=True)["joblock"]["outcome"] == "skipped"
    assert "LockNotAcquired" in failed.latest_result().exc_string
    assert rconn.lrange("test:intervals", 0, -1) == [], "neither body ran"


def test_rq_job_timeout_releases_the_heartbeating_lock(workers, rconn):
    workers.start()
    job = jobs.hold_resource.enqueue_call((6, "timeout", 30.0), job_timeout=2)
    pid_of(rconn, "timeout")
    lock_key = "joblock:{res:6}:lock"
    assert rconn.exists(lock_key)
    assert wait_status(job, DONE, 30) is JobStatus.FAILED, workers.logs()
    assert "JobTimeoutException" in job.latest_result().exc_string
    # Released by the job itself: with heartbeat the key would otherwise live on.
    assert not rconn.exists(lock_key)


def test_django_rq_rqworker_runs_locked_jobs(workers, rconn):
    Account.objects.create(name="acct", balance=0)
    workers.start(command="rqworker", burst=True)
    job = jobs.credit.delay("acct", "D-1", 7)
    # rqworker --burst may exit before the enqueue; start another burst worker if it did.
    if workers.procs[0].wait(30) is not None and job.get_status(refresh=True) is JobStatus.QUEUED:
        workers.start(command="rqworker", burst=True).wait(30)
    assert wait_status(job, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert Account.objects.get(name="acct").balance == 7


def test_near_timeout_alert_counts_runs_close_to_their_job_timeout(workers, rconn, settings):
    """A real worker's run that takes 2.2 s of a 4 s job_timeout (TIMEOUT_RATIO 0.5) fires
    ``near_timeout``; a quick run of the same job (the negative control) does not. (The run
    stays well inside its timeout: on a busy machine 1.7 s of 2 s was killed by RQ's.)"""
    workers.joblock["ALERTS"] = {"TIMEOUT_RATIO": 0.5}
    settings.JOBLOCK = workers.joblock
    workers.start()
    quick = jobs.hold_steadily.enqueue_call((11, "quick", 0.05), job_timeout=4)
    assert wait_status(quick, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert "near_timeout" not in {alert.name for alert in alerts.evaluate()}
    slow = jobs.hold_steadily.enqueue_call((11, "slow", 2.2), job_timeout=4)
    assert wait_status(slow, DONE, 30) is JobStatus.FINISHED, workers.logs()
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert "near_timeout" in fired and "res 1" in fired["near_timeout"].message, fired


def test_long_wait_alert_after_a_job_waited_for_its_resource(workers, rconn, settings):
    """A job enqueued while its resource is held for 3 s starts 3+ s after its enqueue: with
    LONG_WAIT 1 s the alert fires for its family; with LONG_WAIT 60 s it does not. (Without
    admission, rq 2.x, the requeue backoff adds up to 8 s to the wait.)"""
    workers.start(scheduler=True)
    with lock("res:12", ttl=10):
        job = jobs.hold_resource.delay(12, "waited", 0.01)
        time.sleep(3)
    assert wait_status(job, DONE, 60) is JobStatus.FINISHED, workers.logs()
    waited = job.get_meta(refresh=True)["joblock"]["waited"]
    assert 3.0 <= waited < 30, waited
    settings.JOBLOCK = {**settings.JOBLOCK, "ALERTS": {"LONG_WAIT": 60}}
    assert "long_wait" not in {alert.name for alert in alerts.evaluate()}
    settings.JOBLOCK = {**settings.JOBLOCK, "ALERTS": {"LONG_WAIT": 1}}
    fired = [alert for alert in alerts.evaluate() if alert.name == "long_wait"]
    assert [alert.family for alert in fired] == ["res"], fired


def test_a_second_delivery_while_the_first_runs_is_a_duplicate_in_flight(workers, rconn):
    """Two deliveries of one key (different job ids): the second finds the first holding the
    resource and is counted and logged as a duplicate in flight, then replays. Negative
    control: another key on the same resource is plain contention."""
    workers.start(scheduler=True)
    workers.start()
    # Both idle first (CI: on a busy box the second worker came up after the 2 s job had ended,
    # and the second delivery replayed instead of meeting the first in flight).
    idle = lambda: [w.get_state() for w in Worker.all(connection=rconn)] == ["idle", "idle"]  # noqa: E731
    assert wait_for(idle, 60), workers.logs()
    first = jobs.keyed_hold.delay(1, 7, 2.0)
    assert wait_for(lambda: first.get_status(refresh=True) == JobStatus.STARTED, 20)
    second = jobs.keyed_hold.delay(1, 7, 2.0)  # the same key: n=7
    other = jobs.keyed_hold.delay(1, 8, 0.01)  # another key on the same resource

    def reason(job: Any) -> str:
        return str(job.get_meta(refresh=True).get("joblock", {}).get("reason", ""))

    expected = f"a duplicate in flight: key 'dup:7' is running as job {first.id}"
    assert wait_for(lambda: reason(second) == expected, 20), reason(second)
    assert wait_for(lambda: reason(other).startswith("lock 'dupres:1' is busy"), 20), reason(other)
    for job in (first, second, other):
        assert wait_status(job, DONE, 60) is JobStatus.FINISHED, workers.logs()
    assert second.get_meta(refresh=True)["joblock"]["outcome"] == "replayed"
    assert rconn.lrange("test:keyed", 0, -1).count(b"7") == 1, "applied once"
    # Counted for the duplicate's contended runs that found the first holding (a later one
    # may find the other key's job holding instead), never for the other key.
    requeues = second.get_meta(refresh=True)["joblock"]["requeues"]
    assert 1 <= metrics.totals().total("duplicates_in_flight") <= requeues
    assert other.get_meta(refresh=True)["joblock"]["requeues"] >= 1
    # The key's delivery history tells the story: two RQ jobs; the first ran, the second was
    # a duplicate in flight beside it, then replayed.
    story = record_deliveries("tests.jobs.keyed_hold", "dup:7", "dupres:1")
    assert [(d.job_id, d.outcome) for d in story] == [
        (first.id, "ran"),
        *[(second.id, "requeued")] * requeues,
        (second.id, "replayed"),
    ], story
    assert next(d.duplicate_of for d in story if d.outcome == "requeued") == first.id
    assert {d.host for d in story} and all(d.pid and d.started for d in story)
    # ... and the record's admin page shows it.
    record = IdempotencyRecord.objects.get(key="dup:7")
    admin = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(admin)
    page = client.get(f"/admin/django_joblock/idempotencyrecord/{record.pk}/change/")
    assert page.status_code == 200
    body = page.content.decode()
    assert "2 deliveries (RQ jobs)" in body and f"duplicate in flight beside {first.id}" in body
    # The dashboard's per-job-type table has the job's row, duplicates in flight included.
    dashboard = client.get("/admin/django_joblock/dashboard/").content.decode()
    table = dashboard[dashboard.index('id="jl-job-types"') :]
    row = table[table.index("<td>tests.jobs.keyed_hold</td>") :].split("</tr>")[0]
    in_flight = metrics.totals().total("duplicates_in_flight")
    assert "<td>dupres</td>" in row and f"<td>{in_flight}</td>" in row, row
    # joblock_doctor tells the same story and walks the article's steps.
    out = StringIO()
    call_command("joblock_doctor", "--key", "dup:7", stdout=out)
    report = out.getvalue()
    assert f"yes: 2 deliveries (RQ jobs {first.id}, {second.id}); {first.id} ran" in report
    assert f"{second.id} replayed the stored result" in report, report
    assert "2. Do conflicting runs build the same lock key? [ok] every run locked 'dupres:1'" in (
        report
    )
    out = StringIO()
    call_command("joblock_doctor", "--job", second.id, "--json", stdout=out)
    found = json.loads(out.getvalue())
    assert found["key"] == "dup:7" and found["resource"] == "dupres:1"
    assert [step["verdict"] for step in found["steps"]][:2] == ["info", "ok"], found["steps"]


def test_joblock_doctor_refuses_bad_targets():
    with pytest.raises(CommandError):
        call_command("joblock_doctor")  # one of --job / --key / --resource
    with pytest.raises(CommandError, match="no RQ job nope"):
        call_command("joblock_doctor", "--job", "nope")
    with pytest.raises(CommandError, match="Invalid lock resource"):
        call_command("joblock_doctor", "--resource", "<b>order</b>")
    out = StringIO()
    call_command("joblock_doctor", "--resource", "order:1", stdout=out)
    assert "resource 'order:1': free now" in out.getvalue()


def test_joblock_doctor_names_a_job_whose_arguments_no_longer_fit(rconn):
    """Review bug: ``--job`` on a job enqueued before its function's signature changed (here:
    enqueued with RQ's own API, past ``.delay()``'s check) crashed with a TypeError traceback."""
    odd = get_queue("default").enqueue(jobs.credit.spec.name, "a", "C-1", 1, 2, 3)
    with pytest.raises(CommandError, match=rf"job {odd.id}'s arguments do not fit .*credit"):
        call_command("joblock_doctor", "--job", odd.id)
