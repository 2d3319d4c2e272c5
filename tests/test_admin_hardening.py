"""Bugs found by a hostile pass over the admin pages and the commands (each test failed before
its fix): a token-shaped owner in the release form, row limits that the locks of running jobs
broke, filters that hid dead holders from "Stuck jobs", changelist lookups the database cannot
run, and commands that answered a down Redis or an out-of-range number with a traceback."""

from __future__ import annotations

import json
import re
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client

from django_joblock.locks.keys import owner_hash
from django_joblock.monitor import dashboard
from tests import jobs
from tests.harness import dead_holder, wait_for
from tests.test_admin import DASHBOARD, RELEASE, held_lock, user

pytestmark = pytest.mark.django_db(transaction=True)


def _superuser() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    return client


def test_a_token_shaped_owner_is_a_plain_400_and_releases_nothing(rconn):
    held = held_lock("order:1")
    client = user("ops", can_release=True)
    client.get(RELEASE, {"resource": "order:1", "owner": owner_hash(held.token)})  # CSRF cookie
    token = client.cookies["csrftoken"].value
    for method, data in (
        (client.get, {"resource": "order:1", "owner": held.token}),
        (client.post, {"resource": "order:1", "owner": held.token, "reason": "x"}),
    ):
        response = method(RELEASE, {**data, "csrfmiddlewaretoken": token})
        assert response.status_code == 400, (method, response.status_code)
    assert response["Content-Type"].startswith("text/plain")
    assert b"12-character owner hash" in response.content
    assert rconn.exists(held.key) and held.held
    held.release()


@pytest.mark.slow
def test_the_lock_table_keeps_its_limit_and_its_count(crew, rconn, monkeypatch):
    crew.start()
    crew.start()
    running = [jobs.hold_outside_db.delay(n, f"limit{n}", 30.0) for n in (1, 2)]
    assert wait_for(lambda: rconn.llen("test:started") == 2, 30), crew.logs()
    assert wait_for(lambda: rconn.zcard("joblock:active:res") == 2, 5), "both are indexed"
    out = StringIO()
    call_command("joblock_locks", "--family", "res", "--limit", "1", "--json", stdout=out)
    rows = json.loads(out.getvalue())
    assert len(rows) == 1, [row["resource"] for row in rows]
    monkeypatch.setattr(dashboard, "LOCK_ROWS", 1)
    page = _superuser().get(DASHBOARD, {"family": "res"}).content.decode()
    shown = re.search(r'id="jl-shown">([^<]*)', page)
    assert shown is not None and shown.group(1).startswith("showing 1 of 2 active locks"), shown
    for job in running:
        job.cancel()


@pytest.mark.slow
def test_a_filter_does_not_hide_a_dead_holder_from_stuck_jobs(rconn):
    dead_holder("order:dead", rconn)
    client = _superuser()
    for query in ({}, {"health": "healthy"}, {"family": "order", "health": "healthy"}):
        page = client.get(DASHBOARD, query).content.decode()
        stuck = page[page.index('id="jl-stuck"') :]
        assert "Lock whose holder is gone" in stuck and "order:dead" in stuck, query
    assert "Nothing stuck." not in page


@pytest.mark.parametrize(
    "url",
    [
        "/admin/django_joblock/idempotencyrecord/?key__regex=(",
        "/admin/django_joblock/idempotencyrecord/?created_at__year=-1",
        "/admin/django_joblock/lockaudit/?holder__contains=1",
        "/admin/django_joblock/lockaudit/?holder__worker__contains=x",
        "/admin/django_joblock/outboxmessage/?key__iregex=[",
    ],
)
def test_changelist_lookups_the_database_cannot_run_are_a_400(url):
    response = _superuser().get(url)
    assert response.status_code == 400, (url, response.status_code)


def test_an_integer_past_64_bits_is_never_a_server_error():
    # SQLite cannot bind it (a 400 here); Django leaves it out of PostgreSQL's query (no rows)
    client = _superuser()
    for url in (
        "/admin/django_joblock/idempotencyrecord/?attempts__in=99999999999999999999",
        "/admin/django_joblock/idempotencyrecord/?attempts__gte=99999999999999999999",
    ):
        response = client.get(url)
        assert response.status_code in (200, 400), (url, response.status_code)
        if response.status_code == 200:
            assert "0 idempotency records" in response.content.decode(), url


def test_plain_changelist_lookups_still_work():
    client = _superuser()
    for url in (
        "/admin/django_joblock/idempotencyrecord/?attempts__gte=2",
        "/admin/django_joblock/idempotencyrecord/?key__startswith=refund",
        "/admin/django_joblock/lockaudit/?released__exact=1",
    ):
        assert client.get(url).status_code == 200, url


