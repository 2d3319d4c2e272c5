"""Metrics, Prometheus export, structured logs and alerts (real Redis, real workers)."""

from __future__ import annotations

import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rq.job import JobStatus

from django_joblock import (
    LockBackendUnavailable,
    StaleFence,
    fenced_update,
    idempotent,
    lock,
    metrics,
)
from django_joblock.jobs import admission
from django_joblock.jobs.decorator import registry
from django_joblock.locks import index as active_index
from django_joblock.locks.renewal import renewer
from django_joblock.monitor import active as monitoring
from django_joblock.monitor import alerts
from django_joblock.monitor.prometheus import exposition
from tests import jobs, seam_jobs
from tests.harness import expire_now, wait_for
from tests.testapp.models import Account
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)


def totals() -> metrics.Series:
    metrics.flush_now()
    return metrics.totals()


def hist_count(series: metrics.Series, metric: str, family: str) -> int:
    return sum(series.merged_histogram(metric, family))


def test_each_lock_event_counts_exactly_once(rconn):
    with lock("order:1", ttl=5):
        assert not lock("order:1", ttl=5).acquire()
    with pytest.raises(LockBackendUnavailable):
        lock("order:2", cache="down").acquire()
    seen = totals()
    assert seen.counters["acquire_attempts"][("order", "")] == 3
    assert seen.counters["acquired"][("order", "")] == 1
    assert seen.counters["contended"][("order", "")] == 1
    assert seen.counters["acquire_errors"][("order", "")] == 1
    assert hist_count(seen, "hold_seconds", "order") == 1
    assert hist_count(seen, "wait_seconds", "order") == 2
    assert set(seen.families()) == {"order"}, "grouped by family, never by resource"


def test_renewals_and_loss_count_once_each(rconn):
    before = renewer().stats()
    held = lock("report:1", ttl=2.0)
    assert held.acquire()
    assert wait_for(lambda: int(rconn.hget(held.key, "renewals") or 0) >= 2, 3 * held.ttl)
    expire_now(rconn, held.key)
    assert wait_for(lambda: held.lost, 2 * held.ttl)
    held.release()
    after = renewer().stats()
    seen = totals()
    assert seen.counters["renewed"][("report", "")] == after.renewed - before.renewed >= 2
    assert seen.counters["lost"][("report", "")] == after.lost - before.lost == 1


@pytest.mark.slow
def test_renew_failures_count_once_each(proxy, rconn):
    before = renewer().stats()
    held = lock("report:2", ttl=1.0, cache="proxied")
    assert held.acquire()
    proxy.set("blackhole")
    assert wait_for(lambda: held.lost, 3.0)
    proxy.set("forward")
    failed = renewer().stats().renew_failed - before.renew_failed
    assert failed >= 1
    assert totals().counters["renew_failed"][("report", "")] == failed


def test_duplicates_and_stale_fences_count_once(rconn):
    Account.objects.create(name="a")
    for _ in range(2):
        with idempotent("refund:1") as claim:
            if not claim.done:
                claim.succeed(1)
    fenced_update(Account.objects.filter(name="a"), 10, balance=1)
    with pytest.raises(StaleFence):
        fenced_update(Account.objects.filter(name="a"), 5, balance=2)
    seen = totals()
    assert seen.counters["duplicates_blocked"][("refund", "")] == 1
    assert seen.total("stale_fence_rejections") == 1


@pytest.mark.slow
def test_counts_from_forked_work_horses_are_not_lost(rconn, settings):
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 2}}
    crew = Workers(settings.JOBLOCK)
    try:
        crew.start(scheduler=True)
        crew.start()
        # The requeue path (admission=False): requeues are among the counts checked.
        first = jobs.hold_requeue_only.delay(3, "m-first", 2.5)
        assert wait_for(lambda: rconn.get("test:pid:m-first"), 20)
        second = jobs.hold_requeue_only.delay(3, "m-second", 0.1)
        for job in (first, second):
            assert wait_status(job, {JobStatus.FINISHED, JobStatus.FAILED}, 40) is (
                JobStatus.FINISHED
            ), crew.logs()
    finally:
        crew.stop()
    requeues = second.get_meta(refresh=True)["joblock"]["requeues"]
    label = ("res", jobs.hold_requeue_only.spec.name)
    seen = totals()
    assert seen.counters["acquired"][label] == 2
    assert seen.counters["acquire_attempts"][label] == 2 + requeues
    assert seen.counters["contended"][label] == requeues
    assert seen.counters["requeued"][label] == requeues >= 1
    assert sum(seen.histograms["hold_seconds"][label]) == 2


