"""A lock with a limit (``lock(resource, limit=N)``) as operators see it: the dashboard's row per
holder with its slot and the resource's use ("slot 1 · 3/3 held"), a force release (admin,
``joblock_release --slot``, ``joblock_reap``) that frees one slot and leaves the others, the
slot in the audit row, ``joblock_locks`` and the doctor listing every holder. Real Redis, real
database, real lock holders."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import CommandError, call_command

from django_joblock import Lock, lock
from django_joblock.locks.keys import LockKeys
from django_joblock.models import LockAudit
from django_joblock.monitor.doctor import diagnose, render
from tests.harness import ROOT, wait_for
from tests.test_admin import DASHBOARD, RELEASE, csrf_post, held_lock, user

pytestmark = pytest.mark.django_db(transaction=True)


def holders(resource: str, count: int, limit: int = 3, **options: Any) -> list[Lock]:
    """``count`` holders of ``resource`` (a lock with ``limit``), in slots 0..count-1, each in
    the active-lock index."""
    held = [lock(resource, limit=limit, ttl=30, **options) for _ in range(count)]
    assert all(each.acquire(wait=0) for each in held)
    assert sorted(each.slot for each in held) == list(range(count))
    family = resource.split(":", 1)[0]
    assert wait_for(lambda: _indexed(family) >= count, 3.0)
    return sorted(held, key=lambda each: each.slot)


def _indexed(family: str) -> int:
    from django_redis import get_redis_connection

    return int(get_redis_connection("default").zcard(f"joblock:active:{family}"))


def _lock_rows(page: str) -> list[str]:
    """The rows of the dashboard's active-lock table, as HTML."""
    table = page[page.index('id="jl-locks"') :].split("</table>")[0]
    return table.split("<tr")[2:]  # past the header row


def _row_of(page: str, resource: str, slot: int) -> str:
    (row,) = [
        row
        for row in _lock_rows(page)
        if f">{resource}<" in row and (f"slot {slot} ·" in row or "jl-slot" not in row)
    ]
    return row


def test_the_dashboard_shows_each_holder_with_its_slot_and_the_use(rconn):
    held = holders("api:m", 3)
    plain = held_lock("order:1")
    operator = user("operator", can_release=True)
    page = operator.get(DASHBOARD).content.decode()
    for each in held:
        row = _row_of(page, "api:m", each.slot)
        assert f"slot {each.slot} · 3/3 held" in row, row
        assert each.owner in row
        link = re.search(r'class="jl-release" href="([^"]+)"', row)
        assert link is not None
        expected = f"&amp;slot={each.slot}" if each.slot else ""
        assert link.group(1).endswith(f"owner={each.owner}{expected}"), link.group(1)
    # A plain lock's row is as it always was: no slot, no use.
    (plain_row,) = [row for row in _lock_rows(page) if ">order:1<" in row]
    assert "jl-slot" not in plain_row and "slot=" not in plain_row
    held[1].release()
    page = operator.get(DASHBOARD).content.decode()
    assert "slot 2 · 2/3 held" in _row_of(page, "api:m", 2)
    assert "slot 1 ·" not in page
    for each in (held[0], held[2], plain):
        assert each.release()


def test_the_admin_force_release_of_slot_1_releases_that_holder_only(rconn):
    held = holders("api:m", 3)
    operator = user("operator", can_release=True)
    confirm = operator.get(RELEASE, {"resource": "api:m", "owner": held[1].owner, "slot": "1"})
    assert confirm.status_code == 200
    body = confirm.content.decode()
    assert "slot 1 of the 3 it allows at once" in body and held[1].owner in body
    assert '<input type="hidden" name="slot" value="1">' in body
    assert all(rconn.exists(each.key) for each in held), "GET never mutates"
    data = {"resource": "api:m", "owner": held[1].owner, "slot": "1", "reason": "wedged, OPS-45"}
    response = csrf_post(operator, RELEASE, data)
    assert response.status_code == 302
    assert not rconn.exists(held[1].key)
    assert rconn.exists(held[0].key) and rconn.exists(held[2].key), "the others keep theirs"
    assert held[0].renew() and held[2].renew()
    audit = LockAudit.objects.get()
    assert (audit.released, audit.resource, audit.owner) == (True, "api:m", held[1].owner)
    assert audit.holder["slot"] == "1" and audit.holder["limit"] == "3"
    assert audit.holder["pid"] == str(os.getpid()) and audit.reason == "wedged, OPS-45"
    assert "api:m (slot 1)" in LogEntry.objects.get().change_message
    assert held[1].release() is False, "the released holder finds its slot gone"
    # The slot is compared like the owner: slot 0's owner named with slot 2 is refused.
    data = {"resource": "api:m", "owner": held[0].owner, "slot": "2", "reason": "wrong slot"}
    assert csrf_post(operator, RELEASE, data).status_code == 302
    refused = LockAudit.objects.latest("pk")
    assert refused.released is False and "changed owner" in refused.outcome
    assert refused.holder["slot"] == "2"
    assert rconn.exists(held[0].key) and rconn.exists(held[2].key)
    held[0].release()
    held[2].release()


