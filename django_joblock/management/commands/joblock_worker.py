"""``manage.py joblock_worker [queues] [--burst] [--with-scheduler] [--simple]``.

Runs an RQ worker with Django set up, on the queues ``@locked_job`` uses (django-rq's
``RQ_QUEUES`` when installed, else the ``JOBLOCK["REDIS_ALIAS"]`` connection). Use
``--with-scheduler`` on at least one worker per queue that requeues on contention: requeue
delays are scheduled jobs.

With django-rq installed, a queue name missing from ``RQ_QUEUES`` is an error listing the
known names (as django-rq's ``rqworker`` refuses it), never a silent queue on another Redis.
Queues on different Redis connections cannot share one worker (RQ reads them all through one
connection): that is an error too; start one worker per connection.

The system checks run at start without database probes (``databases=[]``): a worker must start
while a job elsewhere holds a long transaction (on SQLite that transaction holds the database
lock, which Django's JSON-support probe would wait for); ``manage.py check`` and ``migrate``
still probe the databases.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_joblock.exceptions import JoblockConfigError
from django_joblock.queues import get_queue, server_of
from django_joblock.worker import JoblockSimpleWorker, JoblockWorker


class Command(BaseCommand):
    help = "Run an RQ worker for django-joblock jobs."

    def check(self, *args: Any, **kwargs: Any) -> None:
        kwargs["databases"] = []  # no database probes at start (see the module docs)
        super().check(*args, **kwargs)

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
            help="Seconds between RQ's registry clean-ups (default 60; RQ's own: 600). It "
            "bounds how soon the jobs of a worker that died are retried, their resource's next "
            "waiting job starts, and a dead scheduler is replaced.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            queues = [get_queue(name) for name in options["queues"]]
        except (JoblockConfigError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        servers = {
            name: server_of(q.connection) for name, q in zip(options["queues"], queues, strict=True)
        }
        if len(set(servers.values())) > 1:
            raise CommandError(
                "These queues live on different Redis connections and cannot share one "
                f"worker: {', '.join(f'{n} -> {s}' for n, s in servers.items())}. Start one "
                "worker per connection."
            )
        for option in ("max_jobs", "maintenance_interval"):
            if options[option] is not None and options[option] < 1:
                raise CommandError(
                    f"--{option.replace('_', '-')} must be >= 1, got {options[option]}."
                )
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