@pytest.mark.slow
def test_a_lock_less_replay_in_a_forked_horse_is_counted(rconn):
    """A job with an idempotency key and no lock, run twice by a forking worker: the replay's
    duplicate count is flushed before the work horse ``os._exit``s (before the fix it was
    buffered in the horse and lost: no lock release carried it, no renewal thread ran)."""
    first = seam_jobs.rich_result.delay(41)
    again = seam_jobs.rich_result.delay(41)  # a duplicate delivery: replayed
    crew = Workers()
    try:
        crew.start(burst=True).wait(60)
    finally:
        crew.stop()
    assert first.get_meta(refresh=True)["joblock"]["outcome"] == "ran", crew.logs()
    assert again.get_meta(refresh=True)["joblock"]["outcome"] == "replayed", crew.logs()
    counted = totals().counters["duplicates_blocked"][("rich", seam_jobs.rich_result.spec.name)]
    assert counted == 1
    # joblock_doctor on the same runs: no lock, so no TTL to hold the durations against.
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("joblock_doctor", "--key", "rich:41", stdout=out)
    assert "3. TTL and heartbeat against real durations [info]" in out.getvalue(), out.getvalue()
    assert "no lock, so no TTL to outlive" in out.getvalue()


def test_percentiles_read_back_within_one_bucket(rconn):
    import random

    rng = random.Random(7)
    values = sorted(10 ** rng.uniform(-3, 1.5) for _ in range(2000))  # 1 ms .. 30 s
    for value in values:
        metrics.observe("hold_seconds", "synthetic", "", value)
    metrics.flush_now()
    counts = metrics.window(120).merged_histogram("hold_seconds", "synthetic")
    assert sum(counts) == len(values)
    for q in (0.5, 0.95, 0.99):
        true = values[int(q * len(values)) - 1]
        estimate = metrics.percentile(counts, q)
        assert estimate is not None
        assert abs(metrics.bucket_of(estimate) - metrics.bucket_of(true)) <= 1, (q, true, estimate)


def test_prometheus_output_parses_and_follows_conventions(rconn):
    with lock("order:123", ttl=5):
        assert not lock("order:123").acquire()
    metrics.flush_now()
    text = exposition().decode()
    families = list(text_string_to_metric_families(text))
    names = {family.name for family in families}
    assert {"joblock_acquired", "joblock_hold_seconds", "joblock_active_locks"} <= names
    for family in families:
        assert family.name.startswith("joblock_")
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created"))
            if family.type == "histogram":
                assert family.name.endswith("_seconds")
            assert set(sample.labels) <= {"family", "function", "le"}
            assert all("order:123" not in value for value in sample.labels.values())
    assert "order:123" not in text


def test_metrics_view_requires_staff_or_token(client, admin_client, settings):
    url = "/joblock/metrics/"
    assert client.get(url).status_code == 401
    assert admin_client.get(url).status_code == 200
    settings.JOBLOCK = {"METRICS_TOKEN": "s3cret-token-for-prometheus"}
    assert client.get(url, HTTP_AUTHORIZATION="Bearer wrong-token-xxxxxxxxxx").status_code == 401
    ok = client.get(url, HTTP_AUTHORIZATION="Bearer s3cret-token-for-prometheus")
    assert ok.status_code == 200 and ok["Content-Type"].startswith("text/plain")
    assert b"# TYPE joblock_hold_seconds histogram" in ok.content
    # The scheme is case-insensitive (RFC 9110): "bearer" got 401. Anything else still does.
    for header in ("bearer s3cret-token-for-prometheus", "BEARER  s3cret-token-for-prometheus"):
        assert client.get(url, HTTP_AUTHORIZATION=header).status_code == 200, header
    for header in ("Basic s3cret-token-for-prometheus", "Bearers3cret-token-for-prometheus"):
        assert client.get(url, HTTP_AUTHORIZATION=header).status_code == 401, header


