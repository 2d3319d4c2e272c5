"""``manage.py joblock_reap [--dry-run]``: release locks whose holder is dead.

A holder is dead when its lock has not been renewed for half its TTL *and* its RQ job is gone
or no longer started, its RQ worker has vanished, or its process is gone on this host (see
:mod:`django_joblock.monitor.health`). Live holders, orphaned work horses that still renew
included, are left alone; a lock renewed after it was judged dead is refused. Each release is
a compare-and-delete, audited with the evidence as its reason.
"""

from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.backend import REDIS_ERRORS, no_answer
from django_joblock.exceptions import LockBackendUnavailable
from django_joblock.monitor.control import reap


class Command(BaseCommand):
    help = "Release django-joblock locks whose RQ job, worker or process is dead."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Only list what would go.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            done = reap(dry_run=options["dry_run"], actor=f"joblock_reap ({getpass.getuser()})")
        except LockBackendUnavailable as exc:
            raise CommandError(str(exc)) from exc
        except REDIS_ERRORS as exc:
            raise CommandError(no_answer(exc)) from exc
        for resource, outcome in done:
            self.stdout.write(f"{resource}: {outcome}")
        self.stdout.write(f"{len(done)} lock(s) with a dead holder.")
