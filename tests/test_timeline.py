"""The dashboard's timeline and RQ failures beside contention: real worker
processes run jobs that hold a resource, find it busy and fail; the page draws who held it,
who waited and who failed, escaped, and counts the failures RQ retries."""

from __future__ import annotations

import json
import time
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from rq import Retry
from rq.job import JobStatus

from django_joblock import idempotent, lock, metrics
from django_joblock.jobs import history
from django_joblock.models import IdempotencyRecord
from django_joblock.monitor.health import queue_connections
from tests import jobs
from tests.harness import wait_for, write_run
from tests.workers import DONE, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DASHBOARD = "/admin/django_joblock/dashboard/"


def _client() -> Client:
    user = User.objects.filter(username="ops").first()
    client = Client()
    client.force_login(user or User.objects.create_superuser("ops", password="pw"))
    return client


def _page(**params: str) -> str:
    response = _client().get(DASHBOARD, params)
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


def _timeline_svg(page: str) -> str:
    section = page[page.index('id="jl-timeline"') :]
    return section[: section.index("</section>")]


@pytest.mark.slow
def test_the_timeline_draws_holders_waiters_and_busy_runs_of_real_workers(crew, rconn):
    crew.start(scheduler=True)
    crew.start()
    # Held 5 s: on a busy machine the idle worker took 1.5 s to pick up the late job (CI).
    holder = jobs.hold_requeue_only.delay(50, "holder", 5.0)
    assert wait_for(lambda: rconn.get("test:pid:holder"), 20), crew.logs()
    late = jobs.hold_requeue_only.delay(50, "late", 0.05)  # busy, requeued, then runs
    for job in (holder, late):
        assert wait_status(job, DONE, 60, crew) is JobStatus.FINISHED
    spans = history.read(queue_connections(), "res")
    outcomes = sorted((span.job_id, span.outcome) for span in spans)
    assert (holder.id, "ran") in outcomes and (late.id, "ran") in outcomes, outcomes
    assert (late.id, "requeued") in outcomes, "the late job found the resource busy"
    ran_late = next(s for s in spans if s.job_id == late.id and s.outcome == "ran")
    assert ran_late.waited is not None and ran_late.waited >= 1.0, "it waited for the holder"
    svg = _timeline_svg(_page(timeline="res:50"))
    assert "Timeline of &#x27;res:50&#x27;" in svg or "Timeline of 'res:50'" in svg
    assert svg.count('class="jl-tl-ran"') == 2 and 'class="jl-tl-busy"' in svg, svg
    assert 'class="jl-tl-wait"' in svg and f"job {late.id} waited" in svg
    assert "1 resource(s): 2 run(s) holding the lock" in svg
    # The default timeline is the family with the most contention.
    assert "Timeline of" in _timeline_svg(_page()) and "res" in _timeline_svg(_page())


@pytest.mark.slow
def test_failed_runs_and_rq_retries_are_counted_beside_contention(crew):
    crew.start(scheduler=True)
    with lock("res:51", ttl=30):  # busy: on_conflict="fail" raises, RQ retries once
        job = jobs.hold_or_fail.enqueue_call((51, "fails", 0.0), retry=Retry(max=1, interval=1))
        assert wait_status(job, DONE, 60, crew) is JobStatus.FAILED, crew.logs()
    totals = metrics.totals()
    assert (totals.total("failed_runs", "res"), totals.total("rq_retries", "res")) == (2, 1)
    page = _page(timeline="res:51")
    row = page[page.index("<td>tests.jobs.hold_or_fail</td>") :].split("</tr>")[0]
    assert "<td>2</td><td>1</td>" in row, row  # failed runs, RQ retries
    assert "Failed runs / RQ retries (1 h)" in page and "2 / 1" in page
    assert _timeline_svg(page).count('class="jl-tl-failed"') == 2


def test_the_timeline_escapes_what_it_shows_and_refuses_bad_targets(rconn):
    from django_redis import get_redis_connection

    redis = get_redis_connection("default")
    write_run(redis, "res:52", "<b>job</b>", "<i>f</i>", time.time() - 5, 1.0, None, "ran")
    svg = _timeline_svg(_page(timeline="res"))
    assert "&lt;b&gt;job&lt;/b&gt;" in svg and "<b>job</b>" not in svg and "<i>f</i>" not in svg
    client = _client()
    for bad in ("<script>", "res:<b>", "a" * 300):
        response = client.get(DASHBOARD, {"timeline": bad})
        assert response.status_code == 400 and response["Content-Type"].startswith("text/plain")
        assert b"timeline:" in response.content
    assert "no runs with a lock in the last 10 minutes" in _page(timeline="empty")


ODD = {"started": "yesterday", "waited": "x", "resource": 3, "pid": "abc", "took": 1e999}


@pytest.mark.parametrize("field", list(ODD))
def test_one_history_entry_of_an_odd_shape_is_left_out_everywhere(field, rconn):
    """An entry another version (or a hand) wrote with a field of another type made the
    record page and the dashboard answer 500 and joblock_doctor crash."""
    scope = jobs.credit.spec.scope  # a @locked_job's: its record page reads its queue
    with idempotent("odd:1", scope=scope) as claim:
        claim.succeed({"ok": True})
    record = IdempotencyRecord.objects.get(key="odd:1")
    now = time.time()
    for resource, family in (("res:9", "res"), ("", "odd")):  # a lock's history, a key's
        write_run(rconn, resource, "good-run", scope, now - 5, 1, 0.5, "ran", key="odd:1")
        good = json.loads(rconn.lindex(f"joblock:runs:{family}", 0))
        odd = {**good, "job_id": "odd-run", field: ODD[field]}
        rconn.rpush(f"joblock:runs:{family}", json.dumps(odd))
    for target in ("res", "res:9"):
        page = _page(timeline=target)
        assert "good-run" in page and "odd-run" not in page
    response = _client().get(f"/admin/django_joblock/idempotencyrecord/{record.pk}/change/")
    assert response.status_code == 200 and b"good-run" in response.content
    assert b"odd-run" not in response.content
    out = StringIO()
    call_command("joblock_doctor", "--key", "odd:1", "--scope", scope, "--json", stdout=out)
    assert "good-run" in out.getvalue() and "odd-run" not in out.getvalue()


def test_the_doctor_of_a_resource_reads_its_runs_and_names_a_key_run_twice(rconn):
    """``joblock_doctor --resource order:6`` said "no runs to compare" seconds after a double
    refund on that order: only a key's target read the run history."""
    scope, now = jobs.credit.spec.scope, time.time()
    for job_id, key, outcome in (
        ("job-a", "refund:R-1", "ran"),
        ("job-b", "refund:R-1", "ran"),  # the double refund
        ("job-c", "refund:R-2", "ran"),
        ("job-d", "refund:R-2", "replayed"),
    ):
        write_run(rconn, "order:6", job_id, scope, now - 5, 0.5, 0.1, outcome, key=key)
    write_run(rconn, "order:7", "job-e", scope, now - 5, 0.5, 0.1, "ran", key="refund:R-3")
    out = StringIO()
    call_command("joblock_doctor", "--resource", "order:6", "--json", stdout=out)
    found = json.loads(out.getvalue())
    assert {run["job_id"] for run in found["deliveries"]} == {"job-a", "job-b", "job-c", "job-d"}
    problem = [step["evidence"] for step in found["steps"] if step["verdict"] == "problem"]
    twice = "runs committed one key's effect more than once: 'refund:R-1' by job-a, job-b"
    assert problem == [twice]
    assert "no runs" not in out.getvalue() and "no durations" not in out.getvalue()