def test_metrics_view_refuses_a_deactivated_staff_user(client, settings):
    """Under a backend that logs inactive users in (AllowAllUsersModelBackend, remote-user
    setups), a deactivated staff account got the metrics while the admin refused it."""
    from django.contrib.auth.models import User

    settings.AUTHENTICATION_BACKENDS = ["django.contrib.auth.backends.AllowAllUsersModelBackend"]
    account = User.objects.create_user("left", password="pw", is_staff=True, is_active=False)
    client.force_login(account)
    assert client.get("/admin/django_joblock/dashboard/").status_code == 302, "admin refuses"
    assert client.get("/joblock/metrics/").status_code == 401
    account.is_active = True
    account.save()
    assert client.get("/joblock/metrics/").status_code == 200, "negative control"


def test_log_records_carry_extras_and_never_the_token(caplog, rconn):
    caplog.set_level(logging.DEBUG, logger="django_joblock")
    held = lock("order:55", ttl=3.0)
    assert held.acquire()
    assert not lock("order:55", ttl=1).acquire()
    expire_now(rconn, held.key)
    # The renewal thread marks the lock lost, then logs it (and calls on_lost).
    logged_lost = lambda: any(getattr(r, "outcome", "") == "lost" for r in caplog.records)  # noqa: E731
    assert wait_for(lambda: held.lost and logged_lost(), 2 * held.ttl)
    held.release()
    records = [r for r in caplog.records if r.name == "django_joblock"]
    outcomes = {r.outcome for r in records}
    assert {"acquired", "contended", "lost", "released"} <= outcomes
    fields = (
        "job_id",
        "resource",
        "lock_key",
        "lock_owner",
        "lock_ttl",
        "fence",
        "outcome",
        "reason",
    )
    for record in records:
        for name in fields:
            assert hasattr(record, name), (record.getMessage(), name)
        assert record.resource == "order:55" and len(record.lock_owner) == 12
        assert held.token not in record.getMessage()
        assert all(held.token not in str(getattr(record, name)) for name in fields)


@pytest.fixture
def no_jobs():  # type: ignore[no-untyped-def]
    saved = dict(registry)
    registry.clear()
    yield
    registry.update(saved)


def names(fired: list[alerts.Alert]) -> list[str]:
    return [alert.name for alert in fired]


def test_healthy_run_raises_no_alert(no_jobs, rconn):
    for i in range(30):
        with lock(f"order:{i}", ttl=5):
            pass
    metrics.flush_now()
    assert alerts.evaluate() == []


def test_contention_alert(no_jobs, rconn):
    with lock("order:1", ttl=5):
        for _ in range(25):
            assert not lock("order:1").acquire()
    metrics.flush_now()
    assert names(alerts.evaluate()) == ["contention"]


def test_contention_spike_alert(no_jobs, rconn, settings):
    """Half the acquires of a family busy now, against 5 % in the hour before: a spike. (The
    baseline's real acquires are filed in the bucket of half an hour ago.)"""
    settings.JOBLOCK = {"ALERTS": {"CONTENTION_RATIO": 1.0}}  # the static alert out of the way

    def acquires(busy: int, free: int) -> None:
        with lock("order:hot", ttl=5):
            for _ in range(busy):
                assert not lock("order:hot").acquire()
        for i in range(free):
            with lock(f"order:{i}", ttl=5):
                pass

    acquires(busy=2, free=38)  # 2 of 41 attempts busy
    metrics.flush_now(at=time.time() - 1800)
    assert "contention_spike" not in names(alerts.evaluate()), "nothing happens now"
    acquires(busy=12, free=12)  # 12 of 25 attempts busy
    metrics.flush_now()
    fired = [alert for alert in alerts.evaluate() if alert.name == "contention_spike"]
    assert [alert.family for alert in fired] == ["order"], fired
    assert "against 5%" in fired[0].message
    settings.JOBLOCK = {"ALERTS": {"CONTENTION_RATIO": 1.0, "CONTENTION_SPIKE": 20}}
    assert "contention_spike" not in names(alerts.evaluate()), "below 20 x the baseline"


def test_renew_failures_alert(no_jobs, rconn, settings):
    settings.JOBLOCK = {"ALERTS": {"RENEW_FAILURES": 3}}
    metrics.count("renew_failed", "order", "", n=3)
    metrics.flush_now()
    assert names(alerts.evaluate()) == ["renew_failures"]


