"""Side effects outside the database, made once per key: the outbox.

:func:`send_after_commit` records the intent (an :class:`~django_joblock.models.OutboxMessage` row,
in the job's transaction) and calls ``handler(payload, idempotency_key=key)`` once it commits (in
our workers, once the job has ended: :func:`after_job`): a run that dies or rolls back first has
sent nothing. A failed delivery, or one whose process died after the commit, is retried with backoff
(1 s doubling, at most :data:`RETRY_MAX` s) by :func:`deliver_due` (``manage.py joblock_outbox``),
up to :data:`MAX_ATTEMPTS` deliveries: then it is dead-lettered (status ``dead``, kept, alerted
on; admin's "deliver now" tries it again).
At least once, with the same key each time (hand it to the provider); a delivery holds the row lock
while its handler runs, so keep handlers short. Each attempt is counted before its handler runs:
one whose process dies in the handler is retried after its backoff, and dead-lettered in the end.
The whole story: docs/idempotency.md."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connections, router, transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from .backoff import ceiling
from .choices import OutboxStatus
from .idempotency.inputs import storable_error, storable_json, storable_text
from .idempotency.store import cut_job_id
from .locks.info import job_context
from .logs import logger

#: The longest wait between two delivery attempts of one message, in seconds.
RETRY_MAX = 300.0
#: Failed deliveries after which a message is dead-lettered: about an hour of retries.
MAX_ATTEMPTS = 20
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
    """Record a side effect in the current transaction; deliver it after the commit (at once
    outside ``transaction.atomic()``); a rollback drops it.

    ``handler``: a module-level function or its dotted path, called with the payload.

    ``payload``: JSON (Django's encoder).

    ``key``: names the effect (``f"receipt:{order_id}"``): a key recorded already returns the
    existing message and sends nothing more.

    ``using``: the database alias of the transaction and of the message's row (default: the
    database router's choice for :class:`OutboxMessage`).

    Raises ``ValueError`` for a bad key, payload or handler, or a key recorded before for
    another handler."""
    from .models import OutboxMessage

    path = _handler_path(handler)
    if not isinstance(key, str) or not key or len(key) > _KEY_MAX or not storable_text(key):
        raise ValueError(
            f"send_after_commit: key must be a non-empty str of at most {_KEY_MAX} characters "
            f"without NUL or lone surrogates, got {key!r}"
        )
    try:
        storable_json(payload)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ValueError(
            f"send_after_commit: payload for key {key!r} cannot be stored as JSON "
            f"(no NaN, infinity or NUL): {exc}"
        ) from exc
    database = using or router.db_for_write(OutboxMessage)
    defaults = {
        "handler": path,
        "payload": payload,
        "rq_job_id": cut_job_id(OutboxMessage, job_context()[0]),
        "next_attempt_at": timezone.now(),
    }
    message, created = OutboxMessage.objects.using(database).get_or_create(
        key=key, defaults=defaults
    )
    if message.handler != path:
        raise ValueError(
            f"send_after_commit: key {key!r} was recorded for {message.handler}, not {path}"
        )
    if created:
        transaction.on_commit(lambda: _deliver_or_hold(message.pk, database), using=database)
    return message


# The deliveries a worker's job recorded, held until the job ended (see after_job).
_held: ContextVar[list[tuple[int, str]] | None] = ContextVar("joblock_outbox_held", default=None)


def _deliver_or_hold(pk: int, database: str) -> None:
    held = _held.get()
    if held is None:
        deliver(pk, using=database)
    else:
        held.append((pk, database))


@contextlib.contextmanager
def after_job() -> Iterator[None]:
    """Hold the deliveries the block's commits release until it ends, around a worker's run of a
    job: a handler's network time is then not lock hold time, and it runs once the lock is released
    and RQ handed the admission slot on. A failed delivery stays pending for ``joblock_outbox``."""
    held: list[tuple[int, str]] = []
    token = _held.set(held)
    try:
        yield
    finally:
        _held.reset(token)
        for pk, database in held:
            try:
                deliver(pk, using=database)
            except Exception:  # noqa: BLE001 - the job ended well; joblock_outbox retries it
                logger.warning("outbox: delivery of message %s failed", pk, exc_info=True)


def deliver(pk: int, *, using: str | None = None, dead: bool = False) -> bool:
    """Deliver one pending (or, ``dead=True``, dead-lettered) message now: True if its handler
    returned; False when delivered already, locked or taken by another deliverer, or its handler
    raised (recorded; retried later, or dead-lettered after :data:`MAX_ATTEMPTS` deliveries).

    The attempt is committed, with its backoff, before the handler runs (:func:`_claim`): a
    delivery whose process dies in the handler (the OOM killer) is counted like a failed one,
    so the message waits its backoff behind the others and is dead-lettered in the end, instead
    of being due at once with the same count for ever, ending every sweeper pass first."""
    from .models import OutboxMessage

    database = using or router.db_for_write(OutboxMessage)
    attempt = _claim(pk, database, dead)
    if attempt is None:
        return False
    with transaction.atomic(using=database):
        # Still this attempt's: a deliverer that claimed it since has counted another one.
        message = _locked(pk, database, dead).filter(attempts=attempt).first()
        if message is None:
            return False
        try:
            with transaction.atomic(using=database):  # a handler's failed write rolls back alone
                import_string(message.handler)(message.payload, idempotency_key=message.key)
        except Exception as exc:  # noqa: BLE001 - any failure is recorded and retried
            _record_failure(message, f"{type(exc).__name__}: {exc}")
            return False
        message.status = OutboxStatus.DELIVERED
        message.delivered_at = timezone.now()
        message.last_error = ""  # it was delivered: an earlier attempt's error is history
        message.save(update_fields=["status", "delivered_at", "last_error"])
    logger.info(
        "outbox: delivered %s (%s), attempt %d", message.key, message.handler, message.attempts
    )
    return True


def _locked(pk: int, database: str, dead: bool) -> Any:
    """Message ``pk`` if pending (or dead, ``dead=True``), row-locked; another deliverer's row is
    skipped (SQLite has no FOR UPDATE: one writer at a time)."""
    from .models import OutboxMessage

    skip = connections[database].features.has_select_for_update_skip_locked
    locked = OutboxMessage.objects.using(database).select_for_update(skip_locked=skip)
    wanted = [OutboxStatus.PENDING, *([OutboxStatus.DEAD] if dead else [])]
    return locked.filter(pk=pk, status__in=wanted)


def _claim(pk: int, database: str, dead: bool) -> int | None:
    """Count the next delivery attempt of message ``pk`` and set its retry time (its backoff),
    committed before the handler runs: the attempt's number, or None when there is nothing to
    deliver. A pending message whose :data:`MAX_ATTEMPTS` deliveries are counted (the last one
    died with its process) is dead-lettered instead."""
    with transaction.atomic(using=database):
        message = _locked(pk, database, dead).first()
        if message is None:
            return None
        if message.status == OutboxStatus.PENDING and message.attempts >= MAX_ATTEMPTS:
            _record_failure(message, f"delivery {message.attempts} never ended (process died?)")
            return None
        message.attempts += 1
        message.next_attempt_at = timezone.now() + timedelta(seconds=_backoff(message.attempts))
        message.save(update_fields=["attempts", "next_attempt_at"])
        return int(message.attempts)


def _backoff(attempts: int) -> float:
    """Seconds before the next delivery after ``attempts`` of them: 1 s doubling, at most
    :data:`RETRY_MAX`."""
    return ceiling(attempts - 1, base=1.0, factor=2.0, max_delay=RETRY_MAX)


def _record_failure(message: Any, error: str) -> None:
    """Record the failure of the message's last counted attempt: retried after its backoff, or
    dead-lettered once :data:`MAX_ATTEMPTS` are counted."""
    delay = _backoff(message.attempts)
    message.last_error = storable_error(error, 2000)
    message.next_attempt_at = timezone.now() + timedelta(seconds=delay)
    gone = message.attempts >= MAX_ATTEMPTS
    message.status = OutboxStatus.DEAD if gone else OutboxStatus.PENDING
    message.save(update_fields=["status", "last_error", "next_attempt_at"])
    then = "dead-lettered" if gone else f"retry in {delay:.0f} s"
    logger.warning(
        f"outbox: delivery %d of %s (%s) failed, {then}: %s",
        message.attempts,
        message.key,
        message.handler,
        message.last_error,
    )


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
            f"send_after_commit: handler {path!r} cannot be imported "
            f"({exc}; use a module-level function)"
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
