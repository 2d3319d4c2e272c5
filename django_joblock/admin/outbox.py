"""The outbox in Django admin: every side effect recorded with ``send_after_commit``, its
state and last error (read-only), and a "deliver now" action (``deliver_outbox_message``)."""

from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from .. import outbox
from ..choices import OutboxStatus
from ..models import OutboxMessage
from .base import EstimatedCountPaginator, ReadOnlyAdmin, known_values_filter, pretty_json


def _undelivered_handlers() -> list[str]:
    """Handlers of undelivered messages, via the status index (delivered ones are the bulk)."""
    pending = OutboxMessage.objects.exclude(status=OutboxStatus.DELIVERED)
    return list(pending.values_list("handler", flat=True).distinct()[:200])


@admin.register(OutboxMessage)
class OutboxMessageAdmin(ReadOnlyAdmin):
    """Read-only: messages are written by ``send_after_commit`` and its deliveries."""

    list_display = (
        "key",
        "handler",
        "status",
        "attempts",
        "rq_job_id",
        "created_at",
        "next_attempt_at",
        "delivered_at",
    )
    list_filter = ("status", known_values_filter("handler", _undelivered_handlers))
    search_fields = ("key",)
    ordering = ("-pk",)
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    fields = (
        "key",
        "handler",
        "status",
        "attempts",
        "payload_pretty",
        "last_error",
        "rq_job_id",
        "created_at",
        "next_attempt_at",
        "delivered_at",
    )
    actions = ["deliver_now"]

    @admin.display(description="payload")
    def payload_pretty(self, obj: OutboxMessage) -> str:
        return pretty_json(obj.payload)

    def has_deliver_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_joblock.deliver_outbox_message"))

    @admin.action(
        description="Deliver the selected undelivered messages now", permissions=["deliver"]
    )
    def deliver_now(self, request: HttpRequest, queryset: QuerySet[OutboxMessage]) -> None:
        undelivered = queryset.exclude(status=OutboxStatus.DELIVERED)
        pending = list(undelivered.values_list("pk", flat=True))
        delivered = sum(outbox.deliver(pk, using=queryset.db, dead=True) for pk in pending)
        skipped = queryset.count() - len(pending)
        failed = delivered < len(pending)
        already = f"; {skipped} were delivered already" if skipped else ""
        rest = "; see last error for the rest." if failed else "."
        text = f"{delivered} of {len(pending)} undelivered message(s) delivered{already}{rest}"
        self.message_user(request, text, messages.WARNING if failed else messages.SUCCESS)