def test_acquire_errors_alert(no_jobs, rconn, settings):
    """Acquires on a Redis that does not answer count as errors (the metrics go to the
    REDIS_ALIAS Redis, which answers) and fire the alert; a healthy acquire does not."""
    with lock("order:1", ttl=5):
        pass
    metrics.flush_now()
    assert "acquire_errors" not in names(alerts.evaluate()), "negative control"
    for _ in range(2):
        with pytest.raises(LockBackendUnavailable):
            lock("order:2", ttl=5, cache="down").acquire()
    metrics.flush_now()
    fired = {alert.name: alert for alert in alerts.evaluate()}
    assert fired["acquire_errors"].value == 2 and "order 2" in fired["acquire_errors"].message
    settings.JOBLOCK = {"ALERTS": {"ACQUIRE_ERRORS": 3}}
    assert "acquire_errors" not in names(alerts.evaluate()), "below its threshold"


def test_long_hold_alert(no_jobs, rconn, monkeypatch):
    monkeypatch.setattr(alerts, "MIN_HOLD", 1.0)
    for _ in range(30):
        metrics.observe("hold_seconds", "order", "", 0.02)
    metrics.flush_now()
    with lock("order:9", ttl=5):
        assert wait_for(lambda: monitoring.active_locks(), 3)
        assert alerts.evaluate() == [], "negative control: not long yet"
        time.sleep(1.0)
        fired = alerts.evaluate()
    assert names(fired) == ["long_hold"] and "order:9" in fired[0].message


def test_long_hold_alert_sees_every_active_lock(no_jobs, rconn, monkeypatch):
    """The hung holder renews its lock, so it is the *last* of its family to expire: behind
    30 short-lived locks it is outside any sample of the soonest to expire."""
    monkeypatch.setattr(alerts, "MIN_HOLD", 1.0)
    for _ in range(30):
        metrics.observe("hold_seconds", "order", "", 0.02)
    metrics.flush_now()
    hung = lock("order:hung", ttl=60)
    assert hung.acquire()
    others = [lock(f"order:{i}", ttl=20) for i in range(30)]
    try:
        for other in others:
            assert other.acquire()
        assert wait_for(lambda: len(monitoring.active_locks()) == 31, 3)
        time.sleep(1.2)
        for other in others:  # young again: only the hung holder is long
            other.release()
            assert other.acquire()
        # Indexed again (the renewal thread indexes a holding shortly after its acquire).
        assert wait_for(lambda: len(monitoring.active_locks()) == 31, 3)
        fired = alerts.evaluate()
    finally:
        for other in others:
            other.release()
        hung.release()
    assert names(fired) == ["long_hold"] and "order:hung" in fired[0].message, fired


def test_active_growth_alert(no_jobs, rconn, settings):
    settings.JOBLOCK = {"ALERTS": {"ACTIVE_GROWTH": 90}}
    now = time.time()
    metrics.record_active_sample(0, now=now - 89)
    metrics.record_active_sample(1, now=now - 45)
    held = [lock(f"order:{i}", ttl=5) for i in range(2)]
    for one in held:
        assert one.acquire()
    assert wait_for(lambda: sum(active_index.active_counts().values()) == 2, 3)
    assert names(alerts.evaluate(now=now)) == ["active_growth"]
    for one in held:
        one.release()
    assert alerts.evaluate(now=now + 1) == [], "it fell: quiet again"


@pytest.mark.slow
def test_no_scheduler_alert_and_joblock_alerts_exit_status(rconn):
    from django.core.management import call_command

    assert "no_scheduler" in names(alerts.evaluate())
    with pytest.raises(SystemExit) as exit_info:
        call_command("joblock_alerts", "--json")
    assert exit_info.value.code == 1
    crew = Workers()
    try:
        crew.start(scheduler=True)
        assert wait_for(lambda: rconn.exists("rq:scheduler-lock:default"), 20), crew.logs()
        assert "no_scheduler" not in names(alerts.evaluate())
    finally:
        crew.stop()


def test_resources_without_a_colon_share_one_metrics_family(rconn):
    """Each ``inv-42``-style resource used to be its own family: 800 of them made 6,438
    fields in the metrics hash and 56,965 Prometheus series. They are family "other" now."""
    for n in range(200):
        with lock(f"inv-{n}", ttl=5):
            pass
    with lock("order:1", ttl=5):
        pass
    metrics.flush_now()
    assert metrics.totals().families() == {"other", "order"}
    assert active_index.active_counts() == {}


FAMILY_CASES = {
    "inv-42": "other",
    "order:7": "order",
    "f" * 196 + ":123": "f" * 196,  # 200 characters
    "n" * 200: "other",
}


