"""``@locked_job``: RQ jobs that run the safe flow (lock, heartbeat, idempotency, run, record).

    @locked_job("default", lock="order:{order_id}", idempotency_key="refund:{refund_id}",
                ttl=60, on_conflict="requeue")
    def refund_order(order_id: int, refund_id: str, amount: str) -> dict: ...

    refund_order.delay(order_id=1, refund_id="R-1", amount="10.00")   # -> rq.job.Job
    refund_order.enqueue(kwargs={...}, job_timeout=600)               # per-call RQ options
    refund_order(order_id=1, refund_id="R-1", amount="10.00")         # inline, same protections

``lock`` and ``idempotency_key`` are ``str.format`` templates over the bound call arguments
(defaults applied), callables taking those arguments as keywords, or None. Template fields are
checked against the function's parameters at decoration time, and both are rendered and
validated (the resource's characters, the key's type, length and characters, the scope's
length) at enqueue time, so a bad template or argument fails in the caller, not later inside a
worker. The queue name is resolved at enqueue too: with django-rq installed it must be in
``RQ_QUEUES``. Other keyword arguments (``job_timeout``, ``retry``, ``result_ttl``...) pass
through to ``Queue.enqueue``.

A job with a lock waits for a busy resource *parked* in RQ (admission, on rq >= 3.0: see
:mod:`django_joblock.admission`) and starts as soon as the job before it on that resource
ends; ``admission=False`` keeps the requeue-with-backoff path only. ``dedupe=True`` derives
the RQ job id from the idempotency key, so a ``.delay()`` of a logical job that is still live
returns the existing job (see :mod:`.dedupe`).

Timeouts that only a call knows (a per-call ``job_timeout``) are checked at enqueue against
the same rules as system checks W002 / W006, and a finding is logged as a warning on logger
``django_joblock`` with the check id (the call still goes ahead, as with the check).

The flow inside the work horse lives in :mod:`.runner`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar, cast

from django.utils.module_loading import autodiscover_modules

from .. import conf
from ..idempotency.inputs import key_family, validate_scope
from . import admission as admission_mod
from . import dedupe as dedupe_mod
from . import runner
from .queues import get_queue
from .spec import (
    CONFLICT_POLICIES,
    JobSpec,
    OnConflict,
    Template,
    TimeoutFinding,
    check_rq_options,
    check_template,
    job_timeout,
    timeout_findings,
)

__all__ = [
    "CONFLICT_POLICIES",
    "JobSpec",
    "LockedJob",
    "Template",
    "TimeoutFinding",
    "job_timeout",
    "locked_job",
    "registered_jobs",
    "registry",
    "timeout_findings",
]

logger = logging.getLogger("django_joblock")

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


# Every decorated job, by dotted name: for the system checks and the dashboard.
registry: dict[str, JobSpec[Any, Any]] = {}


def registered_jobs() -> list[JobSpec[Any, Any]]:
    """Every ``@locked_job``, after importing the ``jobs`` / ``tasks`` modules of the apps."""
    autodiscover_modules("jobs", "tasks")
    return sorted(registry.values(), key=lambda spec: spec.name)


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
    **rq_options: Any,
) -> Callable[[Callable[P, R]], LockedJob[P, R]]:
    """Decorate an RQ job function with the safe flow; see the module docs.

    ``queue``: a queue name (django-rq's ``RQ_QUEUES`` when installed, else an RQ queue on the
    ``JOBLOCK["REDIS_ALIAS"]`` connection) or an ``rq.Queue``. ``ttl`` (s): lock TTL (default
    ``LOCK_TTL``). ``on_conflict``: ``"requeue"`` (backoff + jitter, give up after
    ``max_wait`` / ``REQUEUE_MAX_WAIT`` as a failed job), ``"skip"`` or ``"fail"``.
    ``on_lost(lock, reason)``: called when the lock is lost while the job runs.
    ``atomic`` (default True): the body runs inside ``transaction.atomic()`` and commits only
    while the lock is held, so a lost lock rolls its writes back. ``atomic=False`` is for
    lock-only jobs that manage their own transactions or do long work outside the database
    (a transaction held open that long blocks SQLite writers and may hit PostgreSQL's
    ``idle_in_transaction_session_timeout``); their writes are not rolled back when the lock is
    lost, so fence them. A job with an ``idempotency_key`` is always atomic.
    ``admission`` (default True; rq >= 3.0, jobs with a lock): a job whose resource is busy
    waits parked in RQ and starts when the job before it ends, FIFO per resource; False keeps
    the requeue-with-backoff path only. ``dedupe`` (needs an ``idempotency_key``): the RQ job
    id is derived from the key, and ``.delay()`` of a logical job that is still live returns
    the existing job (RQ's own ``unique=``, which refuses a duplicate id, goes to
    ``.enqueue()``).
    """
    if callable(queue):
        raise TypeError(
            "@locked_job takes the queue first, then keywords: @locked_job('default', "
            f"lock='order:{{order_id}}'); got the function {getattr(queue, '__qualname__', '')!r}"
        )
    if on_conflict not in CONFLICT_POLICIES:
        raise ValueError(
            f"@locked_job: on_conflict must be one of {CONFLICT_POLICIES}, got {on_conflict!r}"
        )
    if ttl is not None:
        conf.TTL_RANGE.check("@locked_job: ttl", ttl)
    if max_wait is not None:
        conf.MAX_WAIT_RANGE.check("@locked_job: max_wait", max_wait)
    if lock is None and idempotency_key is None:
        raise ValueError("@locked_job needs a lock resource, an idempotency_key, or both")
    if "unique" in rq_options:
        raise ValueError(
            "@locked_job: unique= was renamed dedupe= (return the live job of the same "
            "idempotency key); RQ's own unique= (refuse a duplicate job id) is a per-call "
            "option: .enqueue(..., unique=True)"
        )
    flags = {"heartbeat": heartbeat, "atomic": atomic, "admission": admission, "dedupe": dedupe}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"@locked_job: {name} must be True or False, got {flag!r}")
    if on_lost is not None and not callable(on_lost):
        raise ValueError(f"@locked_job: on_lost must be a callable(lock, reason), got {on_lost!r}")
    if not atomic and idempotency_key is not None:
        raise ValueError(
            "@locked_job: atomic=False is only for jobs without an idempotency_key (the "
            "record of success commits in the same transaction as the effect)"
        )
    if dedupe and idempotency_key is None:
        raise ValueError(
            "@locked_job: dedupe=True needs an idempotency_key (the RQ job id is derived from it)"
        )
    if dedupe and "job_id" in rq_options:
        raise ValueError(
            "@locked_job: dedupe=True derives the RQ job id from the idempotency key; do not "
            f"pass job_id={rq_options['job_id']!r} too"
        )

    def decorate(func: Callable[P, R]) -> LockedJob[P, R]:
        check_rq_options(rq_options, f"@locked_job {func.__qualname__}")
        check_template(func, lock, "lock")
        check_template(func, idempotency_key, "idempotency_key")
        if idempotency_key is not None:
            # The records' scope is the dotted name: too long a name would fail every run.
            validate_scope(
                f"{func.__module__}.{func.__qualname__}", what=f"@locked_job {func.__qualname__}"
            )
        spec: JobSpec[P, R] = JobSpec(
            func=func,
            queue=queue,
            lock=lock,
            idempotency_key=idempotency_key,
            ttl=ttl,
            heartbeat=heartbeat,
            on_conflict=OnConflict(on_conflict),
            max_wait=max_wait,
            on_lost=on_lost,
            rq_options=dict(rq_options),
            atomic=atomic,
            admission=admission,
            dedupe=dedupe,
        )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            return cast(R, runner.run(spec, args, kwargs))

        def enqueue(
            args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **rq_options: Any
        ) -> Any:
            return _enqueue(spec, wrapper, args, kwargs or {}, rq_options)

        def delay(*args: P.args, **kwargs: P.kwargs) -> Any:
            return enqueue(args, kwargs)

        locked = cast(Any, wrapper)
        locked.delay = delay
        locked.enqueue = enqueue
        locked.spec = spec
        registry[spec.name] = spec
        return cast(LockedJob[P, R], locked)

    return decorate


def _enqueue(
    spec: JobSpec[Any, Any],
    wrapper: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    per_call: dict[str, Any],
) -> Any:
    check_rq_options(per_call, f"{spec.name}.enqueue()")
    arguments = spec.bind(args, kwargs)  # TypeError now, not in the worker
    resource = spec.resource(arguments)
    key = spec.key(arguments)
    queue = get_queue(spec.queue)  # an unknown queue name fails here, loudly
    options = {**spec.rq_options, **per_call}
    state: dict[str, Any] = {"resource": resource, "idempotency_key": key}
    if resource is not None:
        state["admission"] = admission_mod.plan(queue, resource, spec.admission, options).value
    options["meta"] = {**options.get("meta", {}), "joblock": state}
    if "job_timeout" in per_call:
        _warn_per_call(spec, job_timeout(per_call["job_timeout"], queue))

    if not spec.dedupe:
        return _put(queue, wrapper, args, kwargs, options)
    assert key is not None
    if "job_id" in per_call:
        raise ValueError(
            f"{spec.name}: dedupe=True derives the RQ job id from the idempotency key; do not "
            f"pass job_id={per_call['job_id']!r}"
        )
    options["job_id"] = dedupe_mod.job_id_for(spec.scope, key)
    return dedupe_mod.enqueue_once(
        queue,
        options["job_id"],
        lambda: _put(queue, wrapper, args, kwargs, options),
        family=key_family(key),
        func=spec.name,
    )


def _put(
    queue: Any,
    wrapper: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
) -> Any:
    # args=/kwargs= keep RQ from mistaking a job argument named like an RQ option
    # (``description``, ``timeout``...) for one.
    return queue.enqueue(wrapper, args=args, kwargs=kwargs, **options)


def _warn_per_call(spec: JobSpec[Any, Any], timeout: float) -> None:
    # The system check saw only the decoration-time options; a per-call job_timeout is seen
    # here, once per enqueue. A warning, like the check: the call goes ahead.
    for finding in timeout_findings(spec, timeout):
        logger.warning(
            "[django_joblock.%s] %s %s",
            finding.id,
            finding.message,
            finding.hint,
            extra={"outcome": "enqueued", "reason": f"django_joblock.{finding.id}"},
        )
