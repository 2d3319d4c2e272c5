"""The "Job locks" admin page, audited force release, and the lock commands."""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time
from io import StringIO

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import Client

from django_joblock import lock, metrics
from django_joblock.models import LockAudit
from tests.harness import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

DASHBOARD = "/admin/django_joblock/dashboard/"
RELEASE = "/admin/django_joblock/dashboard/release/"


def user(name: str, *, staff: bool = True, can_release: bool = False) -> Client:
    account = User.objects.create_user(name, password="pw", is_staff=staff)
    if can_release:
        account.user_permissions.add(Permission.objects.get(codename="force_release_lock"))
    client = Client(enforce_csrf_checks=True)
    client.force_login(account)
    return client


def held_lock(resource: str = "order:1", ttl: float = 30):  # type: ignore[no-untyped-def]
    held = lock(resource, ttl=ttl)
    assert held.acquire()
    assert wait_for(lambda: held.held and _indexed(held), 3.0)
    return held


def _indexed(held) -> bool:  # type: ignore[no-untyped-def]
    from django_joblock.monitor.active import active_locks

    return any(row.resource == held.resource for row in active_locks())


def csrf_post(client: Client, url: str, data: dict[str, str]):  # type: ignore[no-untyped-def]
    page = client.get(url, {k: v for k, v in data.items() if k != "reason"})
    token = (
        page.cookies["csrftoken"].value
        if "csrftoken" in page.cookies
        else (client.cookies["csrftoken"].value)
    )
    return client.post(url, {**data, "csrfmiddlewaretoken": token})


def test_job_type_table_escapes_what_it_shows(rconn):
    """The per-job-type table shows metric labels as text, never as markup."""
    metrics.count("requeued", "order", "<b>evil</b>.job", n=3)
    metrics.flush_now()
    page = user("viewer").get(DASHBOARD).content.decode()
    table = page[page.index('id="jl-job-types"') :].split("</table>")[0]
    assert "&lt;b&gt;evil&lt;/b&gt;.job" in table and "<b>evil</b>" not in table


def test_anonymous_gets_the_login_page():
    response = Client().get(DASHBOARD)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_staff_without_permission_sees_but_cannot_release(rconn):
    held = held_lock()
    viewer = user("viewer")
    page = viewer.get(DASHBOARD)
    assert page.status_code == 200
    assert b"order:1" in page.content and b"Force release" not in page.content
    assert viewer.get(RELEASE, {"resource": "order:1", "owner": held.owner}).status_code == 403
    assert (
        viewer.post(
            RELEASE, {"resource": "order:1", "owner": held.owner, "reason": "x"}
        ).status_code
        == 403
    )
    assert held.held and LockAudit.objects.count() == 0
    held.release()


def test_non_staff_is_refused():
    response = user("outsider", staff=False).get(DASHBOARD)
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_permitted_user_releases_with_reason_audit_and_log_entry(rconn):
    held = held_lock()
    operator = user("operator", can_release=True)
    assert b"Force release" in operator.get(DASHBOARD).content
    confirm = operator.get(RELEASE, {"resource": "order:1", "owner": held.owner})
    assert confirm.status_code == 200 and held.owner.encode() in confirm.content
    assert rconn.exists(held.key), "GET never mutates"
    response = csrf_post(
        operator,
        RELEASE,
        {"resource": "order:1", "owner": held.owner, "reason": "worker wedged, ticket OPS-12"},
    )
    assert response.status_code == 302
    assert not rconn.exists(held.key)
    audit = LockAudit.objects.get()
    assert (audit.released, audit.resource, audit.owner) == (True, "order:1", held.owner)
    assert audit.reason == "worker wedged, ticket OPS-12" and audit.actor == "operator"
    assert audit.user is not None and audit.holder["pid"] == str(os.getpid())
    entry = LogEntry.objects.get()
    assert "order:1" in entry.change_message and entry.user.username == "operator"
    assert held.release() is False, "the original holder finds it gone"


def test_reason_is_required(rconn):
    held = held_lock()
    operator = user("operator", can_release=True)
    response = csrf_post(
        operator, RELEASE, {"resource": "order:1", "owner": held.owner, "reason": "   "}
    )
    assert response.status_code == 200 and b"A reason is required" in response.content
    assert rconn.exists(held.key) and LockAudit.objects.count() == 0
    held.release()


def test_csrf_is_enforced(rconn):
    held = held_lock()
    operator = user("operator", can_release=True)
    response = operator.post(
        RELEASE, {"resource": "order:1", "owner": held.owner, "reason": "no token"}
    )
    assert response.status_code == 403
    assert rconn.exists(held.key)
    held.release()


