"""``manage.py joblock_doctor (--job ID | --key KEY [--scope S] | --resource R) [--json]``:
the story of one RQ job, idempotency key or resource, with the debugging steps' evidence and
verdicts (:mod:`django_joblock.monitor.doctor`). Read-only."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.backend import REDIS_ERRORS, no_answer
from django_joblock.exceptions import InvalidResource
from django_joblock.monitor.doctor import NotFound, diagnose, render


class Command(BaseCommand):
    help = "Explain what happened to a job, an idempotency key or a resource."

    def add_arguments(self, parser: CommandParser) -> None:
        # No default "": argparse would take --job "" for no value at all ("is required").
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--job", help="An RQ job id.")
        target.add_argument("--key", help="An idempotency key.")
        target.add_argument("--resource", help="A lock resource (order:123).")
        parser.add_argument("--scope", default="", help="The key's job, when several use it.")
        parser.add_argument("--json", action="store_true", help="Print the diagnosis as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        for name in ("job", "key", "resource", "scope"):  # --scope defaults to ""
            if name != "scope" and options[name] is not None and not options[name].strip():
                raise CommandError(f"--{name} is empty: give the {name} to explain.")
            if "\x00" in (options[name] or ""):
                raise CommandError(f"--{name} contains NUL: no {name} has one.")
        try:
            found = diagnose(
                job_id=options["job"] or "",
                key=options["key"] or "",
                scope=options["scope"],
                resource=options["resource"] or "",
            )
        except (NotFound, InvalidResource) as exc:
            raise CommandError(str(exc)) from exc
        except ValueError as exc:  # RQ refuses a job id it could never have made
            raise CommandError(f"--job {options['job']!r}: {exc}") from exc
        except REDIS_ERRORS as exc:
            raise CommandError(no_answer(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps(asdict(found), indent=2, default=str))
        else:
            self.stdout.write(render(found))
