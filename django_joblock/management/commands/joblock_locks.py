"""``manage.py joblock_locks [--family F] [--stuck] [--json] [--limit N]``: the active locks,
each with its fields, its ``health`` and ``why`` (the evidence). A lock with a limit has a row
per holder, with its ``slot`` and the ``limit`` (1 for a plain lock, whose text row shows
neither)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.backend import REDIS_ERRORS, no_answer
from django_joblock.locks.keys import validate_family
from django_joblock.monitor.active import active_locks
from django_joblock.monitor.health import Health, holder_health

MAX_LIMIT = 1_000_000  # entries one family's index read may ask for


class Command(BaseCommand):
    help = "List active django-joblock locks with their holders and health."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--family", help="Only this family (the part before the first ':').")
        parser.add_argument(
            "--stuck", action="store_true", help="Only locks whose holder is dead or overdue."
        )
        parser.add_argument("--json", action="store_true", help="Print JSON.")
        parser.add_argument("--limit", type=int, default=1000, help="At most this many per family.")

    def handle(self, *args: Any, **options: Any) -> None:
        if not 1 <= options["limit"] <= MAX_LIMIT:
            raise CommandError(f"--limit must be 1 to {MAX_LIMIT}, got {options['limit']}.")
        try:
            if options["family"] is not None:
                validate_family(options["family"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        try:
            locks = active_locks(family=options["family"], limit=options["limit"])
            health = holder_health(locks)
        except REDIS_ERRORS as exc:
            raise CommandError(no_answer(exc)) from exc
        rows = []
        for active, state in zip(locks, health, strict=True):
            row = {**asdict(active), "health": state.state.value, "why": state.why}
            row.pop("read_ms", None)
            if not options["stuck"] or state.state != Health.HEALTHY:
                rows.append(row)
        if options["json"]:
            self.stdout.write(json.dumps(rows, indent=2))
            return
        if not rows:
            self.stdout.write("No stuck locks." if options["stuck"] else "No active locks.")
        for row in rows:
            why = f" why={row['why']}" if row["why"] else ""
            slot = f" slot {row['slot']}/{row['limit']}" if row["limit"] > 1 else ""
            self.stdout.write(
                f"{row['resource']:40} {row['health']:12}{slot} fence={row['fence']} "
                f"active={row['held_for']:.1f}s ttl_left={row['pttl_ms'] / 1000:.1f}s "
                f"holder={row['host']}:{row['pid']} job={row['job_id'] or '-'} "
                f"worker={row['worker'] or '-'} owner={row['owner']}{why}"
            )
