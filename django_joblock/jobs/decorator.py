"""``@locked_job``: RQ jobs that run the safe flow of :mod:`.runner` (docs/jobs.md); a decorated
function is called inline or ``.delay(...)``-ed / ``.enqueue(args, kwargs, **rq)``-ed onto its
queue. Mistakes fail in the caller, never in a worker: template fields at decoration; resource, key,
scope, queue and RQ options at enqueue, where a per-call ``job_timeout`` is also checked like W002 /
W006 (a finding is logged as a warning with its id; the call goes ahead)."""

from __future__ import annotations

import functools
import inspect
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from django.db import transaction
from django.utils.module_loading import autodiscover_modules

from .. import conf, metrics
from ..idempotency.inputs import fingerprint_of, key_family, validate_scope
from ..locks.keys import family
from ..logs import logger
from . import admission as admission_mod
from . import runner
from .dedupe import enqueue_once, job_id_for
from .queues import get_queue
from .spec import CONFLICT_POLICIES, JobSpec, OnConflict, Template, check_rq_options, check_template
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

    def enqueue(
        self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **rq_options: Any
    ) -> Any:
        """Enqueue with per-call RQ options (``job_timeout``, ``retry``, ``job_id``...)."""


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
    **rq_options: Any,
) -> Callable[[Callable[P, R]], LockedJob[P, R]]:
    """Decorate an RQ job function with the safe flow (:mod:`.runner`; every argument: the
    table in docs/jobs.md). ``lock`` / ``idempotency_key``: ``str.format`` templates over the
    bound arguments, callables taking them as keywords, or None; ``ttl`` / ``max_wait`` in
    seconds; ``on_conflict``: :class:`OnConflict`; ``on_commit``: a ``.delay()`` inside a
    transaction of the default database enqueues when it commits (nothing on a rollback). Other
    keywords go to RQ's ``enqueue``."""
    if callable(queue):
        why = "@locked_job takes the queue first, then keywords: @locked_job('default', "
        name = getattr(queue, "__qualname__", "")
        raise TypeError(f"{why}lock='order:{{order_id}}'); got the function {name!r}")
    flags = {"heartbeat": heartbeat, "atomic": atomic, "admission": admission, "dedupe": dedupe}
    flags["on_commit"] = on_commit
    why = ""  # the first refusal, in this order
    if on_conflict not in CONFLICT_POLICIES:
        why = f"on_conflict must be one of {CONFLICT_POLICIES}, got {on_conflict!r}"
    elif ttl is not None and (problem := conf.TTL_RANGE.problem(ttl)):
        why = f"ttl {problem}."
    elif max_wait is not None and (problem := conf.MAX_WAIT_RANGE.problem(max_wait)):
        why = f"max_wait {problem}."
    elif lock is None and idempotency_key is None:
        why = "needs a lock resource, an idempotency_key, or both"
    elif "unique" in rq_options:
        why = "unique= was renamed dedupe= (RQ's own unique= is per call: .enqueue(unique=True))"
    elif bad := next((name for name, flag in flags.items() if not isinstance(flag, bool)), ""):
        why = f"{bad} must be True or False, got {flags[bad]!r}"
    elif on_lost is not None and not callable(on_lost):
        why = f"on_lost must be a callable(lock, reason), got {on_lost!r}"
    elif not atomic and idempotency_key is not None:
        why = "atomic=False is only for jobs without an idempotency_key (recorded with the effect)"
    elif dedupe and idempotency_key is None:
        why = "dedupe=True needs an idempotency_key (the RQ job id is derived from it)"
    elif dedupe and "job_id" in rq_options:
        why = f"dedupe=True derives the RQ job id; do not pass job_id={rq_options['job_id']!r} too"
    if why:
        raise ValueError(f"@locked_job: {why}")

    def decorate(func: Callable[P, R]) -> LockedJob[P, R]:
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"@locked_job {func.__qualname__}: async def jobs are not supported (RQ would "
                "run the body after the lock was released and the transaction committed); "
                "make it a def and call async code with asgiref's async_to_sync"
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
            **flags,
        )
        if idempotency_key is not None:  # the scope is the dotted name: too long fails each run
            validate_scope(spec.scope, what=f"@locked_job {func.__qualname__}")

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return cast(R, runner.run(spec, args, kwargs))

        def enqueue(
            args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **rq_options: Any
        ) -> Any:
            return enqueue_call(spec, wrapper, args, kwargs or {}, rq_options)

        def delay(*args: P.args, **kwargs: P.kwargs) -> Any:
            return enqueue(args, kwargs)

        locked = cast(Any, wrapper)
        locked.delay, locked.enqueue, locked.spec = delay, enqueue, spec
        registry[spec.name] = spec
        return cast(LockedJob[P, R], locked)

    return decorate


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
    resource, key = spec.resource(arguments), spec.key(arguments)
    queue = get_queue(queue_name or spec.queue)  # an unknown queue name fails here, loudly
    options = {**spec.rq_options, **per_call}
    state: dict[str, Any] = {"resource": resource, "idempotency_key": key}
    if resource is not None:
        state["admission"] = admission_mod.plan(queue, resource, spec.admission, options).value
    options["meta"] = {**options.get("meta", {}), "joblock": state}
    if "job_timeout" in per_call:  # the system check saw only the decoration's options
        for finding in timeout_findings(spec, job_timeout(per_call["job_timeout"], queue)):
            extra = {"outcome": "enqueued", "reason": f"django_joblock.{finding.id}"}
            logger.warning("[django_joblock.%s] %s %s", *finding, extra=extra)

    def put() -> Any:
        # args=/kwargs= keep RQ from taking a job argument named like an RQ option for one.
        call = queue.enqueue if at is None else functools.partial(queue.enqueue_at, at)
        job = call(target, args=args, kwargs=kwargs, **options)
        if resource is not None and job.get_status(refresh=False) == admission_mod.PARKED:
            metrics.count("parked", family(resource), spec.name)  # contention the lock never sees
            metrics.flush_now()  # an enqueuing web process may never flush otherwise
        return job

    now = put
    if spec.dedupe:
        assert key is not None
        if "job_id" in per_call:
            why = f"dedupe=True derives the RQ job id; got job_id={per_call['job_id']!r}"
            raise ValueError(f"{spec.name}: {why}")
        options["job_id"] = job_id = job_id_for(spec.scope, key)
        fingerprint = fingerprint_of(arguments)

        def is_same(live: Any) -> bool:
            return fingerprint_of(spec.bind(tuple(live.args), dict(live.kwargs))) == fingerprint

        def now() -> Any:
            return enqueue_once(queue, job_id, put, is_same, family=key_family(key), func=spec.name)

    if not (spec.on_commit and transaction.get_connection().in_atomic_block):
        return now()
    # Enqueued when the caller's transaction commits: a worker must not run the job before
    # the rows it reads are visible (nothing is enqueued on a rollback). The caller gets the
    # job's handle now, by the id it will have.
    options.setdefault("job_id", str(uuid.uuid4()))

    def at_commit() -> None:  # a failure here must not drop the commit's other callbacks
        try:
            now()
        except Exception as exc:  # noqa: BLE001 - logged as an error: the caller has returned
            fields = {"job_id": options["job_id"], "outcome": "not_enqueued"}
            message = "job %s of %s not enqueued at the commit: %r"
            logger.error(message, options["job_id"], spec.name, exc, exc_info=True, extra=fields)

    transaction.on_commit(at_commit)
    return queue.job_class(id=options["job_id"], connection=queue.connection)
