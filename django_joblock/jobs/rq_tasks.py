"""Django tasks on RQ with ``@locked_job``'s admission (docs/tasks.md), on top of django-tasks-rq::

    TASKS = {"default": {"BACKEND": "django_joblock.jobs.rq_tasks.RQBackend"}}

:class:`RQBackend` enqueues a ``@locked_task`` as ``@locked_job`` does (admission: parked FIFO per
resource by RQ's ``RateLimit``; ``dedupe``; the same checks in the caller) and any other task as
django-tasks-rq does. Workers run tasks with :class:`Job` (``joblock_worker``'s default job class
when django-tasks-rq is installed; ``rqworker --job-class django_joblock.jobs.rq_tasks.Job``),
which runs every other RQ job like ``rq.job.Job``, so one worker serves both."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any, cast

import django_tasks_rq
from django.utils.functional import cached_property
from django_tasks.base import TASK_MAX_PRIORITY, TaskResult, TaskResultStatus
from django_tasks.exceptions import TaskResultDoesNotExist
from django_tasks.signals import task_enqueued
from django_tasks_rq.backend import RQ_STATUS_TO_RESULT_STATUS, failed_callback, success_callback
from django_tasks_rq.compat import TASK_CLASSES
from rq import Callback
from rq.exceptions import NoSuchJobError
from rq.job import JobStatus
from rq.results import Result

from .enqueue import enqueue_call
from .queues import configured_names, get_queue, server_of

# rq 3's statuses of a job that has not run yet (RATE_LIMITED: parked by admission), which
# django-tasks-rq 0.12's map lacks: a parked task's get_result() raised KeyError.
for _status in JobStatus:
    RQ_STATUS_TO_RESULT_STATUS.setdefault(_status, TaskResultStatus.READY)


def _result_does_not_exist_bases() -> tuple[type[Exception], ...]:
    """django-tasks-rq raises the django-tasks backport's exception, on Django 6 too, where
    code catches ``django.tasks.exceptions.TaskResultDoesNotExist``: be both."""
    try:
        from django.tasks import exceptions
    except ImportError:  # Django 5.2: the backport is Django's task framework
        return (TaskResultDoesNotExist,)
    return (TaskResultDoesNotExist, exceptions.TaskResultDoesNotExist)


SCHEDULE_SETTLE = 2.0  # seconds a job may be scheduled but not yet in RQ's scheduled registry


class ResultDoesNotExist(*_result_does_not_exist_bases()):  # type: ignore[misc]
    """No task result of that id: catchable as the backport's ``TaskResultDoesNotExist`` and,
    on Django 6, as ``django.tasks.exceptions.TaskResultDoesNotExist``."""


class RQBackend(django_tasks_rq.RQBackend):
    """django-tasks-rq's backend; a ``@locked_task`` is enqueued with ``@locked_job``'s flow."""

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> Any:
        spec = getattr(task.func, "spec", None)
        if spec is None:
            return super().enqueue(task, args, kwargs)
        self.validate_task(task)
        options = {
            "on_success": Callback(task_succeeded),
            "on_failure": Callback(task_failed),
            "meta": {"backend_name": self.alias},
            "at_front": task.priority == TASK_MAX_PRIORITY,
        }
        where = {"queue_name": task.queue_name, "at": task.run_after}
        job = enqueue_call(spec, task.module_path, tuple(args), dict(kwargs), options, **where)
        result: Any = TaskResult(
            task=task,
            id=job.id,
            status=TaskResultStatus.READY,
            enqueued_at=job.enqueued_at,
            started_at=None,
            last_attempted_at=None,
            finished_at=None,
            args=list(args),
            kwargs=dict(kwargs),
            backend=self.alias,
            errors=[],
            worker_ids=[],
        )
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> Any:
        """By :class:`Job` (django-tasks-rq's reads a requeued task's return value wrong).

        django-tasks-rq reads a scheduled job's time from RQ's scheduled registry, and finds
        none while RQ moves the job in or out of it: rq writes a retried job's ``scheduled``
        status before its pipeline adds the job to the registry, and its scheduler moves due
        jobs out. Such a read is repeated for up to :data:`SCHEDULE_SETTLE` s; a job RQ no
        longer has is :class:`ResultDoesNotExist` at once.

        The job is looked for on the connection of each of the backend's queues (django-rq's
        ``"default"`` first, each Redis server and database once): a task enqueued on a queue
        of another Redis database is found there (django-tasks-rq looks on ``"default"``'s
        connection only)."""
        deadline = time.monotonic() + SCHEDULE_SETTLE
        while True:
            job = self._fetch(result_id)
            if job is None:
                raise ResultDoesNotExist(result_id)
            try:
                return job.task_result
            except NoSuchJobError:
                if time.monotonic() >= deadline:
                    message = f"{result_id}: scheduled for {SCHEDULE_SETTLE} s without a time"
                    raise ResultDoesNotExist(message) from None
            time.sleep(0.01)

    def _fetch(self, result_id: str) -> Job | None:
        """The RQ job ``result_id`` from the first connection that has it, or None."""
        for connection in self._connections():
            try:
                return cast(Job, Job.fetch(result_id, connection=connection))
            except NoSuchJobError:
                continue
        return None

    def _connections(self) -> list[Any]:
        """The Redis connections of django-rq's ``"default"`` queue and of the backend's
        queues, in that order, one per Redis server and database (a name ``RQ_QUEUES`` lacks,
        which django-tasks-rq's check reports, has none)."""
        known = configured_names()
        found: dict[tuple[Any, ...], Any] = {}
        for name in ["default", *sorted(self.queues)]:
            if name not in known:
                continue
            connection = get_queue(name).connection
            found.setdefault(server_of(connection), connection)
        return list(found.values())


WRONG_JOB_CLASS = (
    "a Django task ran on an RQ worker without django-joblock's job class: start the workers "
    "with manage.py joblock_worker, or give rqworker --job-class django_joblock.jobs.rq_tasks.Job"
)


def _require_task_job(job: Any) -> None:
    if not isinstance(job, Job):
        raise TypeError(f"job {job.id}: {WRONG_JOB_CLASS}")


def task_succeeded(job: Any, connection: Any, result: Any) -> None:
    """django-tasks-rq's success callback, after checking the worker's job class."""
    _require_task_job(job)
    success_callback(job, connection, result)


def task_failed(job: Any, connection: Any, exc_type: Any, exc_value: Any, tb: Any) -> None:
    """django-tasks-rq's failure callback, after checking the worker's job class (without it,
    the callback failed with ``AttributeError: ... task_result``)."""
    _require_task_job(job)
    failed_callback(job, connection, exc_type, exc_value, tb)


class _Plain:
    """An RQ job's function that is no task, called as django-tasks-rq's ``Job`` calls tasks;
    an ``async def`` job's coroutine runs to its end, as ``rq.job.Job`` runs it."""

    takes_context = False

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func

    def call(self, *args: Any, **kwargs: Any) -> Any:
        result = self.func(*args, **kwargs)
        return asyncio.run(result) if inspect.iscoroutine(result) else result


class Job(django_tasks_rq.Job):
    """django-tasks-rq's job class for tasks, ``rq.job.Job`` for every other job. A task's
    return value is its latest run's (a requeued task has the ``Retry`` of each earlier one)."""

    @property
    def is_task(self) -> bool:
        return isinstance(super(django_tasks_rq.Job, self).func, TASK_CLASSES)

    @property
    def func(self) -> Any:
        found = super(django_tasks_rq.Job, self).func  # rq's: the function, not checked
        return found if isinstance(found, TASK_CLASSES) else _Plain(found)

    def perform(self) -> Any:  # rq's for a plain job: no task_started signal
        return super().perform() if self.is_task else super(django_tasks_rq.Job, self).perform()

    @cached_property
    def task_result(self) -> Any:
        found = super().task_result
        if len(found.worker_ids) < 2:  # one run at most: django-tasks-rq read its result
            return found
        latest = self.latest_result()
        if latest is not None and latest.type == Result.Type.SUCCESSFUL:
            # Django's TaskResult has no public setter for it (init=False): its own backends
            # and django-tasks-rq set the field this way.
            object.__setattr__(found, "_return_value", latest.return_value)
        return found
