"""``manage.py joblock_alerts [--json]``: print the alerts firing now; exit 1 if any fires.
Run it every minute (cron, a monitoring agent): each run also records the active-lock count
that the ``active_growth`` alert compares over time."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.backend import REDIS_ERRORS, no_answer
from django_joblock.monitor.alerts import evaluate


class Command(BaseCommand):
    help = "Evaluate django-joblock alerts; exit status 1 when any fires."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the alerts as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            fired = evaluate()
        except REDIS_ERRORS as exc:
            raise CommandError(no_answer(exc)) from exc
        if options["json"]:
            self.stdout.write(json.dumps([asdict(alert) for alert in fired], indent=2))
        elif not fired:
            self.stdout.write("No alerts.")
        else:
            for alert in fired:
                where = f" [{alert.family}]" if alert.family else ""
                self.stdout.write(f"ALERT {alert.name}{where}: {alert.message}")
        if fired:
            sys.exit(1)
