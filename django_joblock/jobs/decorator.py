"""``@locked_job``: RQ jobs that run the safe flow of :mod:`.runner` (docs/jobs.md). A decorated
function is called inline, or put on its queue with ``.delay(...)`` / ``.enqueue(...)`` (as
rq's ``@job`` and ``Queue.enqueue``) or ``.enqueue_call(args, kwargs, **rq_options)`` (as rq's
``Queue.enqueue_call``). Mistakes fail in the caller, never in a worker: template fields at
decoration; resource, key, scope, queue and RQ options at enqueue, where a per-call
``job_timeout`` is also checked like W002 / W006 (a finding is logged as a warning with its id;
the call goes ahead)."""

from __future__ import annotations

import functools
import inspect
import uuid
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from asgiref.sync import sync_to_async
from django.db import transaction
from django.utils.module_loading import autodiscover_modules

from .. import conf, metrics
from ..idempotency.inputs import fingerprint_of, key_family, validate_scope
from ..locks.keys import family, validate_limit
from ..logs import logger
from . import admission as admission_mod
from . import runner
from .dedupe import enqueue_once, job_id_for
from .queues import get_queue
from .spec import (
    CONFLICT_POLICIES,
    JobSpec,
    OnConflict,
    Template,
    check_rq_options,
    check_template,
    rq_option_names,
)
from .spec import job_timeout as job_timeout  # re-exported for the system checks
from .spec import timeout_findings as timeout_findings

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


