"""The "Job locks" dashboard with audited force release, the read-only
idempotency records and the lock audit log; thin over :mod:`dashboard` and :mod:`control`.

Permissions (``django_joblock.*``): the dashboard, any active staff user (its stuck claims need
``view_idempotencyrecord``); records, ``view_idempotencyrecord``; the audit log,
``view_lockaudit``; force release, ``force_release_lock``. Reflected values are escaped; a bad
parameter is a ``text/plain`` 400 naming it; a Redis that does not answer is a 503 page."""

from __future__ import annotations

import contextlib
import re
import time
from typing import Any

import django
from django.apps import apps
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils.html import format_html, format_html_join

from ..backend import REDIS_ERRORS
from ..exceptions import LockBackendUnavailable
from ..jobs.decorator import idempotency_scopes
from ..jobs.history import Delivery, summary
from ..locks.info import LockInfo, lock_holders
from ..locks.keys import (
    MAX_LIMIT,
    is_owner_hash,
    owner_hash,
    validate_family,
    validate_resource,
)
from ..models import Dashboard, IdempotencyRecord, LockAudit
from ..monitor import control, dashboard
from ..monitor.health import Health, job_queue, record_deliveries
from .base import (
    EstimatedCountPaginator,
    ReadOnlyAdmin,
    bad_request,
    known_values_filter,
    pretty_json,
)

DOCS_URL = "https://github.com/django-joblock/django-joblock/blob/main/docs/"  # not in a wheel
DASHBOARD = "admin:django_joblock_dashboard_changelist"


def rq_job_url(queue_name: str, job_id: str) -> str:
    """django-rq's page of an RQ job when django-rq is installed and routed, else ``""``: in
    the admin since django-rq 4 (``admin:django_rq_job_detail``), before from
    ``include("django_rq.urls")`` (``rq_job_detail``); both take the queue's index."""
    if not queue_name or not job_id or not apps.is_installed("django_rq"):
        return ""
    try:
        from django_rq import settings as rq_settings  # type: ignore[import-not-found,unused-ignore]

        queues_map = getattr(rq_settings, "get_queues_map", None)  # django-rq >= 4
        index = (queues_map() if queues_map else rq_settings.QUEUES_MAP)[queue_name]
    except (ImportError, AttributeError, KeyError):
        return ""
    for name in ("admin:django_rq_job_detail", "rq_job_detail"):
        with contextlib.suppress(NoReverseMatch):
            return reverse(name, args=(index, job_id))
    return ""


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    """Read-only: records are written by claims and removed by ``joblock_purge`` only."""

    list_display = ("key", "scope", "status", "attempts", "rq_job_id", "updated_at", "expires_at")
    list_filter = ("status", known_values_filter("scope", idempotency_scopes))
    search_fields = ("key",)
    ordering = ("-pk",)  # the primary key index: no sort of the whole table per page
    show_full_result_count = False  # no COUNT(*) over a large table on every page
    paginator = EstimatedCountPaginator
    fields = (
        "scope",
        "key",
        "status",
        "attempts",
        "result_pretty",
        "error",
        "fingerprint",
        "owner_short",
        "fence",
        "rq_job_id",
        "deliveries",
        "lease_expires_at",
        "created_at",
        "updated_at",
        "finished_at",
        "expires_at",
    )

    @admin.display(description="result")
    def result_pretty(self, obj: IdempotencyRecord) -> str:
        return pretty_json(obj.result)

    @admin.display(description="deliveries")
    def deliveries(self, obj: IdempotencyRecord) -> str:
        """Every run of this key by a worker (newest last), from the key's delivery history."""
        found = record_deliveries(obj.scope, obj.key, obj.lock_resource)
        if not found:
            return "-"
        rows = format_html_join("", "<tr>" + "<td>{}</td>" * 6 + "</tr>", map(_cells, found))
        table = (
            '<p style="margin:0 0 4px">{}</p><table><tr><th>started (UTC)</th><th>RQ job</th>'
            "<th>worker</th><th>host:pid</th><th>outcome</th><th></th></tr>{}</table>"
        )
        return format_html(table, summary(found), rows)

    @admin.display(description="owner (hash)")
    def owner_short(self, obj: IdempotencyRecord) -> str:
        return owner_hash(obj.token) if obj.token else ""