@pytest.mark.parametrize(
    "argv",
    [
        ["joblock_locks"],
        ["joblock_alerts"],
        ["joblock_doctor", "--resource", "order:3"],
    ],
)
def test_commands_name_a_redis_that_does_not_answer(settings, argv):
    settings.JOBLOCK = {"REDIS_ALIAS": "down"}
    with pytest.raises(CommandError, match="Redis does not answer"):
        call_command(*argv, stdout=StringIO())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["joblock_locks", "--limit", "99999999999999999999"], "--limit must be 1 to"),
        (["joblock_outbox", "--limit", "99999999999999999999"], "--limit must be at most"),
        # a database error (a LIMIT past 64 bits) before
        (["joblock_purge", "--batch-size", "99999999999999999999"], "--batch-size must be 1 to"),
        (["joblock_doctor", "--job", "<script>"], "--job '<script>'"),
        # argparse took a value equal to the old "" default for no value at all
        (["joblock_doctor", "--job", ""], "--job is empty"),
        (["joblock_doctor", "--resource", " "], "--resource is empty"),
        (["joblock_doctor", "--key", "a\x00b"], "--key contains NUL"),  # a DataError before
        (["joblock_doctor", "--key", "k", "--scope", "\x00"], "--scope contains NUL"),
    ],
)
def test_out_of_range_command_arguments_are_named(rconn, argv, message):
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command(*argv, stdout=StringIO())


def test_the_metrics_view_answers_503_when_redis_is_down(settings, admin_client):
    settings.JOBLOCK = {"REDIS_ALIAS": "down"}
    response = admin_client.get("/joblock/metrics/")
    assert response.status_code == 503 and b"Redis does not answer" in response.content


def test_the_doctor_finds_a_keys_scope_through_the_scope_key_index(rconn):
    """``--key`` without ``--scope`` filtered the records on the key alone: a sequential scan
    of the whole table (287 ms at a million records). Every records query names its scopes."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_joblock import idempotent

    with idempotent("credit:D-1", scope=jobs.credit.spec.scope) as claim:
        claim.succeed({"ok": True})
    with CaptureQueriesContext(connection) as queries:
        out = StringIO()
        call_command("joblock_doctor", "--key", "credit:D-1", stdout=out)
    assert "credit:D-1" in out.getvalue()
    on_records = [q["sql"] for q in queries if "idempotencyrecord" in q["sql"]]
    assert on_records and all('"scope"' in sql.split("WHERE", 1)[1] for sql in on_records)


def test_changelists_never_read_distinct_values_of_the_whole_table(rconn):
    """``list_filter`` on scope (records) and handler (outbox) ran ``SELECT DISTINCT`` over the
    whole table on every page (221-292 ms at a million records). The filters still work."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_joblock import idempotent

    with idempotent("credit:F-1", scope=jobs.credit.spec.scope) as claim:
        claim.succeed({"ok": True})
    with idempotent("other:F-2", scope="custom") as claim:
        claim.succeed({"ok": True})
    client = Client()
    client.force_login(User.objects.create_superuser("filters", password="pw"))
    records = "/admin/django_joblock/idempotencyrecord/"
    for url in (records, "/admin/django_joblock/outboxmessage/"):
        with CaptureQueriesContext(connection) as queries:
            assert client.get(url).status_code == 200
        whole = [q["sql"] for q in queries if "DISTINCT" in q["sql"] and "WHERE" not in q["sql"]]
        assert not whole, whole
    page = client.get(records).content.decode()
    assert f"?scope={jobs.credit.spec.scope}" in page, "the known scopes are offered"
    filtered = client.get(records, {"scope": "custom"}).content.decode()
    assert "other:F-2" in filtered and "credit:F-1" not in filtered, "any scope by URL"


def _delivery(job_id: str, started: float) -> str:
    return json.dumps(
        {
            "job_id": job_id,
            "func": "tests.jobs.hold_resource",
            "key": "",
            "resource": "order:9",
            "worker": "w1",
            "host": "h",
            "pid": 1,
            "started": started,
            "took": 0.5,
            "outcome": "succeeded",
        }
    )


def test_the_doctor_leaves_out_a_run_no_clock_can_show(rconn):
    """A history entry started at 1e308 crashed ``joblock_doctor`` (OverflowError from
    ``time.gmtime``): an entry outside the years a clock shows is left out, as an odd one."""
    rconn.rpush("joblock:runs:order", _delivery("fine-1", 1_700_000_000.0))
    rconn.rpush("joblock:runs:order", _delivery("odd-1", 1e308))
    out = StringIO()
    call_command("joblock_doctor", "--resource", "order:9", stdout=out)
    assert "job fine-1" in out.getvalue(), "negative control: the history is read"
    assert "odd-1" not in out.getvalue()


def test_the_doctor_finds_a_job_rq_expired_by_its_idempotency_record(rconn):
    """``--job`` failed once RQ expired the job (after its result_ttl); the record its run left
    names its key and resource."""
    from django.utils import timezone

    from django_joblock import IdempotencyRecord

    now = timezone.now()
    IdempotencyRecord.objects.create(
        scope="tests.jobs.refund",
        key="refund:R-9",
        status="succeeded",
        rq_job_id="expired-job-1",
        lock_resource="order:9",
        created_at=now,
        updated_at=now,
        expires_at=now,
    )
    out = StringIO()
    call_command("joblock_doctor", "--job", "expired-job-1", stdout=out)
    assert "refund:R-9" in out.getvalue()
    with pytest.raises(CommandError, match="no idempotency record of it: look it up with"):
        call_command("joblock_doctor", "--job", "never-was-1", stdout=StringIO())
