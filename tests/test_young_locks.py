"""Locks whose holder died before the active-lock index listed them (issue 17, item 4): a work
horse SIGKILLed right after its acquire, well inside the index's 0.5 s delay. The index does
not list its lock (the negative control); ``joblock_locks``, the dashboard and ``joblock_reap``
find it from RQ's side, judge its holder dead and release it."""

from __future__ import annotations

import json
import os
import signal
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from rq.job import JobStatus

from django_joblock import monitoring
from django_joblock.models import LockAudit
from tests import jobs
from tests.harness import wait_for
from tests.workers import wait_status

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_lock_whose_horse_died_young_is_listed_judged_dead_and_reaped(crew, rconn):
    crew.start()
    job = jobs.hold_young.delay(1, "young", 30.0)
    assert wait_for(lambda: rconn.get("test:pid:young"), 20, interval=0.002), crew.logs()
    os.kill(int(rconn.get("test:pid:young")), signal.SIGKILL)  # within ms of its acquire
    assert wait_status(job, {JobStatus.FAILED}, 20, crew) is JobStatus.FAILED
    key = "joblock:{young:1}:lock"
    assert rconn.exists(key), "the dead horse's lock lives on until its TTL"
    assert not [row for row in monitoring.active_locks() if row.resource == "young:1"], (
        "negative control: the index never listed it"
    )
    out = StringIO()
    call_command("joblock_locks", "--json", stdout=out)
    rows = {row["resource"]: row for row in json.loads(out.getvalue())}
    assert rows["young:1"]["job_id"] == job.id, rows
    assert rows["young:1"]["health"] == "holder dead", rows["young:1"]
    client = Client()
    client.force_login(User.objects.create_superuser("ops", password="pw"))
    page = client.get("/admin/django_joblock/dashboard/").content.decode()
    assert "young:1" in page and "holder dead" in page
    out = StringIO()
    call_command("joblock_reap", stdout=out)
    assert "young:1" in out.getvalue(), out.getvalue()
    assert not rconn.exists(key), "reaped before its TTL"
    assert LockAudit.objects.get(resource="young:1").action == "reap"