def _cells(d: Delivery) -> tuple[Any, ...]:
    """One delivery's row: started (UTC), RQ job, worker, host:pid, outcome, duplicate."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(d.started))
    beside = f"duplicate in flight beside {d.duplicate_of}" if d.duplicate_of else ""
    return (started, d.job_id, d.worker or "-", f"{d.host}:{d.pid}", d.outcome, beside)


def _bad_dashboard_parameter(family: str | None, health: str | None, timeline: str | None) -> str:
    """Why the dashboard's query parameters are refused ("" if they are fine)."""
    try:
        if family is not None:
            validate_family(family)
    except ValueError as exc:
        return str(exc)
    try:
        if timeline is not None:
            if ":" in timeline:
                validate_resource(timeline)
            else:
                validate_family(timeline)
    except ValueError as exc:
        return f"timeline: {exc}"
    healths = [choice.value for choice in Health]
    if health is not None and health not in healths:
        return f"Unknown health filter {health!r}; one of: {', '.join(healths)}"
    return ""


def _bad_release_parameter(resource: str, owner: str, slot: str) -> str:
    """Why the force release's resource, owner hash or slot is refused ("" if they are fine)."""
    try:
        validate_resource(resource)
        _release_slot(slot)
    except ValueError as exc:
        return str(exc)
    if owner and not is_owner_hash(owner):
        return f"Invalid owner {owner[:80]!r}: expected a 12-character owner hash."
    return ""


def _release_slot(given: str) -> int:
    """The slot a force release names (``""``: slot 0, a plain lock's); ``ValueError`` naming
    the ``slot`` parameter otherwise."""
    if not given:
        return 0
    if not re.fullmatch("[0-9]{1,9}", given):
        raise ValueError(f"Invalid slot {given[:20]!r}: expected a number 0..{MAX_LIMIT - 1}.")
    return control.validate_slot("slot", int(given))


def _held_slot(resource: str, slot: int) -> LockInfo | None:
    """The holder of ``slot`` of ``resource``'s lock now, or None (read with slots 0..slot,
    one round trip)."""
    held = lock_holders(resource, limit=slot + 1)
    return next((info for info in held if info.slot == slot), None)


def _named(resource: str, slot: int) -> str:
    """The resource as messages name it: with its slot, for any slot but a plain lock's 0."""
    return f"{resource} (slot {slot})" if slot else resource


