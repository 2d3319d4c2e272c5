"""``manage.py joblock_purge [--dry-run] [--batch-size N]``: delete expired idempotency records.

Deletes in batches of primary keys, each in its own short transaction, so a large backlog never
becomes one giant transaction or a long table lock.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from django_joblock.models import IdempotencyRecord


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
        expired = IdempotencyRecord.objects.using(options["database"]).filter(expires_at__lt=now)
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
                .filter(pk__in=ids, expires_at__lt=now)
                .delete()
            )
            total += deleted
            batches += 1
        self.stdout.write(f"Deleted {total} expired idempotency record(s) in {batches} batch(es).")
