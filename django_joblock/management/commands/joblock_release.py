"""``manage.py joblock_release RESOURCE --reason R [--token T]``: audited force release.

``--token`` is the owner to release (its 12-character hash as shown by ``joblock_locks`` or the
dashboard, or the token itself); without it, whoever holds the lock right now. Either way it is
a compare-and-delete, never a blind DEL, and it is written to the lock audit log.
Exit status 1 when nothing was released; a Redis that does not answer is a ``CommandError``
saying whether the release may have happened.
"""

from __future__ import annotations

import getpass
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.control import force_release
from django_joblock.exceptions import LockBackendUnavailable


class Command(BaseCommand):
    help = "Force-release a django-joblock lock (audited)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("resource")
        parser.add_argument("--reason", required=True, help="Why (kept in the audit log).")
        parser.add_argument(
            "--token",
            default=None,
            help="Only release if this owner (hash or token) still holds it.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            result = force_release(
                options["resource"],
                reason=options["reason"],
                owner=options["token"],
                actor=f"joblock_release ({getpass.getuser()})",
            )
        except (ValueError, LockBackendUnavailable) as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{options['resource']}: {result.outcome}")
        if not result.released:
            sys.exit(1)
