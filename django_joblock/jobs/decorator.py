"""``@locked_job``: RQ jobs that run the safe flow of :mod:`.runner` (docs/jobs.md). A decorated
function is called inline, or put on its queue with ``.delay(...)`` / ``.enqueue(...)`` (as
rq's ``@job`` and ``Queue.enqueue``) or ``.enqueue_call(args, kwargs, **rq_options)`` (as rq's
``Queue.enqueue_call``). Mistakes fail in the caller, never in a worker: template fields at
decoration; resource, key, scope, queue and RQ options at enqueue (:mod:`.enqueue`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from asgiref.sync import sync_to_async
from django.utils.module_loading import autodiscover_modules

from .. import conf
from ..idempotency.inputs import validate_scope
from ..locks.keys import validate_limit
from . import runner
from .enqueue import enqueue_call, split_enqueue_arguments
from .spec import (
    CONFLICT_POLICIES,
    JobSpec,
    OnConflict,
    Template,
    check_rq_options,
    check_template,
)

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class LockedJob(Protocol[P, R_co]):
    """What ``@locked_job`` returns: call it inline, or ``.delay()`` it onto the queue."""

    spec: JobSpec[Any, Any]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    async def adelay(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """``.delay()`` from async code, as Django's async ORM calls its sync half
        (``sync_to_async``: an enqueue on commit joins the caller's transaction)."""

    async def aenqueue(self, *args: Any, **kwargs: Any) -> Any:
        """``.enqueue()`` from async code (see :meth:`adelay`)."""

    def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        """As rq's ``Queue.enqueue``: the job's arguments, with RQ's options (``job_timeout``,
        ``retry``, ``job_id``...) among the keywords, or ``args=`` / ``kwargs=`` and options."""

    def enqueue_call(
        self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **rq_options: Any
    ) -> Any:
        """As rq's ``Queue.enqueue_call``: the job's arguments apart from RQ's options."""


registry: dict[str, JobSpec[Any, Any]] = {}  # every decorated job, by dotted name


def registered_jobs(*, rq_only: bool = True) -> list[JobSpec[Any, Any]]:
    """Every ``@locked_job`` and ``@locked_task`` (``rq_only``: only those that run on RQ, which
    the checks, alerts and dashboard look at), after importing the apps' ``jobs`` / ``tasks``."""
    autodiscover_modules("jobs", "tasks")
    found = (spec for spec in registry.values() if spec.on_rq or not rq_only)
    return sorted(found, key=lambda spec: spec.name)


def idempotency_scopes() -> set[str]:
    """The scopes the jobs and tasks record under, and ``idempotent()``'s default ``""``."""
    specs = registered_jobs(rq_only=False)
    return {spec.scope for spec in specs if spec.idempotency_key} | {""}


def locked_job(
    queue: Any,
    *,
    lock: Template = None,
    idempotency_key: Template = None,
    ttl: float | None = None,
    heartbeat: bool = True,
    on_conflict: str = OnConflict.REQUEUE,
    max_wait: float | None = None,
    on_lost: Callable[..., Any] | None = None,
    atomic: bool = True,
    admission: bool = True,
    dedupe: bool = False,
    on_commit: bool = True,
    scope: str | None = None,
    concurrency: int = 1,
    **rq_options: Any,
) -> Callable[[Callable[P, R]], LockedJob[P, R]]:
    """Decorate an RQ job function with the safe flow (:mod:`.runner`, docs/jobs.md): lock the
    resource, claim the idempotency key, run the body in one transaction, record, release.

    The decorated function still runs inline when called; ``.delay(*args, **kwargs)`` and
    ``.enqueue(*args, **kwargs)`` enqueue it as rq's ``Queue.enqueue`` does (RQ's options by
    name), ``.enqueue_call(args, kwargs, **rq_options)`` keeps the two apart.

    ``queue``: a queue name (django-rq's ``RQ_QUEUES`` when django-rq has it, else an RQ queue
    on the ``JOBLOCK["REDIS_ALIAS"]`` connection) or an ``rq.Queue``.

    ``lock``: the resource to lock, a ``str.format`` template over the bound arguments
    (``"order:{order_id}"``), a callable taking them as keywords, or None (no lock).

    ``idempotency_key``: the key whose success is recorded once (template, callable or None);
    a run of a key that succeeded before returns the stored result without running.

    ``ttl``: the lock's TTL in seconds (default ``JOBLOCK["LOCK_TTL"]``).

    ``heartbeat``: renew the lock while the body runs (default True).

    ``on_conflict``: what a run whose resource or key is busy does, an :class:`OnConflict`:
    ``"requeue"`` (default, with backoff and jitter), ``"skip"`` or ``"fail"``.

    ``max_wait``: seconds a job keeps requeueing before it gives up (default
    ``JOBLOCK["REQUEUE_MAX_WAIT"]``; :class:`LockContentionTimeout`).

    ``on_lost``: ``callback(lock, reason)``, called from the renewal thread on a lost lock.

    ``atomic``: run the body in the job's transaction (default True); False (without
    ``idempotency_key`` only) for bodies that manage their own transactions: fence them.

    ``admission``: a job whose resource is busy waits parked in RQ (rq >= 3.0) and starts
    when the one before it ends (default True); False: requeue with backoff only.

    ``dedupe``: derive the RQ job id from the idempotency key, so a ``.delay()`` of a logical
    job still live returns that job (default False; needs ``idempotency_key``).

    ``on_commit``: a ``.delay()`` inside a transaction of the default database enqueues when it
    commits, nothing on a rollback (default True); False: at once.

    ``scope``: the scope of the idempotency records (default: the dotted name, which a rename
    changes; at most 100 characters; needs ``idempotency_key``).

    ``concurrency``: how many runs of one resource may run at once (default 1; up to 100,
    needs ``lock``): the lock's ``limit`` (each run holds a slot) and, with admission, RQ's
    ``RateLimit(concurrency=N)``. A fence then orders nothing: ``fenced_update`` refuses it.

    ``rq_options``: RQ's ``enqueue`` options for every enqueue (``job_timeout``,
    ``result_ttl``, ``retry``...), checked here.

    Raises ``ValueError`` for a bad argument and ``TypeError`` for an ``async def`` or a
    function given in place of the queue, at decoration."""
    if callable(queue):
        name = getattr(queue, "__qualname__", "")
        raise TypeError(
            "@locked_job takes the queue first, then keywords: @locked_job('default', "
            f"lock='order:{{order_id}}'); got the function {name!r}"
        )
    flags = {
        "heartbeat": heartbeat,
        "atomic": atomic,
        "admission": admission,
        "dedupe": dedupe,
        "on_commit": on_commit,
    }
    why = (  # the first refusal, in this order
        _policy_problem(on_conflict, ttl, max_wait)
        or _argument_problem(lock, idempotency_key, flags, on_lost, rq_options)
        or _idempotency_problem(idempotency_key, atomic, dedupe, rq_options)
        or _scope_problem(scope, idempotency_key)
        or _concurrency_problem(concurrency, lock)
    )
    if why:
        raise ValueError(f"@locked_job: {why}")

    def decorate(func: Callable[P, R]) -> LockedJob[P, R]:
        if inspect.isasyncgenfunction(func):
            raise TypeError(
                f"@locked_job {func.__qualname__}: an async generator is not a job (RQ stores "
                "a job's return value, not the values it yields)"
            )
        check_rq_options(rq_options, f"@locked_job {func.__qualname__}")
        check_template(func, lock, "lock")
        check_template(func, idempotency_key, "idempotency_key")
        spec: JobSpec[P, R] = JobSpec(
            func=func,
            queue=queue,
            lock=lock,
            idempotency_key=idempotency_key,
            ttl=ttl,
            on_conflict=OnConflict(on_conflict),
            max_wait=max_wait,
            on_lost=on_lost,
            rq_options=dict(rq_options),
            idempotency_scope=scope,
            concurrency=concurrency,
            **flags,
        )
        if idempotency_key is not None:  # the scope is the dotted name: too long fails each run
            validate_scope(spec.scope, what=f"@locked_job {func.__qualname__}")

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return cast(R, runner.run(spec, args, kwargs))

        def enqueue_with_options(
            args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **rq_options: Any
        ) -> Any:
            return enqueue_call(spec, wrapper, args, kwargs or {}, rq_options)

        def enqueue(*args: Any, **kwargs: Any) -> Any:
            job_args, job_kwargs, rq_options = split_enqueue_arguments(spec, args, kwargs)
            return enqueue_call(spec, wrapper, job_args, job_kwargs, rq_options)

        def delay(*args: P.args, **kwargs: P.kwargs) -> Any:
            return enqueue_call(spec, wrapper, args, kwargs, {})

        async def adelay(*args: P.args, **kwargs: P.kwargs) -> Any:
            return await sync_to_async(delay)(*args, **kwargs)

        async def aenqueue(*args: Any, **kwargs: Any) -> Any:
            return await sync_to_async(enqueue)(*args, **kwargs)

        locked = cast(Any, wrapper)
        locked.delay = delay
        locked.adelay = adelay
        locked.enqueue = enqueue
        locked.aenqueue = aenqueue
        locked.enqueue_call = enqueue_with_options
        locked.spec = spec
        registry[spec.name] = spec
        return cast(LockedJob[P, R], locked)

    return decorate


def _concurrency_problem(concurrency: object, lock: Template) -> str | None:
    """What is wrong with ``concurrency=``, or None: an int in 1..``MAX_LIMIT``, above 1 only
    for a job with a lock (it is the lock's ``limit``)."""
    try:
        validate_limit("concurrency", concurrency)
    except ValueError as exc:
        return str(exc).replace("concurrency limit", "concurrency", 1)
    if concurrency != 1 and lock is None:
        return "concurrency= is how many runs may hold the lock at once: it needs a lock"
    return None


def _scope_problem(scope: str | None, idempotency_key: Template) -> str | None:
    """What is wrong with ``scope=``, or None: a str, for a job with an idempotency key (the
    scope names its records; its length and characters are checked with the key's)."""
    if scope is None:
        return None
    if not isinstance(scope, str):
        return f"scope must be a str, got {scope!r}"
    if idempotency_key is None:
        return "scope= names the scope of the idempotency records: it needs an idempotency_key"
    return None


def _policy_problem(on_conflict: str, ttl: float | None, max_wait: float | None) -> str | None:
    """What is wrong with ``@locked_job``'s conflict policy or durations, or None:
    ``on_conflict`` must be an :class:`OnConflict` value, and ``ttl`` / ``max_wait``, when
    given, in the ranges the ``JOBLOCK`` settings allow for them."""
    if on_conflict not in CONFLICT_POLICIES:
        return f"on_conflict must be one of {CONFLICT_POLICIES}, got {on_conflict!r}"
    if ttl is not None and (problem := conf.TTL_RANGE.problem(ttl)):
        return f"ttl {problem}."
    if max_wait is not None and (problem := conf.MAX_WAIT_RANGE.problem(max_wait)):
        return f"max_wait {problem}."
    return None


def _argument_problem(
    lock: Template,
    idempotency_key: Template,
    flags: dict[str, bool],
    on_lost: Callable[..., Any] | None,
    rq_options: dict[str, Any],
) -> str | None:
    """What is wrong with ``@locked_job``'s arguments taken one by one, or None: a lock, an
    idempotency key or both is given; no ``unique=`` (now ``dedupe=``); each of ``flags`` is
    ``True`` or ``False``; ``on_lost`` is None or a callable."""
    if lock is None and idempotency_key is None:
        return "needs a lock resource, an idempotency_key, or both"
    if "unique" in rq_options:
        return "unique= was renamed dedupe= (RQ's own unique= is per call: .enqueue(unique=True))"
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            return f"{name} must be True or False, got {flag!r}"
    if on_lost is not None and not callable(on_lost):
        return f"on_lost must be a callable(lock, reason), got {on_lost!r}"
    return None


def _idempotency_problem(
    idempotency_key: Template, atomic: bool, dedupe: bool, rq_options: dict[str, Any]
) -> str | None:
    """What is wrong with how ``@locked_job``'s options go with its idempotency key, or None:
    a key needs ``atomic=True`` (its record is written with the effect); ``dedupe=True`` needs
    a key, and no ``job_id`` of the caller's (the RQ job id is derived from the key)."""
    if not atomic and idempotency_key is not None:
        return "atomic=False is only for jobs without an idempotency_key (recorded with the effect)"
    if dedupe and idempotency_key is None:
        return "dedupe=True needs an idempotency_key (the RQ job id is derived from it)"
    if dedupe and "job_id" in rq_options:
        return f"dedupe=True derives the RQ job id; do not pass job_id={rq_options['job_id']!r} too"
    return None
