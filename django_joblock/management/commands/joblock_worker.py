"""``manage.py joblock_worker [queues] [--burst] [--with-scheduler] [--simple] [...]``.

An RQ worker with Django set up, on the queues ``@locked_job`` uses (django-rq's ``RQ_QUEUES``
when installed, else the ``REDIS_ALIAS`` connection). Run ``--with-scheduler`` on at least one
worker per queue that requeues on contention: requeue delays are scheduled jobs. A queue name
missing from ``RQ_QUEUES`` is an error (as in django-rq's ``rqworker``), and so are queues on
different Redis connections (RQ reads them all through one): start one worker per connection.

The options are those of django-rq's ``rqworker``, under its names; with django-rq,
``rqworker --worker-class django_joblock.worker.JoblockWorker`` is the equivalent.

The system checks run at start without database probes: a worker must start while a job holds
a long transaction (on SQLite that holds the database lock Django's JSON-support probe waits
for); ``manage.py check`` and ``migrate`` still probe the databases.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.module_loading import import_string
from rq.worker import BaseWorker

from django_joblock.exceptions import JoblockConfigError
from django_joblock.jobs.queues import get_queue, server_of
from django_joblock.worker import JoblockSimpleWorker, JoblockWorker

POSITIVE = ("max_jobs", "maintenance_interval", "worker_ttl", "max_idle_time")


class Command(BaseCommand):
    help = "Run an RQ worker for django-joblock jobs."

    def check(self, *args: Any, **kwargs: Any) -> None:
        kwargs["databases"] = []  # no database probes at start (see the module docs)
        super().check(*args, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        add = parser.add_argument
        add(
            "queues",
            nargs="*",
            default=["default"],
            help="Queue names by priority (default: default).",
        )
        add("--burst", action="store_true", help="Exit when the queues are empty.")
        add(
            "--with-scheduler",
            action="store_true",
            help="Also run RQ's scheduler (requeue delays).",
        )
        add("--simple", action="store_true", help="Run jobs in this process (SimpleWorker).")
        add("--name", help="Worker name.")
        add("--max-jobs", type=int, help="Exit after this many jobs.")
        add(
            "--worker-class",
            help="Dotted path of an RQ Worker class (default: django_joblock.worker."
            "JoblockWorker, or JoblockSimpleWorker with --simple).",
        )
        add("--job-class", help="Dotted path of an RQ Job class.")
        add("--serializer", help="Dotted path of an RQ serializer (as enqueued).")
        add("--worker-ttl", type=int, help="Seconds the worker's heartbeat lives.")
        add("--max-idle-time", type=int, help="Exit after this many idle seconds.")
        add("--pid", help="Write the worker's pid to this file.")
        add(
            "--maintenance-interval",
            type=int,
            help="Seconds between RQ's registry clean-ups (default 60; RQ's own: 600): how soon "
            "a dead worker's jobs are retried, its resource's next job starts and a dead "
            "scheduler is replaced.",
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
        for option in POSITIVE:
            if options[option] is not None and options[option] < 1:
                name = option.replace("_", "-")
                raise CommandError(f"--{name} must be >= 1, got {options[option]}.")
        worker_class = self._worker_class(options["worker_class"], simple=options["simple"])
        extra = {
            key: options[key]
            for key in ("maintenance_interval", "worker_ttl", "job_class", "serializer")
            if options[key] is not None
        }
        try:
            worker = worker_class(
                queues, connection=queues[0].connection, name=options["name"], **extra
            )
        except (ImportError, ValueError, TypeError) as exc:  # a bad --job-class/--serializer
            raise CommandError(f"Cannot start the worker: {exc}") from exc
        if options["pid"]:
            try:
                with open(options["pid"], "w") as pid_file:
                    pid_file.write(str(os.getpid()))
            except OSError as exc:
                raise CommandError(f"--pid {options['pid']!r}: cannot write the pid file: {exc}")
        worker.work(
            burst=options["burst"],
            with_scheduler=options["with_scheduler"],
            max_jobs=options["max_jobs"],
            max_idle_time=options["max_idle_time"],
        )

    def _worker_class(self, dotted: str | None, *, simple: bool) -> Any:
        if dotted is None:
            return JoblockSimpleWorker if simple else JoblockWorker
        if simple:
            raise CommandError("--simple and --worker-class exclude each other.")
        try:
            found = import_string(dotted)
        except ImportError as exc:
            raise CommandError(f"--worker-class {dotted!r} cannot be imported: {exc}") from exc
        if not isinstance(found, type) or not issubclass(found, BaseWorker):
            raise CommandError(
                f"--worker-class {dotted!r} is not an RQ worker class (rq.worker.BaseWorker)."
            )
        if not issubclass(found, (JoblockWorker, JoblockSimpleWorker)):
            # Allowed (it may close connections its own way), but said.
            sys.stderr.write(
                f"Warning: {dotted} does not derive from django_joblock.worker.JoblockWorker: "
                "database connections are not closed before each fork, so a work horse may "
                "share its parent's connection.\n"
            )
        return found
