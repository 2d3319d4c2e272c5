"""``manage.py joblock_release RESOURCE --reason R [--owner H | --token T] [--slot N]``: force
release the lock of the holder named by its owner hash (as ``joblock_locks`` shows it) or token,
else of whoever holds it now; ``--slot`` picks one holder of a lock with a limit (default 0, a
plain lock's), the others keep theirs. A compare-and-delete, audited; exit status 1 when nothing
was released."""

from __future__ import annotations

import getpass
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.exceptions import LockBackendUnavailable
from django_joblock.monitor.control import force_release, validate_slot


class Command(BaseCommand):
    help = "Force-release a django-joblock lock (audited)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("resource")
        parser.add_argument("--reason", required=True, help="Why (kept in the audit log).")
        parser.add_argument(
            "--owner", help="Only release if the holder with this owner hash still holds it."
        )
        parser.add_argument(
            "--token", help="Only release if the holder with this owner token still holds it."
        )
        parser.add_argument(
            "--slot",
            type=int,
            default=0,
            help="The slot of the holder to release, for a lock with a limit (joblock_locks "
            "shows it); default 0.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        actor = f"joblock_release ({getpass.getuser()})"
        given = {name: options[name] for name in ("reason", "owner", "token")}
        try:
            slot = validate_slot("--slot", options["slot"])
            result = force_release(options["resource"], actor=actor, slot=slot, **given)
        except (ValueError, LockBackendUnavailable) as exc:
            raise CommandError(str(exc)) from exc
        named = f"{options['resource']} slot {slot}" if slot else options["resource"]
        self.stdout.write(f"{named}: {result.outcome}")
        if not result.released:
            sys.exit(1)
