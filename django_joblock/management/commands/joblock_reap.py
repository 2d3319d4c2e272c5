"""``manage.py joblock_reap [--dry-run]``: release the locks whose holder is dead (see
:mod:`django_joblock.monitor.health`) by an audited compare-and-delete, the evidence as its
reason; a lock renewed meanwhile is refused."""

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
