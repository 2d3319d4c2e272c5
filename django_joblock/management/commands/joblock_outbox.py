"""``manage.py joblock_outbox [--limit N] [--every SECONDS] [--database ALIAS]``: deliver the
due outbox messages (:mod:`django_joblock.outbox`): failed ones at their next backoff time, and
those whose process died between the commit and the delivery; once, or every ``--every`` s."""

from __future__ import annotations

import math
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, close_old_connections, connections

from django_joblock import outbox

MAX_LIMIT = 1_000_000  # messages one pass may take (a SQL LIMIT: 64 bits at most)


class Command(BaseCommand):
    help = "Deliver due outbox messages (side effects recorded with send_after_commit)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--limit", type=int, default=100, help="Messages per pass (default 100)."
        )
        parser.add_argument(
            "--every", type=float, help="Seconds between passes; run until stopped."
        )
        parser.add_argument(
            "--database", choices=tuple(connections), help="Database alias (default: routed)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        limit = options["limit"]
        every = options["every"]
        if limit < 1:
            raise CommandError(f"--limit must be at least 1, got {limit}")
        if limit > MAX_LIMIT:
            raise CommandError(f"--limit must be at most {MAX_LIMIT}, got {limit}")
        if every is not None and not (math.isfinite(every) and 0.1 <= every <= 86400):
            raise CommandError(f"--every must be between 0.1 and 86400 seconds, got {every}")
        while True:
            try:
                report = outbox.deliver_due(limit=limit, using=options["database"])
            except DatabaseError as exc:
                if every is None:
                    raise CommandError(f"outbox: the database failed: {exc}") from exc
                # A terminated connection, a restart: a sweeper goes on with a new connection.
                self.stderr.write(f"outbox: the database failed ({exc}); retrying in {every:g}s")
                close_old_connections()  # drops the broken connection
            else:
                self.stdout.write(
                    f"outbox: {report.delivered} delivered, {report.failed} failed, "
                    f"{report.pending} pending"
                )
                if every is None:
                    return
            time.sleep(every)
