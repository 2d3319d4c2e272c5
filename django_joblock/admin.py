"""Django admin for django-joblock: the read-only IdempotencyRecord list."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.core.serializers.json import DjangoJSONEncoder
from django.http import HttpRequest
from django.utils.html import format_html

from .models import IdempotencyRecord


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Read-only: records are written by claims and removed by ``joblock_purge`` only."""

    list_display = ("key", "scope", "status", "attempts", "rq_job_id", "updated_at", "expires_at")
    list_filter = ("status", "scope")
    search_fields = ("key",)
    ordering = ("-updated_at",)
    date_hierarchy = "updated_at"
    show_full_result_count = False  # no COUNT(*) over a large table on every page
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
        "lease_expires_at",
        "created_at",
        "updated_at",
        "finished_at",
        "expires_at",
    )
    readonly_fields = fields

    @admin.display(description="result")
    def result_pretty(self, obj: IdempotencyRecord) -> str:
        text = json.dumps(obj.result, indent=2, sort_keys=True, cls=DjangoJSONEncoder)
        return format_html('<pre style="margin:0;white-space:pre-wrap">{}</pre>', text)

    @admin.display(description="owner")
    def owner_short(self, obj: IdempotencyRecord) -> str:
        from .keys import owner_hash

        return owner_hash(obj.owner) if obj.owner else ""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
