"""``manage.py joblock_worker [queues] [--burst] [--with-scheduler] [--simple] [...]``.

An RQ worker on the queues ``@locked_job`` uses (django-rq's ``RQ_QUEUES`` when installed, else
the ``REDIS_ALIAS`` connection), with django-rq ``rqworker``'s options; run ``--with-scheduler``
on at least one worker per requeueing queue (requeue delays are scheduled jobs). Queues on
different Redis connections need a worker each. System checks run at start without database
probes: a job's long transaction must not stop a worker from starting."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils.module_loading import import_string
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.worker import BaseWorker

from django_joblock.exceptions import JoblockConfigError
from django_joblock.jobs.queues import get_queue, server_of
from django_joblock.worker import JoblockSimpleWorker, JoblockWorker, default_job_class

POSITIVE = ("max_jobs", "maintenance_interval", "worker_ttl", "max_idle_time")
# The largest value of those (seconds, or jobs): past about 9e15 s Redis refuses the worker
# key's EXPIRE, a traceback at the worker's start instead of a message naming the option.
MAX_OPTION = 1_000_000_000


class Command(BaseCommand):
    help = "Run an RQ worker for django-joblock jobs."

    def check(self, *args: Any, **kwargs: Any) -> None:
        kwargs["databases"] = []  # no database probes at start (see the module docs)
        super().check(*args, **kwargs)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "queues", nargs="*", default=["default"], help="Queue names by priority."
        )
        parser.add_argument("--burst", action="store_true", help="Exit when the queues are empty.")
        parser.add_argument(
            "--with-scheduler", action="store_true", help="Also run RQ's scheduler."
        )
        parser.add_argument(
            "--simple", action="store_true", help="Run jobs in this process (SimpleWorker)."
        )
        parser.add_argument("--name", help="Worker name.")
        parser.add_argument("--max-jobs", type=int, help="Exit after this many jobs.")
        parser.add_argument(
            "--worker-class", help="Dotted path of an RQ Worker class (default: JoblockWorker)."
        )
        parser.add_argument("--job-class", help="Dotted path of an RQ Job class.")
        parser.add_argument("--serializer", help="Dotted path of an RQ serializer (as enqueued).")
        parser.add_argument("--worker-ttl", type=int, help="Seconds the worker's heartbeat lives.")
        parser.add_argument("--max-idle-time", type=int, help="Exit after this many idle seconds.")
        parser.add_argument("--pid", help="Write the worker's pid to this file.")
        parser.add_argument(
            "--maintenance-interval", type=int, help="Seconds between RQ clean-ups (default 60)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            queues = [get_queue(name) for name in options["queues"]]
        except (JoblockConfigError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        servers = {str(queue.name): server_of(queue.connection) for queue in queues}
        if len(set(servers.values())) > 1:
            where = ", ".join(f"{n} -> {s}" for n, s in servers.items())
            raise CommandError(f"Queues on different Redis connections need a worker each: {where}")
        for option in POSITIVE:
            value = options[option]
            name = option.replace("_", "-")
            if value is not None and value < 1:
                raise CommandError(f"--{name} must be >= 1, got {value}.")
            if value is not None and value > MAX_OPTION:
                raise CommandError(f"--{name} must be <= {MAX_OPTION}, got {value}.")
        worker_class = self._worker_class(options["worker_class"], simple=options["simple"])
        given = ("maintenance_interval", "worker_ttl", "job_class", "serializer")
        extra = {key: options[key] for key in given if options[key] is not None}
        job_class = default_job_class()  # tasks and plain jobs
        if "job_class" not in extra and job_class is not None:
            extra["job_class"] = job_class
        try:
            worker = worker_class(
                queues, connection=queues[0].connection, name=options["name"], **extra
            )
        except (ImportError, ValueError, TypeError) as exc:  # a bad --job-class/--serializer
            raise CommandError(f"Cannot start the worker: {exc}") from exc
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise _no_redis(exc) from exc
        if options["pid"]:
            try:
                Path(options["pid"]).write_text(str(os.getpid()))
            except OSError as exc:
                raise CommandError(f"--pid {options['pid']!r}: cannot write the pid file: {exc}")
        _work(worker, options)

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
            raise CommandError(f"--worker-class {dotted!r} is not an RQ worker class.")
        if not issubclass(found, (JoblockWorker, JoblockSimpleWorker)):
            # Allowed (it may close connections its own way), but said.
            sys.stderr.write(
                f"Warning: {dotted} does not derive from django_joblock.worker.JoblockWorker: "
                "database connections are not closed before each fork.\n"
            )
        return found


def _work(worker: Any, options: dict[str, Any]) -> None:
    """Run the worker's loop; a start that fails is one line, not RQ's traceback."""
    run = ("burst", "with_scheduler", "max_jobs", "max_idle_time")
    try:  # once started, RQ's loop and ours ride outages out
        worker.work(**{name: options[name] for name in run})
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise _no_redis(exc) from exc
    except ValueError as exc:  # RQ's: a live worker has the name (a dead one's is taken over)
        raise CommandError(f"Cannot start the worker: {exc}") from exc


def _no_redis(exc: Exception) -> CommandError:
    """One line, not RQ's traceback: a supervisor restarting the worker logs it every time."""
    return CommandError(f"Cannot start the worker: Redis does not answer ({exc})")
