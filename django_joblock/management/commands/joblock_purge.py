"""``manage.py joblock_purge [--dry-run] [--batch-size N] [--redis [--force]]``.

Without ``--redis``: delete expired idempotency records, except a ``running`` claim whose lease
is live (a duplicate could claim the key afresh and run beside it), and outbox messages
delivered more than ``IDEMPOTENCY_TTL`` ago; in batches of primary keys, each its own short
transaction whose ``DELETE`` repeats the condition (a record claimed meanwhile is kept).
With ``--redis`` (uninstall): remove every key under ``KEY_PREFIX`` on the lock and queue
Redis (:mod:`django_joblock.monitor.cleanup`); refused while locks are held unless ``--force``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.db.models import Q
from django.utils import timezone

from django_joblock import conf
from django_joblock.backend import REDIS_ERRORS, connection, no_answer
from django_joblock.choices import OutboxStatus
from django_joblock.models import IdempotencyRecord, OutboxMessage
from django_joblock.monitor import cleanup

MAX_BATCH = 1_000_000  # records per statement (a SQL LIMIT: 64 bits at most)


class Command(BaseCommand):
    help = "Delete expired idempotency records and old delivered outbox messages, in batches."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="Only count what would be deleted."
        )
        parser.add_argument(
            "--batch-size", type=int, default=1000, help="Records per statement (default 1000)."
        )
        parser.add_argument(
            "--database", default="default", choices=tuple(connections), help="Database alias."
        )
        parser.add_argument(
            "--redis",
            action="store_true",
            help="Uninstall: remove the Redis keys under KEY_PREFIX.",
        )
        parser.add_argument(
            "--force", action="store_true", help="With --redis: even while locks are held."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["redis"]:
            self._purge_redis(dry_run=options["dry_run"], force=options["force"])
            return
        if options["force"]:
            raise CommandError("--force only goes with --redis.")
        batch = options["batch_size"]
        if not 1 <= batch <= MAX_BATCH:
            raise CommandError(f"--batch-size must be 1 to {MAX_BATCH}, got {batch}.")
        now = timezone.now()
        database = options["database"]
        live_claim = Q(status=IdempotencyRecord.Status.RUNNING, lease_expires_at__gt=now)
        expired = Q(expires_at__lt=now) & ~live_claim
        # Delivered messages are kept as long as records: a replay finds its key, sends nothing.
        kept = now - timedelta(seconds=conf.get().IDEMPOTENCY_TTL)
        delivered = Q(status=OutboxStatus.DELIVERED, delivered_at__lt=kept)
        for what, rows, condition, order in (
            ("expired idempotency record(s)", IdempotencyRecord, expired, "expires_at"),
            ("delivered outbox message(s)", OutboxMessage, delivered, "delivered_at"),
        ):
            table = rows.objects.using(database)
            found = table.filter(condition)
            if options["dry_run"]:
                self.stdout.write(f"{found.count()} {what} would be deleted.")
                continue
            total = 0
            batches = 0
            while ids := list(found.order_by(order).values_list("pk", flat=True)[:batch]):
                total += table.filter(condition, pk__in=ids).delete()[0]
                batches += 1
            self.stdout.write(f"Deleted {total} {what} in {batches} batch(es).")

    def _purge_redis(self, *, dry_run: bool, force: bool) -> None:
        prefix = conf.get().KEY_PREFIX
        try:
            held = cleanup.held_locks()
            if held and not force and not dry_run:
                raise CommandError(
                    f"{held} lock(s) are held right now: stop the workers first, or pass --force."
                )
            other = cleanup.other_project(connection(conf.get().REDIS_ALIAS), claim=False)
            if other and not force and not dry_run:
                raise CommandError(
                    f"The keys under {prefix!r} belong to another project ({other}; its "
                    "SECRET_KEY differs): not removed. Pass --force to remove them anyway."
                )
            found = cleanup.purge_redis(dry_run=dry_run)
        except REDIS_ERRORS as exc:
            raise CommandError(no_answer(exc)) from exc
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(found.kinds.items())) or "none"
        if dry_run:
            total = sum(found.kinds.values())
            self.stdout.write(f"{total} key(s) under {prefix!r}: ({kinds}) would be removed.")
        else:
            self.stdout.write(f"Removed {found.removed} key(s) under {prefix!r}: ({kinds}).")
