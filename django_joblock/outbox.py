"""Side effects outside the database, made once per idempotency key: the outbox.

An e-mail or API call made inside a job cannot be rolled back: a job killed before its commit
runs again and calls again. :func:`send_after_commit` records the intent instead (an
:class:`~django_joblock.models.OutboxMessage` row, in the job's transaction) and delivers it
once that transaction commits, by calling ``handler(payload, idempotency_key=key)``:

- a run that dies or rolls back before its commit has sent nothing (its row rolled back too);
- the handler hands ``key`` to the provider (an ``Idempotency-Key`` header, a message id), so
  a delivery repeated after a crash between the provider's answer and the row's update is the
  same request to the provider;
- a delivery that raises stays ``pending`` with its error and is retried with exponential
  backoff (1 s doubling, at most :data:`RETRY_MAX` s) by :func:`deliver_due` (``manage.py
  joblock_outbox``), as is a message whose process died right after the commit.

Delivery is at least once. A delivery holds the message's row lock (``SELECT ... FOR UPDATE``;
SQLite serialises writers anyway) while its handler runs, so two deliverers never run it at
once: keep handlers short, with a timeout.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connections, router, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from .backoff import ceiling
from .choices import OutboxStatus
from .locks.info import job_context

__all__ = ["RETRY_MAX", "OutboxReport", "deliver", "deliver_due", "describe", "send_after_commit"]

logger = logging.getLogger("django_joblock")

#: The longest wait between two delivery attempts of one message, in seconds.
RETRY_MAX = 300.0
_KEY_MAX = 255


@dataclass(frozen=True)
class OutboxReport:
    """What one :func:`deliver_due` pass did."""

    delivered: int
    failed: int
    pending: int  # still pending afterwards (due later, failed now, or taken by another)


def send_after_commit(
    handler: Callable[..., object] | str,
    payload: Mapping[str, Any] | list[Any] | str | int | float | bool | None,
    *,
    key: str,
    using: str | None = None,
) -> Any:
    """Record a side effect in the current transaction; deliver it after the commit.

    ``handler``: a module-level function (or its dotted path), called after the commit in this
    process. ``payload``: JSON (Django's encoder: ``Decimal``, ``datetime``, ``UUID`` become
    strings). ``key`` names the effect (``f"receipt:{order_id}"``): a key recorded already (a
    replayed or retried job) returns the existing message and sends nothing more. Outside
    ``transaction.atomic()`` the row commits and is delivered at once. ``ValueError`` for an
    empty or over-long key, a payload that is not JSON, a handler not importable by its path,
    or a key recorded before for another handler.
    """
    from .models import OutboxMessage

    path = _handler_path(handler)
    if not isinstance(key, str) or not key or len(key) > _KEY_MAX:
        raise ValueError(
            f"send_after_commit: key must be a non-empty str of at most {_KEY_MAX} "
            f"characters, got {key!r}"
        )
    try:
        json.dumps(payload, cls=DjangoJSONEncoder)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"send_after_commit: payload for key {key!r} is not JSON: {exc}") from exc
    database = using or router.db_for_write(OutboxMessage)
    message, created = OutboxMessage.objects.using(database).get_or_create(
        key=key,
        defaults={
            "handler": path,
            "payload": payload,
            "rq_job_id": job_context()[0],
            "next_attempt_at": timezone.now(),
        },
    )
    if message.handler != path:
        raise ValueError(
            f"send_after_commit: key {key!r} was recorded for {message.handler}, not {path}"
        )
    if created:
        transaction.on_commit(lambda: deliver(message.pk, using=database), using=database)
    return message


def deliver(pk: int, *, using: str | None = None) -> bool:
    """Deliver one pending message now; True if its handler returned. False when it is
    delivered already, being delivered by another process (its row is locked), or its handler
    raised (recorded on the message, retried later): never raises for a handler's error."""
    from .models import OutboxMessage

    database = using or router.db_for_write(OutboxMessage)
    # FOR UPDATE, skipping a row another deliverer holds where supported (SQLite: no FOR
    # UPDATE, Django leaves the query as it is; one writer at a time anyway).
    skip = connections[database].features.has_select_for_update_skip_locked
    with transaction.atomic(using=database):
        message = (
            OutboxMessage.objects.using(database)
            .select_for_update(skip_locked=skip)
            .filter(pk=pk, status=OutboxStatus.PENDING)
            .first()
        )
        if message is None:
            return False
        message.attempts += 1
        try:
            with transaction.atomic(using=database):  # a handler's failed write rolls back alone
                import_string(message.handler)(message.payload, idempotency_key=message.key)
        except Exception as exc:  # noqa: BLE001 - any failure is recorded and retried
            delay = ceiling(message.attempts - 1, base=1.0, factor=2.0, max_delay=RETRY_MAX)
            message.last_error = f"{type(exc).__name__}: {exc}"[:2000]
            message.next_attempt_at = timezone.now() + timedelta(seconds=delay)
            message.save(update_fields=["attempts", "last_error", "next_attempt_at"])
            logger.warning(
                "outbox: delivery %d of %s (%s) failed, next attempt in %.0f s: %s",
                message.attempts,
                message.key,
                message.handler,
                delay,
                message.last_error,
            )
            return False
        message.status = OutboxStatus.DELIVERED
        message.delivered_at = timezone.now()
        message.save(update_fields=["attempts", "status", "delivered_at"])
    logger.info(
        "outbox: delivered %s (%s), attempt %d", message.key, message.handler, message.attempts
    )
    return True


def deliver_due(*, limit: int = 100, using: str | None = None) -> OutboxReport:
    """Deliver up to ``limit`` pending messages whose next attempt is due, oldest due first."""
    from .models import OutboxMessage

    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"deliver_due: limit must be a positive int, got {limit!r}")
    database = using or router.db_for_write(OutboxMessage)
    pending = OutboxMessage.objects.using(database).filter(status=OutboxStatus.PENDING)
    due = pending.filter(next_attempt_at__lte=timezone.now()).order_by("next_attempt_at", "pk")
    done = [deliver(pk, using=database) for pk in list(due.values_list("pk", flat=True)[:limit])]
    delivered = sum(done)
    return OutboxReport(delivered, failed=len(done) - delivered, pending=pending.count())


def _handler_path(handler: Callable[..., object] | str) -> str:
    path = handler if isinstance(handler, str) else f"{handler.__module__}.{handler.__qualname__}"
    try:
        found = import_string(path)
    except ImportError as exc:
        raise ValueError(
            f"send_after_commit: handler {path!r} cannot be imported by its path ({exc}); "
            "use a module-level function"
        ) from exc
    if not callable(found) or (not isinstance(handler, str) and found is not handler):
        raise ValueError(f"send_after_commit: {path!r} does not name the handler function")
    return path


def describe(message: Any) -> str:
    """One line for the doctor and the admin: key, handler, status, attempts, last error."""
    return (
        f"{message.key} via {message.handler}: {message.status} after {message.attempts} "
        f"attempt(s){f', last error {message.last_error}' if message.last_error else ''}"
    )
