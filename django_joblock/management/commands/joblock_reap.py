"""``manage.py joblock_reap [--dry-run]``: release locks whose holder is dead.

A holder is dead when the lock has not been renewed for half its TTL *and* its RQ job is gone
or no longer started, its RQ worker has vanished, or its process is gone on this host. Live
holders, including orphaned work horses that still heartbeat, are left alone. Each release is
a compare-and-delete recorded in the lock audit log.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_joblock.control import reap


class Command(BaseCommand):
    help = "Release django-joblock locks whose RQ job, worker or process is dead."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Only list what would go.")

    def handle(self, *args: Any, **options: Any) -> None:
        done = reap(dry_run=options["dry_run"])
        for resource, outcome in done:
            self.stdout.write(f"{resource}: {outcome}")
        self.stdout.write(f"{len(done)} lock(s) with a dead holder.")