@admin.register(Dashboard)
class DashboardAdmin(ReadOnlyAdmin):
    """The "Job locks" page: every staff user may look; releasing needs the permission."""

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_module_permission(self, request: HttpRequest) -> bool:
        """The "Job locks" entry on the admin index: shown to whoever may view the dashboard."""
        return self.has_view_permission(request)

    def get_urls(self) -> list[URLPattern]:
        return [
            path(
                "release/",
                self.admin_site.admin_view(self.release_view),
                name="django_joblock_release",
            ),
            path(
                "",
                self.admin_site.admin_view(self.changelist_view),
                name="django_joblock_dashboard_changelist",
            ),
        ]

    def _render(
        self, request: HttpRequest, page: str, title: str, crumb: str, **extra: Any
    ) -> TemplateResponse:
        """One of our pages: breadcrumbs to the dashboard and on to ``crumb`` (none on the
        dashboard itself), the admin's context and ``extra``."""
        home = reverse(DASHBOARD, current_app=self.admin_site.name)
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "crumbs": (("Job locks", home), (crumb, "")) if crumb else (("Job locks", ""),),
            "jl_ol_breadcrumbs": django.VERSION >= (6, 1),
            "docs_url": DOCS_URL,
            **extra,
        }
        return TemplateResponse(request, f"admin/django_joblock/{page}.html", context)

    def _unavailable(self, request: HttpRequest, title: str, error: str) -> HttpResponse:
        response = self._render(request, "unavailable", title, title, error=error)
        response.status_code = 503
        return response

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        family = request.GET.get("family") or None
        health = request.GET.get("health") or None
        timeline = request.GET.get("timeline") or None
        if problem := _bad_dashboard_parameter(family, health, timeline):
            return bad_request(problem)
        started = time.perf_counter()
        claims = request.user.has_perm("django_joblock.view_idempotencyrecord")
        outbox = request.user.has_perm("django_joblock.view_outboxmessage")
        try:
            data = dashboard.build(
                family, health, claims=claims, outbox=outbox, timeline_of=timeline
            )
        except REDIS_ERRORS as exc:
            error = f"Redis did not answer ({type(exc).__name__}: {exc}); nothing was changed."
            return self._unavailable(request, "Job locks: Redis does not answer", error)
        for row in data["rows"]:
            queue = job_queue(row["lock"].job_func) if row["lock"].job_func else None
            row["job_url"] = rq_job_url(str(queue.name) if queue else "", row["lock"].job_id)
        for job in data["stuck_jobs"]:
            job.url = rq_job_url(job.queue, job.job_id)
        data["can_release"] = request.user.has_perm("django_joblock.force_release_lock")
        response = self._render(request, "dashboard", "Job locks", "", **data)
        response.render()
        response["Server-Timing"] = f"dashboard;dur={(time.perf_counter() - started) * 1000:.1f}"
        return response

    def release_view(self, request: HttpRequest) -> HttpResponse:
        """GET: a confirmation page (changes nothing). POST: compare-and-delete + audit."""
        if not request.user.has_perm("django_joblock.force_release_lock"):
            raise PermissionDenied
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        source = request.POST if request.method == "POST" else request.GET
        resource = source.get("resource", "")
        owner = source.get("owner", "")
        if problem := _bad_release_parameter(resource, owner, source.get("slot", "")):
            return bad_request(problem)
        slot = _release_slot(source.get("slot", ""))
        if request.method == "GET":
            return self._release_confirmation(request, resource, owner, slot, errors=[])
        reason = request.POST.get("reason", "").strip()
        if not reason:
            errors = ["A reason is required."]
            return self._release_confirmation(request, resource, owner, slot, errors)
        if not owner:
            errors = ["The owner shown on the page is missing."]
            return self._release_confirmation(request, resource, owner, slot, errors)
        return self._force_release(request, resource, owner, slot, reason)

    def _force_release(
        self, request: HttpRequest, resource: str, owner: str, slot: int, reason: str
    ) -> HttpResponse:
        """Compare-and-delete of ``slot``'s holding + audit, then back to the dashboard with the
        outcome as a message; the confirmation page again, with the error, if it was refused."""
        try:  # the actor is the user's name
            result = control.force_release(
                resource, owner=owner, slot=slot, reason=reason, user=request.user
            )
        except LockBackendUnavailable as exc:
            error = f"{exc}. See the lock audit log for what was recorded."
            return self._release_unavailable(request, resource, error)
        except ValueError as exc:  # nothing released
            return self._release_confirmation(request, resource, owner, slot, [str(exc)])
        named = _named(resource, slot)
        if result.released:
            message = f"Force-released lock {named} (owner {owner}): {reason}"
            self.log_change(request, result.audit, message)
            messages.success(request, f"Released {named}: {reason}")
        else:
            messages.error(request, f"Not released: {result.outcome}")
        # Back to this admin site's dashboard (a project may have several sites).
        return redirect(reverse(DASHBOARD, current_app=self.admin_site.name))

    def _release_confirmation(
        self, request: HttpRequest, resource: str, owner: str, slot: int, errors: list[str]
    ) -> HttpResponse:
        """The confirmation page: the holder of ``slot`` as it is now, and why the last attempt
        failed."""
        try:
            current = _held_slot(resource, slot)
        except LockBackendUnavailable as exc:
            return self._release_unavailable(request, resource, f"{exc}. Nothing was changed.")
        return self._render(
            request,
            "release_confirm",
            f"Force-release {_named(resource, slot)}?",
            "Force release",
            resource=resource,
            owner=owner,
            slot=slot,
            lock=current,
            errors=errors,
        )

    def _release_unavailable(self, request: HttpRequest, resource: str, error: str) -> HttpResponse:
        """The 503 page of a force release whose Redis does not answer."""
        title = f"Force-release {resource}: Redis does not answer"
        return self._unavailable(request, title, error)


@admin.register(LockAudit)
class LockAuditAdmin(ReadOnlyAdmin):
    """The append-only audit log of operator actions on locks (read-only)."""

    list_display = ("created_at", "action", "resource", "owner", "released", "actor", "reason")
    list_filter = ("action", "released")
    search_fields = ("resource", "actor", "reason")
    readonly_fields = tuple(field.name for field in LockAudit._meta.fields if not field.primary_key)
