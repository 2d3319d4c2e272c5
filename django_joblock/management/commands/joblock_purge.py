"""``manage.py joblock_purge [--dry-run] [--batch-size N] [--redis [--force]]``.

Without ``--redis``: delete expired idempotency records, except a ``running`` claim whose lease
is live (a duplicate could claim the key afresh and run beside it). Batches of primary keys,
each its own short transaction, the condition repeated in each ``DELETE`` (a record claimed
between the read and the delete is kept).

With ``--redis`` (uninstall): remove every key under ``KEY_PREFIX`` on the lock and queue
Redis (:mod:`django_joblock.monitor.cleanup`); refused while locks are held unless ``--force``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.db.models import Q
from django.utils import timezone

from django_joblock import conf
from django_joblock.backend import REDIS_ERRORS, no_answer
from django_joblock.models import IdempotencyRecord
from django_joblock.monitor import cleanup


def purgeable(now: datetime) -> Q:
    """Expired at ``now``, and not a running claim whose lease is still live."""
    live_claim = Q(status=IdempotencyRecord.Status.RUNNING, lease_expires_at__gt=now)
    return Q(expires_at__lt=now) & ~live_claim


class Command(BaseCommand):
    help = "Delete idempotency records whose expires_at has passed, in batches."

    def add_arguments(self, parser: CommandParser) -> None:
        add = parser.add_argument
        add("--dry-run", action="store_true", help="Only count what would be deleted.")
        add("--batch-size", type=int, default=1000, help="Records per statement (default 1000).")
        add("--database", default="default", choices=tuple(connections), help="Database alias.")
        add(
            "--redis",
            action="store_true",
            help="Uninstall: remove the Redis keys under KEY_PREFIX.",
        )
        add("--force", action="store_true", help="With --redis: even while locks are held.")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["redis"]:
            self._purge_redis(dry_run=options["dry_run"], force=options["force"])
            return
        if options["force"]:
            raise CommandError("--force only goes with --redis.")
        batch = options["batch_size"]
        if batch < 1:
            raise CommandError(f"--batch-size must be >= 1, got {batch}.")
        now = timezone.now()
        records = IdempotencyRecord.objects.using(options["database"])
        expired = records.filter(purgeable(now))
        if options["dry_run"]:
            self.stdout.write(f"{expired.count()} expired idempotency record(s) would be deleted.")
            return
        total = batches = 0
        while ids := list(expired.order_by("expires_at").values_list("pk", flat=True)[:batch]):
            total += records.filter(purgeable(now), pk__in=ids).delete()[0]
            batches += 1
        self.stdout.write(f"Deleted {total} expired idempotency record(s) in {batches} batch(es).")

    def _purge_redis(self, *, dry_run: bool, force: bool) -> None:
        prefix = conf.get().KEY_PREFIX
        try:
            held = cleanup.held_locks()
            if held and not force and not dry_run:
                raise CommandError(
                    f"{held} lock(s) are held right now: stop the workers first, or pass --force."
                )
            found = cleanup.purge_redis(dry_run=dry_run)
        except REDIS_ERRORS as exc:
            raise CommandError(no_answer(exc)) from exc
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(found.kinds.items())) or "none"
        if dry_run:
            self.stdout.write(f"{found.found} key(s) under {prefix!r}: ({kinds}) would be removed.")
        else:
            self.stdout.write(f"Removed {found.removed} key(s) under {prefix!r}: ({kinds}).")
