"""``manage.py joblock_demo [--short]``: the whole story on real workers, then a checked report.

Redis: ``REDIS_URL`` (default redis://127.0.0.1:6379/0); if none answers and redis-server is on
PATH, a private one that the demo starts and stops. Database: the example site's SQLite file.
Exit status 1 when an invariant of the report fails.
"""

from __future__ import annotations

import sys
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.test import override_settings

from example_site.shop.demo import Demo, DemoError, redis_url_or_private


class Command(BaseCommand):
    help = "Run the django-joblock demo: real RQ workers, duplicates, faults, checked report."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--short", action="store_true", help="Fewer jobs (used by CI).")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            url, private = redis_url_or_private(self.stdout)
        except DemoError as exc:
            raise CommandError(str(exc)) from exc
        cache = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}
        try:
            with override_settings(CACHES={"default": cache}):
                report = self.run_demo(url, short=options["short"])
        finally:
            if private is not None:
                private.stop()
        self.stdout.write("\nReport")
        self.stdout.write("------")
        width = max(len(label) for label, _ in report.lines)
        for label, value in report.lines:
            self.stdout.write(f"  {label:<{width}}  {value}")
        if report.failures:
            self.stdout.write(
                self.style.ERROR(
                    f"\n{len(report.failures)} invariant(s) failed: {', '.join(report.failures)}"
                )
            )
            sys.exit(1)
        self.stdout.write(self.style.SUCCESS("\nAll invariants hold."))
        self.stdout.write(
            "\nSee what happened in the admin:\n"
            "  .venv/bin/python manage.py runserver   (or python, in the virtualenv you use)\n"
            "  open http://127.0.0.1:8000/admin/django_joblock/dashboard/  (user demo, password "
            "demo)\n"
            "Job locks shows contention, requeues, duplicates blocked and hold times; the "
            "idempotency records and the shop's orders, refunds and receipts are listed too."
            + (
                ""
                if private is None
                else "\n(The private Redis has stopped: run the admin "
                "against your own Redis via REDIS_URL to see live metrics.)"
            )
        )

    def run_demo(self, url: str, *, short: bool) -> Any:
        from django.contrib.auth.models import User

        call_command("migrate", verbosity=0)
        if not User.objects.filter(username="demo").exists():
            User.objects.create_superuser("demo", "demo@example.com", "demo")
        self.stdout.write(f"Redis: {url}")
        return Demo(self.stdout, short=short, redis_url=url).run()
