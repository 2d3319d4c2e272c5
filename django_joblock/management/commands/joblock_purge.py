"""``manage.py joblock_purge [--dry-run] [--batch-size N]``: delete expired idempotency records.

A record is deleted once its ``expires_at`` has passed, *except* a ``running`` claim whose
lease is still live: deleting it would let a duplicate claim the key afresh and run alongside
the claim that is still working. It goes once its lease ends (or it finishes and expires).

Deletes in batches of primary keys, each in its own short transaction, so a large backlog never
becomes one giant transaction or a long table lock. The condition is repeated in each
``DELETE``, so a record claimed between the read and the delete is kept.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Q
from django.utils import timezone

from django_joblock.models import IdempotencyRecord


def purgeable(now: datetime) -> Q:
    """Expired at ``now``, and not a running claim whose lease is still live."""
    live_claim = Q(status=IdempotencyRecord.Status.RUNNING, lease_expires_at__gt=now)
    return Q(expires_at__lt=now) & ~live_claim


class Command(BaseCommand):
    help = "Delete idempotency records whose expires_at has passed, in batches."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Only count what would be deleted."
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=1000,
            help="Records deleted per statement (default 1000).",
        )
        parser.add_argument("--database", default="default")

    def handle(self, *args: Any, **options: Any) -> None:
        batch = options["batch_size"]
        if batch < 1:
            raise CommandError(f"--batch-size must be >= 1, got {batch}.")
        now = timezone.now()
        expired = IdempotencyRecord.objects.using(options["database"]).filter(purgeable(now))
        if options["dry_run"]:
            self.stdout.write(f"{expired.count()} expired idempotency record(s) would be deleted.")
            return
        total = batches = 0
        while True:
            ids = list(expired.order_by("expires_at").values_list("pk", flat=True)[:batch])
            if not ids:
                break
            deleted, _ = (
                IdempotencyRecord.objects.using(options["database"])
                .filter(purgeable(now), pk__in=ids)
                .delete()
            )
            total += deleted
            batches += 1
        self.stdout.write(f"Deleted {total} expired idempotency record(s) in {batches} batch(es).")
