"""``@locked_task``: a Django task (``django.tasks`` on Django 6, the django-tasks backport on
5.2) whose function runs ``@locked_job``'s safe flow (docs/tasks.md). What a busy resource does
depends on the backend: on :class:`django_joblock.jobs.rq_tasks.RQBackend` everything
``@locked_job`` does on RQ (admission, FIFO, requeue with backoff, ``max_wait``); on a backend
that runs the task where it cannot requeue (immediate, database) the run waits up to
``ACQUIRE_WAIT`` and then fails with :class:`~django_joblock.exceptions.LockNotAcquired`, a
``FAILED`` result naming the holder (``on_conflict="skip"``: finished, not run). Arguments,
resource and key are checked in ``enqueue()``, in the caller."""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

from ..exceptions import JoblockConfigError
from .decorator import locked_job
from .spec import JobSpec

try:  # Django >= 6.0
    from django.tasks.base import DEFAULT_TASK_BACKEND_ALIAS, DEFAULT_TASK_QUEUE_NAME, Task
except ImportError:  # Django 5.2: pip install django-tasks
    from django_tasks.base import (  # type: ignore[import-not-found,no-redef,assignment,unused-ignore]
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
    )


_context: contextvars.ContextVar[Any] = contextvars.ContextVar("django_joblock_task_context")


class LockedTask(Task):  # type: ignore[type-arg,misc,unused-ignore]
    """A ``Task`` whose ``func`` is a ``@locked_job`` function; ``spec``: what it was told."""

    __slots__ = ()

    @property
    def spec(self) -> JobSpec[Any, Any]:
        return cast(JobSpec[Any, Any], cast(Any, self.func).spec)  # set by @locked_job

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise ``TypeError`` / ``ValueError`` now for arguments the task cannot run with."""
        arguments = self.spec.bind(args, kwargs)
        self.spec.resource(arguments)
        self.spec.key(arguments)

    def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        self.check(args, kwargs)
        return super().enqueue(*args, **kwargs)

    async def aenqueue(self, *args: Any, **kwargs: Any) -> Any:
        self.check(args, kwargs)
        return await super().aenqueue(*args, **kwargs)


def _on_rq(task: LockedTask) -> bool:
    """Does the task's backend run it on RQ (django-tasks-rq's backend, or ours)? The others
    have no RQ queue for the checks' queue and scheduler findings, nor requeue."""
    try:
        from django_tasks_rq import RQBackend
    except ImportError:
        return False
    return isinstance(task.get_backend(), RQBackend)


def _without_context(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` called with the task's context (set by the task's wrapper) as its first
    argument: a coroutine function for an ``async def``, so the flow awaits it."""
    if inspect.iscoroutinefunction(func):

        async def awaited(*args: Any, **kwargs: Any) -> Any:
            return await func(_context.get(), *args, **kwargs)

        return awaited

    def called(*args: Any, **kwargs: Any) -> Any:
        return func(_context.get(), *args, **kwargs)

    return called


def _refuse_a_plain_rq_backend(task: LockedTask) -> None:
    """:class:`JoblockConfigError` for a task on django-tasks-rq's own backend, which would
    enqueue it without ``@locked_job``'s flow: no admission, the job's options ignored, a
    requeue's ``Retry`` stored as the task's return value."""
    from .rq_tasks import RQBackend

    backend = task.get_backend()
    if not isinstance(backend, RQBackend):
        raise JoblockConfigError(
            f"@locked_task {task.name}: TASKS[{task.backend!r}] is "
            f"{type(backend).__module__}.{type(backend).__name__}, which enqueues without "
            "django-joblock's flow; use 'django_joblock.jobs.rq_tasks.RQBackend' (docs/tasks.md)"
        )


def locked_task(
    function: Callable[..., Any] | None = None,
    /,
    *,
    priority: int = 0,
    queue_name: str = DEFAULT_TASK_QUEUE_NAME,
    backend: str = DEFAULT_TASK_BACKEND_ALIAS,
    takes_context: bool = False,
    **options: Any,
) -> Callable[[Callable[..., Any]], LockedTask]:
    """Django's ``@task`` (``priority``, ``queue_name``, ``backend``, ``takes_context``: the
    context is not one of the arguments templates and fingerprints see) with ``@locked_job``'s
    keywords: ``lock``, ``idempotency_key``, ``ttl``... (same meanings and checks; docs/jobs.md),
    RQ's enqueue options among them (``job_timeout``, ``retry``...: the RQ backend only). Not
    ``on_commit``: enqueue in ``transaction.on_commit``, as Django advises."""
    if function is not None:
        name = getattr(function, "__qualname__", repr(function))
        raise TypeError(
            "@locked_task takes keywords, e.g. @locked_task(lock='order:{order_id}'); "
            f"got the function {name!r}"
        )
    if "on_commit" in options:
        raise ValueError(
            "@locked_task: on_commit= is @locked_job's; "
            "enqueue in transaction.on_commit(lambda: ...)"
        )
    make = locked_job(queue_name, on_commit=False, **options)

    def decorate(func: Callable[..., Any]) -> LockedTask:
        if isinstance(func, Task):
            raise TypeError(f"@locked_task {func.name}: put @locked_task in place of @task")
        if inspect.isasyncgenfunction(func):
            raise TypeError(
                f"@locked_task {func.__qualname__}: an async generator is not a task (its "
                "values would be lost)"
            )
        if not takes_context:
            locked = make(func)  # an async def's body is awaited inside the flow (@locked_job)
        else:  # the flow runs the function without its context: templates, fingerprint
            params = list(inspect.signature(func).parameters.values())[1:]
            body = _without_context(func)
            functools.update_wrapper(body, func)
            del body.__wrapped__  # type: ignore[attr-defined]
            body.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
            inner = make(body)

            @functools.wraps(func)
            def locked(context: Any, *args: Any, **kwargs: Any) -> Any:
                token = _context.set(context)
                try:
                    return inner(*args, **kwargs)
                finally:
                    _context.reset(token)

            locked.spec = inner.spec
        task = LockedTask(
            func=locked,
            priority=priority,
            queue_name=queue_name,
            backend=backend,
            takes_context=takes_context,
        )
        task.spec.on_rq = _on_rq(task)
        if task.spec.on_rq:
            _refuse_a_plain_rq_backend(task)
        return task

    return decorate