def test_lock_that_changed_owner_since_the_page_is_refused(rconn):
    first = held_lock()
    operator = user("operator", can_release=True)
    shown_owner = first.owner
    assert operator.get(RELEASE, {"resource": "order:1", "owner": shown_owner}).status_code == 200
    rconn.delete(first.key)  # the first holder's lock vanished ...
    second = lock("order:1", ttl=30)
    assert second.acquire()  # ... and someone else holds it now
    response = csrf_post(
        operator, RELEASE, {"resource": "order:1", "owner": shown_owner, "reason": "stale page"}
    )
    assert response.status_code == 302
    assert rconn.hget(second.key, "token").decode() == second.token, "the new owner keeps it"
    audit = LockAudit.objects.get()
    assert audit.released is False and "changed owner" in audit.outcome
    assert LogEntry.objects.count() == 0
    second.release()


def test_audit_rows_are_append_only(rconn):
    held = held_lock()
    call_command("joblock_release", "order:1", "--reason", "cli", stdout=StringIO())
    audit = LockAudit.objects.get()
    with pytest.raises(ValueError, match="append-only"):
        audit.reason = "rewritten"
        audit.save()
    with pytest.raises(ValueError, match="append-only"):
        audit.delete()
    assert held.release() is False


def test_joblock_release_command_with_owner_or_token(rconn):
    held = held_lock()
    with pytest.raises(SystemExit):
        call_command(
            "joblock_release", "order:1", "--reason", "r", "--owner", "0" * 12, stdout=StringIO()
        )
    with pytest.raises(SystemExit):
        call_command(
            "joblock_release", "order:1", "--reason", "r", "--token", "0" * 32, stdout=StringIO()
        )
    with pytest.raises(CommandError, match="12-character owner hash"):
        call_command("joblock_release", "order:1", "--reason", "r", "--owner", held.token)
    with pytest.raises(CommandError, match="not both"):
        call_command(
            "joblock_release", "order:1", "--reason", "r", "--owner", held.owner, "--token", "x"
        )
    assert rconn.exists(held.key)
    out = StringIO()
    call_command("joblock_release", "order:1", "--reason", "r", "--owner", held.owner, stdout=out)
    assert "released" in out.getvalue() and not rconn.exists(held.key)
    assert LockAudit.objects.filter(released=True).count() == 1
    again = held_lock()
    out = StringIO()
    call_command("joblock_release", "order:1", "--reason", "r", "--token", again.token, stdout=out)
    assert "released" in out.getvalue() and not rconn.exists(again.key)


def test_joblock_locks_json_lists_documented_fields(rconn):
    held = held_lock("tenant:7:cache")
    out = StringIO()
    call_command("joblock_locks", "--json", stdout=out)
    rows = json.loads(out.getvalue())
    assert [row["resource"] for row in rows] == ["tenant:7:cache"]
    expected = {
        "resource",
        "family",
        "owner",
        "fence",
        "host",
        "pid",
        "job_id",
        "job_func",
        "worker",
        "acquired_ms",
        "renewed_ms",
        "renewals",
        "ttl_ms",
        "pttl_ms",
        "held_for",
        "slot",
        "limit",
        "health",
        "why",
    }
    assert set(rows[0]) == expected
    assert rows[0]["owner"] == held.owner and rows[0]["health"] == "healthy"
    assert (rows[0]["slot"], rows[0]["limit"]) == (0, 1)
    assert held.token not in out.getvalue()
    out = StringIO()
    call_command("joblock_locks", "--json", "--stuck", stdout=out)
    assert json.loads(out.getvalue()) == []
    held.release()


@pytest.mark.slow
def test_reap_releases_dead_holders_and_leaves_live_ones(rconn):
    """A process takes a lock without heartbeat and is SIGKILLed; a live one keeps its own."""
    code = (
        "import django, os, sys, time; django.setup()\n"
        "from django_joblock import lock\n"
        "held = lock('order:dead', ttl=60, heartbeat=False); held.acquire()\n"
        "print('held', flush=True); time.sleep(600)\n"
    )
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings")
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        live = held_lock("order:live", ttl=30)
        # Both holders are in the active-lock index (the dead one's renewal thread wrote it).
        assert wait_for(lambda: rconn.zcard("joblock:active:order") == 2, 3.0)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        time.sleep(0.1)
        out = StringIO()
        call_command("joblock_reap", stdout=out)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "order:dead: released" in out.getvalue()
    assert not rconn.exists("joblock:{order:dead}:lock")
    assert rconn.exists(live.key) and live.held, "a live holder is left alone"
    audit = LockAudit.objects.get()
    assert audit.action == "reap" and audit.resource == "order:dead"
    assert audit.actor == f"joblock_reap ({getpass.getuser()})", "the command and the OS user"
    live.release()