# The last is an Arabic-Indic digit one, which int() would take.
@pytest.mark.parametrize("slot", ["100", "-1", "x", "1.5", "\u0661"])
def test_a_bad_slot_in_the_release_form_is_a_plain_400(rconn, slot):
    held = holders("api:m", 2)
    operator = user("operator", can_release=True)
    response = operator.get(RELEASE, {"resource": "api:m", "owner": held[1].owner, "slot": slot})
    assert response.status_code == 400
    assert response["Content-Type"].startswith("text/plain")
    assert "slot" in response.content.decode()
    assert all(rconn.exists(each.key) for each in held) and LockAudit.objects.count() == 0
    for each in held:
        each.release()


def test_joblock_release_slot_2_releases_slot_2_only(rconn):
    held = holders("api:m", 3)
    out = StringIO()
    call_command("joblock_release", "api:m", "--slot", "2", "--reason", "x", stdout=out)
    assert out.getvalue().strip() == "api:m slot 2: released"
    assert not rconn.exists(held[2].key)
    assert rconn.exists(held[0].key) and rconn.exists(held[1].key)
    audit = LockAudit.objects.get()
    assert audit.released and audit.owner == held[2].owner and audit.holder["slot"] == "2"
    # A free slot: refused, audited with the slot asked for, exit status 1.
    with pytest.raises(SystemExit):
        call_command("joblock_release", "api:m", "--slot", "2", "--reason", "x", stdout=StringIO())
    refused = LockAudit.objects.latest("pk")
    assert not refused.released and refused.holder == {"slot": "2"}
    assert rconn.exists(held[0].key) and rconn.exists(held[1].key)
    # Without --slot: slot 0, a plain lock's, as before.
    call_command("joblock_release", "api:m", "--reason", "x", stdout=StringIO())
    assert not rconn.exists(held[0].key) and rconn.exists(held[1].key)
    held[1].release()


@pytest.mark.parametrize("slot", ["100", "-1"])
def test_joblock_release_refuses_a_slot_out_of_range(rconn, slot):
    held = holders("api:m", 2)
    with pytest.raises(CommandError, match=r"--slot must be an int in 0\.\.99"):
        call_command("joblock_release", "api:m", "--slot", slot, "--reason", "x")
    assert all(rconn.exists(each.key) for each in held) and LockAudit.objects.count() == 0
    for each in held:
        each.release()


def test_force_release_refuses_a_bad_slot_naming_it(rconn):
    from django_joblock.monitor.control import force_release

    for slot in (100, -1, True, "1"):
        with pytest.raises(ValueError, match="slot must be an int"):
            force_release("api:m", reason="x", slot=slot)  # type: ignore[arg-type]
    assert LockAudit.objects.count() == 0


def test_joblock_locks_lists_each_holders_slot_and_the_limit(rconn):
    held = holders("api:m", 3)
    plain = held_lock("order:1")
    out = StringIO()
    call_command("joblock_locks", "--json", stdout=out)
    rows = json.loads(out.getvalue())
    by_slot = {row["slot"]: row for row in rows if row["resource"] == "api:m"}
    assert sorted(by_slot) == [0, 1, 2]
    assert all(row["limit"] == 3 for row in by_slot.values())
    assert {slot: row["owner"] for slot, row in by_slot.items()} == {
        each.slot: each.owner for each in held
    }
    assert all(row["health"] == "healthy" for row in rows)
    (plain_row,) = [row for row in rows if row["resource"] == "order:1"]
    assert (plain_row["slot"], plain_row["limit"]) == (0, 1)
    out = StringIO()
    call_command("joblock_locks", stdout=out)
    lines = out.getvalue().splitlines()
    assert sorted(re.search(r"slot \d/3", line)[0] for line in lines if "api:m" in line) == [
        "slot 0/3",
        "slot 1/3",
        "slot 2/3",
    ]
    (plain_line,) = [line for line in lines if line.startswith("order:1 ")]
    assert "slot" not in plain_line
    for each in (*held, plain):
        each.release()


