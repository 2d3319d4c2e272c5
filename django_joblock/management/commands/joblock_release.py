"""``manage.py joblock_release RESOURCE --reason R [--owner H | --token T]``: audited force
release.

``--owner`` names the holder by its 12-character owner hash (as ``joblock_locks`` and the
dashboard show it), ``--token`` by the owner token itself; with neither, whoever holds the lock
now. Always a compare-and-delete, written to the lock audit log. Exit status 1 when nothing
was released; a Redis that does not answer is a ``CommandError`` saying whether the release
may have happened.
"""

from __future__ import annotations

import getpass
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.exceptions import LockBackendUnavailable
from django_joblock.monitor.control import force_release


class Command(BaseCommand):
    help = "Force-release a django-joblock lock (audited)."

    def add_arguments(self, parser: CommandParser) -> None:
        add = parser.add_argument
        add("resource")
        add("--reason", required=True, help="Why (kept in the audit log).")
        add("--owner", help="Only release if the holder with this owner hash still holds it.")
        add("--token", help="Only release if the holder with this owner token still holds it.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = force_release(
                options["resource"],
                reason=options["reason"],
                owner=options["owner"],
                token=options["token"],
                actor=f"joblock_release ({getpass.getuser()})",
            )
        except (ValueError, LockBackendUnavailable) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{options['resource']}: {result.outcome}")
        if not result.released:
            sys.exit(1)