@pytest.mark.slow
def test_reap_of_a_holder_with_a_long_job_id_keeps_its_evidence_short(crew, rconn):
    """The evidence of a dead holder names its RQ job id, which has no length limit: past
    MAX_REASON characters the reap raised ValueError (a traceback) and stopped, reaping
    neither that lock nor the next. Now the audited reason is the evidence cut to fit."""
    from tests import jobs
    from tests.harness import dead_holder
    from tests.workers import pid_of

    dead_holder("order:dead", rconn)
    crew.start(simple=True)
    long_id = "j" * 2100
    job = jobs.hold_steadily.enqueue(resource_id=7, label="long", seconds=600, job_id=long_id)
    pid_of(rconn, "long")
    assert wait_for(lambda: rconn.zcard("joblock:active:res") == 1, 5), "never indexed"
    os.kill(crew.procs[0].pid, signal.SIGKILL)  # the simple worker ran the job itself
    crew.procs[0].wait(10)
    rconn.delete(job.key)  # RQ expired the job: its id is the evidence
    out = StringIO()
    call_command("joblock_reap", stdout=out)
    assert "2 lock(s) with a dead holder." in out.getvalue(), out.getvalue()
    assert not rconn.exists("joblock:{res:7}:lock"), "the holder with the long job id"
    assert not rconn.exists("joblock:{order:dead}:lock"), "and the next one"
    audit = LockAudit.objects.get(resource="res:7")
    assert audit.released and len(audit.reason) == 2000 and audit.reason.endswith("…")
    assert audit.reason.startswith(f"holder dead: RQ job {'j' * 100}")


def test_the_dashboard_draws_its_charts_with_use_tz_off(rconn, settings):
    """With USE_TZ = False, timezone.now() is naive: the time axis's title passed it to
    localtime(), so any minute chart with data made the dashboard a 500. Its labels are in
    TIME_ZONE, and the axis says so."""
    settings.USE_TZ = False
    settings.TIME_ZONE = "Asia/Jakarta"
    metrics.count("requeued", "order", "tests.jobs.some_job", n=3)
    metrics.flush_now()
    response = user("viewer").get(DASHBOARD)
    assert response.status_code == 200
    page = response.content.decode()
    assert "Requeues for contention per minute" in page and "time (WIB)" in page


def test_a_force_release_on_a_second_admin_site_returns_to_that_sites_dashboard(rconn, settings):
    """Review bug: after a force release the page went back to the default admin site's
    dashboard (``/admin/...``), not to the site it was made on (an operators' ``/ops/`` site,
    whose users may have no access to the other)."""
    settings.ROOT_URLCONF = "tests.urls_two_sites"
    held = held_lock()
    operator = user("operator", can_release=True)
    page = operator.get("/ops/django_joblock/dashboard/")
    assert (
        page.status_code == 200
        and "/ops/django_joblock/dashboard/release/" in page.content.decode()
    )
    data = {"resource": "order:1", "owner": held.owner, "reason": "stuck"}
    response = csrf_post(operator, "/ops/django_joblock/dashboard/release/", data)
    assert not rconn.exists(held.key), "negative control: released"
    assert response.status_code == 302
    assert response["Location"] == "/ops/django_joblock/dashboard/"


def test_a_reason_with_nul_is_refused_before_anything_is_released(rconn):
    """A NUL in the reason used to release the lock, then fail the audit insert (PostgreSQL
    text cannot hold NUL): a release without its audit row. Now refused first, both ways."""
    held = held_lock()
    with pytest.raises(CommandError, match="NUL"):
        call_command("joblock_release", "order:1", "--reason", "bad\x00reason", stdout=StringIO())
    operator = user("operator", can_release=True)
    data = {"resource": "order:1", "owner": held.owner, "reason": "admin\x00reason"}
    response = csrf_post(operator, RELEASE, data)
    assert response.status_code == 200 and b"NUL character" in response.content
    assert rconn.hget(held.key, "token").decode() == held.token, "still held"
    assert LockAudit.objects.count() == 0
    call_command("joblock_release", "order:1", "--reason", "fine", stdout=StringIO())
    assert LockAudit.objects.get().released is True and not rconn.exists(held.key)


def test_a_reason_of_a_megabyte_is_refused_before_anything_is_released(rconn):
    """A 1 MB reason was stored as is in the audit log; now more than MAX_REASON characters are
    refused, both ways, and nothing is released (at the limit it is kept whole)."""
    held = held_lock()
    huge = "x" * 1_000_000
    with pytest.raises(CommandError, match="1000000 characters long; at most 2000"):
        call_command("joblock_release", "order:1", "--reason", huge, stdout=StringIO())
    operator = user("operator", can_release=True)
    data = {"resource": "order:1", "owner": held.owner, "reason": huge}
    response = csrf_post(operator, RELEASE, data)
    assert response.status_code == 200 and b"at most 2000 are kept" in response.content
    assert rconn.hget(held.key, "token").decode() == held.token, "still held"
    assert LockAudit.objects.count() == 0
    call_command("joblock_release", "order:1", "--reason", "y" * 2000, stdout=StringIO())
    assert LockAudit.objects.get().reason == "y" * 2000
    assert not rconn.exists(held.key)