def test_markup_in_a_holders_fields_is_escaped(rconn):
    held = holders("api:m", 2)
    rconn.hset(held[1].key, mapping={"host": "<b>h</b>", "worker": "<script>w</script>"})
    operator = user("operator", can_release=True)
    page = operator.get(DASHBOARD).content.decode()
    row = _row_of(page, "api:m", 1)
    assert "&lt;b&gt;h&lt;/b&gt;" in row and "&lt;script&gt;w&lt;/script&gt;" in row
    assert "<b>h</b>" not in page and "<script>w</script>" not in page
    confirm = operator.get(RELEASE, {"resource": "api:m", "owner": held[1].owner, "slot": "1"})
    body = confirm.content.decode()
    assert "&lt;b&gt;h&lt;/b&gt;" in body and "<b>h</b>" not in body
    for each in held:
        each.release()


def test_the_doctor_lists_every_holder_of_a_resource(rconn):
    held = holders("api:m", 3)
    held[0].release()  # slot 0 free: the others are still found, through the index
    story = render(diagnose(resource="api:m"))
    assert "resource 'api:m': 2 of its 3 slots held now" in story, story
    for each in held[1:]:
        assert f"slot {each.slot}: held by " in story
    assert "slot 0:" not in story
    plain = held_lock("order:1")
    story = render(diagnose(resource="order:1"))
    assert "resource 'order:1': held now by " in story and "slot" not in story
    for each in (held[1], held[2], plain):
        each.release()
    assert "resource 'api:m': free now" in render(diagnose(resource="api:m"))


def test_the_long_hold_alert_names_the_holders_slot(rconn, settings):
    from django_joblock import metrics
    from django_joblock.monitor.alerts import evaluate

    for _ in range(30):  # the family's usual hold: a tenth of a second
        metrics.observe("hold_seconds", "api", "", 0.1)
    metrics.flush_now()
    held = holders("api:m", 3)
    for each in held[1:]:  # acquired a minute ago, by the server's clock
        rconn.hincrby(each.key, "acquired_ms", -60_000)
    (alert,) = [alert for alert in evaluate() if alert.name == "long_hold"]
    assert alert.family == "api" and alert.message.startswith("2 lock(s) held far longer")
    assert re.search(r"longest api:m slot [12] of 3 for \d+s", alert.message), alert.message
    for each in held:
        each.release()


@pytest.mark.slow
def test_reap_releases_a_dead_holders_own_slot(rconn):
    """Two live holders in slots 0 and 1; a process takes slot 2 without heartbeat and is
    SIGKILLed: the reap frees slot 2 and only it."""
    live = holders("api:r", 2)
    code = (
        "import django, time; django.setup()\n"
        "from django_joblock import lock\n"
        "held = lock('api:r', limit=3, ttl=60, heartbeat=False); held.acquire()\n"
        "print(held.slot, flush=True); time.sleep(600)\n"
    )
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "2"
        assert wait_for(lambda: _indexed("api") == 3, 5)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    dead_key = LockKeys("joblock", "api:r").slot_key(2)
    out = StringIO()
    call_command("joblock_reap", "--dry-run", stdout=out)
    assert "api:r slot 2 of 3: would release" in out.getvalue() and rconn.exists(dead_key)
    out = StringIO()
    call_command("joblock_reap", stdout=out)
    assert "api:r slot 2 of 3: released" in out.getvalue(), out.getvalue()
    assert "1 lock(s) with a dead holder." in out.getvalue()
    assert not rconn.exists(dead_key)
    assert all(rconn.exists(each.key) and each.held for each in live), "live holders stay"
    audit = LockAudit.objects.get()
    assert audit.action == "reap" and audit.holder["slot"] == "2"
    assert audit.holder["pid"] == str(proc.pid)
    for each in live:
        assert each.release()
