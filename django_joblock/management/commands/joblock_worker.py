"""``manage.py joblock_worker [queues] [--burst] [--with-scheduler] [--simple]``.

Runs an RQ worker with Django set up, on the queues ``@locked_job`` uses (django-rq's
``RQ_QUEUES`` when installed, else the ``JOBLOCK["REDIS_ALIAS"]`` connection). Use
``--with-scheduler`` on at least one worker per queue that requeues on contention: requeue
delays are scheduled jobs.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_joblock.queues import get_queue
from django_joblock.worker import JoblockSimpleWorker, JoblockWorker


class Command(BaseCommand):
    help = "Run an RQ worker for django-joblock jobs."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "queues",
            nargs="*",
            default=["default"],
            help="Queue names, in priority order (default: default).",
        )
        parser.add_argument("--burst", action="store_true", help="Exit when the queues are empty.")
        parser.add_argument(
            "--with-scheduler",
            action="store_true",
            help="Also run RQ's scheduler (needed for requeue delays).",
        )
        parser.add_argument(
            "--simple",
            action="store_true",
            help="Run jobs in this process (SimpleWorker), without forking.",
        )
        parser.add_argument("--name", default=None, help="Worker name.")
        parser.add_argument("--max-jobs", type=int, default=None, help="Exit after this many jobs.")
        parser.add_argument(
            "--maintenance-interval",
            type=int,
            default=None,
            help="Seconds between RQ's registry clean-ups (RQ's default: 600). It bounds how "
            "soon the jobs of a worker that died are retried and a dead scheduler is replaced.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        queues = [get_queue(name) for name in options["queues"]]
        worker_class = JoblockSimpleWorker if options["simple"] else JoblockWorker
        extra = {}
        if options["maintenance_interval"] is not None:
            extra["maintenance_interval"] = options["maintenance_interval"]
        worker = worker_class(
            queues, connection=queues[0].connection, name=options["name"], **extra
        )
        worker.work(
            burst=options["burst"],
            with_scheduler=options["with_scheduler"],
            max_jobs=options["max_jobs"],
        )