def split_enqueue_arguments(
    spec: JobSpec[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """The job's positional and keyword arguments and RQ's options of an ``.enqueue()`` call,
    split as rq's ``Queue.enqueue`` splits them: ``args=`` / ``kwargs=`` given explicitly (then
    no other positional argument), or the positional arguments and the keywords that are not
    RQ options. A keyword that names a parameter of the job is the job's, even when RQ has an
    option of that name (RQ would take it; ``.enqueue_call()`` separates them for good).

    The spelling of 0.x, ``.enqueue((1, 2), {"x": 3})`` (a tuple and a dict that bind as the
    job's ``args`` and ``kwargs``), keeps its meaning, with a :class:`DeprecationWarning`."""
    parameters = spec.signature.parameters  # computed once per job, not per call
    options = {
        name: kwargs.pop(name)
        for name in list(kwargs)
        if name in rq_option_names() and name not in parameters
    }
    if "args" in kwargs or "kwargs" in kwargs:
        if args:
            raise TypeError(
                f"{spec.name}.enqueue(): positional arguments cannot be used with args= / kwargs="
            )
        job_args = tuple(kwargs.pop("args", ()))
        job_kwargs = dict(kwargs.pop("kwargs", None) or {})
        return job_args, job_kwargs, options | kwargs  # what is left: RQ options, checked
    if _old_positional_spelling(spec, args, kwargs):
        warnings.warn(
            f"{spec.name}.enqueue(args, kwargs): pass the job's arguments as rq does, "
            ".enqueue(*args, **kwargs), or use .enqueue_call(args, kwargs, **rq_options)",
            DeprecationWarning,
            stacklevel=3,
        )
        return tuple(args[0]), dict(args[1]) if len(args) == 2 else {}, options | kwargs
    return args, kwargs, options


def _old_positional_spelling(
    spec: JobSpec[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Is ``args`` the 0.x spelling ``(job_args_tuple[, job_kwargs_dict])``, binding to the
    job's signature as its ``args`` and ``kwargs``? Such a call keeps its old meaning (a tuple
    the job takes as its first argument goes in ``.delay()`` or ``.enqueue_call()``)."""
    if not 1 <= len(args) <= 2 or kwargs or not isinstance(args[0], (tuple, list)):
        return False
    if len(args) == 2 and not isinstance(args[1], dict):
        return False
    try:
        spec.signature.bind(*args[0], **(args[1] if len(args) == 2 else {}))
    except TypeError:
        return False
    return True


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


def enqueue_call(
    spec: JobSpec[Any, Any],
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    per_call: dict[str, Any],
    *,
    queue_name: str | None = None,
    at: datetime | None = None,
) -> Any:
    """Enqueue ``target`` (the job, or a Django task's dotted path) with the spec's options and
    ``per_call`` on ``queue_name`` (default: the spec's), at the time ``at`` if given."""
    check_rq_options(per_call, f"{spec.name}.enqueue()")
    arguments = spec.bind(args, kwargs)  # TypeError now, not in the worker
    resource = spec.resource(arguments)
    key = spec.key(arguments)
    queue = get_queue(queue_name or spec.queue)  # an unknown queue name fails here, loudly
    options = {**spec.rq_options, **per_call}
    _add_joblock_state(options, spec, queue, resource, key)
    if "job_timeout" in per_call:  # the system check saw only the decoration's options
        _warn_about_timeout(spec, per_call["job_timeout"], queue)

    def put() -> Any:
        # args=/kwargs= keep RQ from taking a job argument named like an RQ option for one.
        call = queue.enqueue if at is None else functools.partial(queue.enqueue_at, at)
        job = call(target, args=args, kwargs=kwargs, **options)
        if resource is not None and job.get_status(refresh=False) == admission_mod.PARKED:
            metrics.count("parked", family(resource), spec.name)  # contention the lock never sees
            metrics.flush_now()  # an enqueuing web process may never flush otherwise
        return job

    send = _deduplicated(put, spec, queue, key, arguments, per_call, options)
    if spec.on_commit and transaction.get_connection().in_atomic_block:
        return _send_at_commit(send, spec, queue, options)
    return send()


def _add_joblock_state(
    options: dict[str, Any],
    spec: JobSpec[Any, Any],
    queue: Any,
    resource: str | None,
    key: str | None,
) -> None:
    """Add the call's joblock state (resource, idempotency key and, for a job with a resource,
    the admission plan) to ``options["meta"]``, keeping the caller's meta. Planning admission
    may also add ``rate_limit`` and ``job_id`` to ``options`` (:func:`.admission.plan`)."""
    state: dict[str, Any] = {"resource": resource, "idempotency_key": key}
    if resource is not None:
        plan = admission_mod.plan(queue, resource, spec.admission, options, spec.concurrency)
        state["admission"] = plan.value
        if spec.concurrency > 1:
            state["limit"] = spec.concurrency  # for the worker that finds a horse dead
    options["meta"] = {**options.get("meta", {}), "joblock": state}


def _warn_about_timeout(spec: JobSpec[Any, Any], value: Any, queue: Any) -> None:
    """Log each W002 / W006 finding the system check would make about ``spec`` running under a
    per-call ``job_timeout=value`` on ``queue``, as a warning with its id; the call goes ahead."""
    for finding in timeout_findings(spec, job_timeout(value, queue)):
        extra = {"outcome": "enqueued", "reason": f"django_joblock.{finding.id}"}
        logger.warning("[django_joblock.%s] %s %s", *finding, extra=extra)


def _deduplicated(
    put: Callable[[], Any],
    spec: JobSpec[Any, Any],
    queue: Any,
    key: str | None,
    arguments: dict[str, Any],
    per_call: dict[str, Any],
    options: dict[str, Any],
) -> Callable[[], Any]:
    """``put`` itself, unless the job has ``dedupe=True``: then the RQ job id derived from the
    idempotency key goes in ``options`` now (``ValueError`` if ``per_call`` has a ``job_id``),
    and the returned call enqueues with ``put`` only if no job of that id is live, else returns
    the live one, made by the same call (other arguments: :class:`IdempotencyKeyMismatch`)."""
    if not spec.dedupe:
        return put
    assert key is not None
    if "job_id" in per_call:
        raise ValueError(
            f"{spec.name}: dedupe=True derives the RQ job id; got job_id={per_call['job_id']!r}"
        )
    job_id = job_id_for(spec.scope, key)
    options["job_id"] = job_id
    fingerprint = fingerprint_of(arguments)

    def is_same(live: Any) -> bool:
        return fingerprint_of(spec.bind(tuple(live.args), dict(live.kwargs))) == fingerprint

    def put_once() -> Any:
        return enqueue_once(queue, job_id, put, is_same, family=key_family(key), func=spec.name)

    return put_once


def _send_at_commit(
    send: Callable[[], Any], spec: JobSpec[Any, Any], queue: Any, options: dict[str, Any]
) -> Any:
    """Run ``send`` when the caller's transaction commits, so that a worker never runs the job
    before the rows it reads are visible (nothing is enqueued on a rollback), and return the
    job's handle now, by the id it will have. A failure at the commit is logged as an error,
    not raised: the caller has returned, and the commit's other callbacks must still run."""
    job_id = options.setdefault("job_id", str(uuid.uuid4()))

    def at_commit() -> None:
        try:
            send()
        except Exception as exc:  # noqa: BLE001 - logged as an error: the caller has returned
            fields = {"job_id": job_id, "outcome": "not_enqueued"}
            message = "job %s of %s not enqueued at the commit: %r"
            logger.error(message, job_id, spec.name, exc, exc_info=True, extra=fields)

    transaction.on_commit(at_commit)
    return queue.job_class(id=job_id, connection=queue.connection)