def test_every_reader_agrees_on_a_resources_family(no_jobs, rconn, monkeypatch):
    """Regression: the index computed a resource's family on its own (``inv-42`` was its own
    family there, ``other`` in the metrics), so the long-hold alert compared it with a family
    that had no samples. The index, the metrics, the Prometheus export, the alerts and the
    dashboard all name the family of ``locks.keys.family``."""
    from django_joblock.locks.keys import family
    from django_joblock.monitor import dashboard

    monkeypatch.setattr(alerts, "MIN_HOLD", 0.5)
    for resource, expected in FAMILY_CASES.items():
        assert family(resource) == expected
        for _ in range(30):
            metrics.observe("hold_seconds", expected, "", 0.01)
    metrics.flush_now()
    held = [lock(resource, ttl=30) for resource in FAMILY_CASES]
    for one in held:
        assert one.acquire()
    try:
        wanted = set(FAMILY_CASES.values())
        assert wait_for(lambda: len(monitoring.active_locks()) == len(held), 3)
        assert {row.resource: row.family for row in monitoring.active_locks()} == FAMILY_CASES
        assert set(active_index.active_counts()) == wanted
        assert totals().families() == wanted  # the acquires' counters
        exported = {
            sample.labels["family"]
            for found in text_string_to_metric_families(exposition().decode())
            if found.name == "joblock_active_locks"
            for sample in found.samples
        }
        assert exported == wanted
        page = dashboard.build(None, None, claims=False)
        assert set(page["families"]) == wanted
        assert {row["lock"].family for row in page["rows"]} == wanted
        time.sleep(0.6)  # past MIN_HOLD: every lock is long against its family's 0.01 s
        fired = {alert.family for alert in alerts.evaluate() if alert.name == "long_hold"}
        assert fired == wanted, "the long-hold alert found each family's samples"
    finally:
        for one in held:
            one.release()


def test_300_resources_without_a_colon_are_one_prometheus_series(rconn):
    """300 ``inv-N`` locks held at once were 300 ``joblock_active_locks`` series (one per
    resource id); they are one, ``family="other"``."""
    held = [lock(f"inv-{n}", ttl=30) for n in range(300)]
    for one in held:
        assert one.acquire()
    try:
        series = [
            sample
            for found in text_string_to_metric_families(exposition().decode())
            if found.name == "joblock_active_locks"
            for sample in found.samples
        ]
    finally:
        for one in held:
            one.release()
    assert len(series) < 20, [sample.labels for sample in series][:30]
    assert [(sample.labels["family"], sample.value) for sample in series] == [("other", 300.0)]


@pytest.mark.skipif(not admission.supported(), reason="rq 2.x has no RateLimit: jobs requeue")
def test_jobs_parked_behind_a_hot_resource_count_as_contention(rconn):
    """With admission a job waits parked in RQ and its own acquire finds the lock free: a hot
    key (30 jobs waiting up to 7 s each) showed 0% contention on the dashboard."""
    from django.contrib.auth.models import User
    from django.test import Client

    from django_joblock.testing import run_jobs

    delayed = [jobs.hold_resource.delay(7, f"hot-{n}", 0.0) for n in range(3)]
    assert [job.get_status(refresh=True) for job in delayed[1:]] == ["rate_limited"] * 2
    assert run_jobs("default").statuses() == {job.id: JobStatus.FINISHED for job in delayed}
    hour = metrics.window(3600)
    assert (hour.total("parked", "res"), hour.total("acquire_attempts", "res")) == (2, 3)
    client = Client()
    client.force_login(User.objects.create_superuser("hot", password="pw"))
    page = client.get("/admin/django_joblock/dashboard/").content.decode()
    assert "67% (2/3)" in page, "the family's contention bar"


def test_the_busy_share_of_a_job_type_never_passes_100_percent():
    """A job parked behind a busy resource whose own acquire then found it busy again counted
    twice over one acquire: a "busy 200%" row on the dashboard."""
    from django_joblock import metrics
    from django_joblock.monitor import dashboard

    hour = metrics.Series(
        {
            "acquire_attempts|order|shop.refund": 1,
            "contended|order|shop.refund": 1,
            "parked|order|shop.refund": 1,
            "acquire_attempts|report|shop.report": 4,
            "contended|report|shop.report": 1,
        }
    )
    rows = {row["func"]: row["busy"] for row in dashboard.job_types(hour)}
    assert rows == {"shop.refund": "100%", "shop.report": "25%"}
    assert hour.busy("order") == 1 and hour.busy("report") == 1
