"""The admin and operator actions as an attacker, an operator on a
bad day, and a Django user managing permissions would meet them."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from rq.job import JobStatus

from django_joblock import idempotent, lock
from django_joblock.models import IdempotencyRecord, LockAudit
from tests import seam_jobs
from tests.harness import dead_holder, wait_for
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = "/admin/django_joblock/dashboard/"
RELEASE = "/admin/django_joblock/dashboard/release/"
MARKUP = ['<svg/onload=alert("jl")>', '"><script>alert("jl")</script>']
PARAMETERS = [
    "resource",
    "owner",
    "slot",
    "reason",
    "family",
    "health",
    "q",
    "o",
    "p",
    "e",
    "status__exact",
    "scope__exact",
    "scope",
    "key",
    "action__exact",
    "released__exact",
    "_changelist_filters",
    "_popup",
    "_to_field",
]


def login(name: str, *, superuser: bool = False, perms: tuple[str, ...] = ()) -> Client:
    if superuser:
        account = User.objects.create_superuser(name, password="pw")
    else:
        account = User.objects.create_user(name, password="pw", is_staff=True)
    for codename in perms:
        account.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    client.force_login(account)
    return client


def joblock_admin_urls() -> list[str]:
    """Every URL of django-joblock's admin: app index, each model admin's views (objects
    filled in with a real row), the dashboard and its release view."""
    held = lock("order:1", ttl=30)
    assert held.acquire()
    with idempotent("refund:R-1") as claim:
        claim.succeed({"ok": True})
    from django_joblock.monitor.control import force_release

    other = lock("order:2", ttl=30)
    assert other.acquire()
    force_release("order:2", reason="setup", actor="test")
    objects = {
        IdempotencyRecord: IdempotencyRecord.objects.get().pk,
        LockAudit: LockAudit.objects.get().pk,
    }
    urls = [reverse("admin:app_list", kwargs={"app_label": "django_joblock"})]
    for model, model_admin in admin.site._registry.items():
        if model._meta.app_label != "django_joblock":
            continue
        for pattern in model_admin.get_urls():
            name = getattr(pattern, "name", None)
            if not name:
                continue
            converters = pattern.pattern.converters
            kwargs = {key: str(objects.get(model, 1)) for key in converters}
            urls.append(reverse(f"admin:{name}", kwargs=kwargs))
    assert DASHBOARD in urls and RELEASE in urls
    assert any("/idempotencyrecord/" in url and "/change/" in url for url in urls), urls
    return sorted(set(urls))


def _reflected(response: Any, payload: str) -> bool:
    """True when ``payload`` comes back as markup (unescaped in an HTML answer)."""
    body = response.content.decode(errors="replace")
    if payload not in body:
        return False
    return not response["Content-Type"].startswith("text/plain")


# -- item 3: reflected values are escaped -------------------------------------------------
def test_markup_in_any_parameter_of_any_admin_view_is_never_reflected(rconn):
    browser = login("root", superuser=True)
    urls = joblock_admin_urls()
    problems = []
    for url in urls:
        for payload in MARKUP:
            for name in PARAMETERS:
                response = browser.get(url, {name: payload})
                if _reflected(response, payload):
                    problems.append(f"GET {url}?{name}=... -> {response.status_code}")
            response = browser.get(url, {name: payload for name in PARAMETERS})
            if _reflected(response, payload):
                problems.append(f"GET {url} (all parameters) -> {response.status_code}")
    for payload in MARKUP:
        for data in (
            {"resource": payload, "owner": "0" * 12, "reason": "x"},
            {"resource": "order:1", "owner": payload, "reason": "x"},
            {"resource": "order:1", "owner": "0" * 12, "reason": payload},
            {"resource": "order:1", "owner": "0" * 12, "reason": "x", "slot": payload},
        ):
            response = browser.post(RELEASE, data, follow=True)
            if _reflected(response, payload):
                problems.append(f"POST {RELEASE} {sorted(data)} -> {response.status_code}")
    assert problems == [], "\n".join(problems)


def test_bad_parameters_get_a_plain_text_400_naming_them():
    browser = login("root", superuser=True)
    response = browser.get(RELEASE, {"resource": "<svg/onload=alert(1)>", "owner": "x"})
    assert response.status_code == 400 and response["Content-Type"].startswith("text/plain")
    assert response["X-Content-Type-Options"] == "nosniff"
    assert "Invalid lock resource" in response.content.decode()
    response = browser.get(DASHBOARD, {"family": "a b"})
    assert response.status_code == 400 and "Invalid family" in response.content.decode()
    response = browser.get(DASHBOARD, {"health": "sick"})
    assert response.status_code == 400 and "healthy" in response.content.decode()


# -- item 8: operator actions say what happened ---------------------------------------------
@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


@pytest.mark.slow
def test_job_whose_lock_an_operator_released_says_so_with_the_audit_id(workers, rconn):
    operator = login("operator", perms=("force_release_lock",))
    workers.start()
    job = seam_jobs.hold_briefly_renewed.delay(1)
    assert wait_for(lambda: rconn.get("test:pid:brief1"), 30), workers.logs()
    assert wait_for(lambda: rconn.zcard("joblock:active:brief"), 10)
    page = operator.get(DASHBOARD)
    owner = re.search(rb"owner=([0-9a-f]{12})", page.content)
    assert owner is not None, page.content[-2000:]
    response = operator.post(
        RELEASE,
        {"resource": "brief:1", "owner": owner.group(1).decode(), "reason": "wedged, OPS-7"},
    )
    assert response.status_code == 302
    audit = LockAudit.objects.get()
    assert audit.released
    assert wait_status(job, {JobStatus.FINISHED, JobStatus.FAILED}, 30) is JobStatus.FAILED
    error = job.latest_result().exc_string or ""
    assert "LockLost" in error
    assert f"released by an operator (force_release by operator, audit #{audit.pk})" in error
    assert "wedged, OPS-7" in error
    assert job.get_meta(refresh=True)["joblock"]["outcome"] == "aborted"


@pytest.mark.slow
def test_force_release_while_redis_is_black_holed_answers_a_clear_page(settings, proxy):
    settings.JOBLOCK = {"REDIS_ALIAS": "proxied"}
    held = lock("order:9", ttl=30)
    assert held.acquire()
    operator = login("operator", perms=("force_release_lock",))
    proxy.set("blackhole")
    try:
        response = operator.post(
            RELEASE, {"resource": "order:9", "owner": held.owner, "reason": "stuck"}
        )
        confirm = operator.get(RELEASE, {"resource": "order:9", "owner": held.owner})
    finally:
        proxy.set("forward")
    assert response.status_code == 503, response.content[-500:]
    text = response.content.decode()
    assert "Redis does not answer" in text and "Traceback" not in text
    assert confirm.status_code == 503
    audit = LockAudit.objects.get()
    assert not audit.released and "not released: Redis did not answer" in audit.outcome
    assert wait_for(lambda: held.held, 5) and held.release(), "the holder keeps its lock"


@pytest.mark.slow
def test_dead_holder_row_names_the_evidence(rconn):
    pid = dead_holder("order:dead", rconn)
    page = login("root", superuser=True).get(DASHBOARD).content.decode()
    why = re.search(r'<td class="jl-why">([^<]*)</td>', page)
    assert why is not None, page[-3000:]
    assert f"process {pid} on " in why.group(1) and "is gone" in why.group(1)
    assert "never renewed" in why.group(1)
    assert "RQ job" not in why.group(1) and "worker" not in why.group(1), "no job: not evidence"


# -- item 10: the admin leaks nothing and permissions are what the docs say -----------------
def test_claim_tokens_cannot_be_probed_through_changelist_lookups():
    with idempotent("refund:R-10"):
        token = IdempotencyRecord.objects.get().token
        browser = login("root", superuser=True)
        url = reverse("admin:django_joblock_idempotencyrecord_changelist")
        for lookup in ("token__startswith", "token__exact", "token__regex", "token__gt"):
            response = browser.get(url, {lookup: token[:1]})
            assert response.status_code == 400, (lookup, response.status_code)
            assert token.encode() not in response.content
        shown = browser.get(url, {"status__exact": "running", "key__startswith": "refund"})
        assert shown.status_code == 200 and b"refund:R-10" in shown.content
        detail = browser.get(
            reverse(
                "admin:django_joblock_idempotencyrecord_change",
                args=[IdempotencyRecord.objects.get().pk],
            )
        )
        assert detail.status_code == 200 and token.encode() not in detail.content


def test_permissions_are_the_ones_docs_admin_md_states():
    records = reverse("admin:django_joblock_idempotencyrecord_changelist")
    audit = reverse("admin:django_joblock_lockaudit_changelist")
    with idempotent("refund:R-11", lease=0.01):
        pass
    # A claim whose lease ended while it was running (its claimer died).
    IdempotencyRecord.objects.update(
        status="running", lease_expires_at=timezone.now() - timedelta(seconds=5)
    )
    staff = login("staff")
    assert staff.get(DASHBOARD).status_code == 200
    assert b"refund:R-11" not in staff.get(DASHBOARD).content, "keys need the view permission"
    assert staff.get(records).status_code == 403
    assert staff.get(audit).status_code == 403
    viewer = login("viewer", perms=("view_idempotencyrecord", "view_lockaudit"))
    assert viewer.get(records).status_code == 200 and viewer.get(audit).status_code == 200
    assert b"refund:R-11" in viewer.get(DASHBOARD).content
    docs = (ROOT / "docs" / "admin.md").read_text()
    table = docs[docs.index("## Permissions") :]
    table = table[: table.index("\n## ", 1)]
    assert "`django_joblock.view_idempotencyrecord`" in table
    assert "`django_joblock.view_lockaudit`" in table
    assert "see the dashboard, the idempotency records and the audit log" not in table
