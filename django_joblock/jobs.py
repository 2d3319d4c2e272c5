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

Timeouts that only a call knows (a per-call ``job_timeout``) are checked at enqueue against
the same rules as system checks W002 / W006, and a finding is logged as a warning on logger
``django_joblock`` with the check id (the call still goes ahead, as with the check).

The flow inside the work horse lives in :mod:`django_joblock.runner`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, cast

from . import conf
from .idempotency_inputs import validate_key, validate_scope
from .keys import validate_resource

logger = logging.getLogger("django_joblock")

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

CONFLICT_POLICIES = ("requeue", "skip", "fail")
Template = str | Callable[..., str] | None


class LockedJob(Protocol[P, R_co]):
    """What ``@locked_job`` returns: call it inline, or ``.delay()`` it onto the queue."""

    spec: JobSpec[Any, Any]

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def enqueue(
        self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **rq_options: Any
    ) -> Any:
        """Enqueue with per-call RQ options (``job_timeout``, ``retry``, ``job_id``...)."""


@dataclass
class JobSpec(Generic[P, R]):
    """Everything ``@locked_job`` was told about one function."""

    func: Callable[P, R]
    queue: Any
    lock: Template
    idempotency_key: Template
    ttl: float | None
    heartbeat: bool
    on_conflict: str
    max_wait: float | None
    on_lost: Callable[..., Any] | None
    rq_options: dict[str, Any] = field(default_factory=dict)
    atomic: bool = True

    @property
    def name(self) -> str:
        """Dotted path RQ stores for the job (module + qualified name)."""
        return f"{self.func.__module__}.{self.func.__qualname__}"

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.func)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied (TypeError if they do not
        fit the function)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for param in self.signature.parameters.values():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(param.name, {}))
        return arguments

    def render(self, template: Template, arguments: dict[str, Any], what: str) -> str | None:
        """Format ``template`` with the bound arguments; a clear error names what failed."""
        if template is None:
            return None
        try:
            value = template(**arguments) if callable(template) else template.format(**arguments)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"@locked_job {self.name}: cannot build the {what} from "
                f"{template!r} with arguments {sorted(arguments)}: {exc!r}"
            ) from exc
        if not isinstance(value, str):
            raise ValueError(f"@locked_job {self.name}: the {what} must be a str, got {value!r}")
        return value

    def resource(self, arguments: dict[str, Any]) -> str | None:
        value = self.render(self.lock, arguments, "lock resource")
        return None if value is None else validate_resource(value)

    def key(self, arguments: dict[str, Any]) -> str | None:
        """The idempotency key for these arguments, validated (``ValueError`` naming it)."""
        value = self.render(self.idempotency_key, arguments, "idempotency key")
        return None if value is None else validate_key(value, what=f"@locked_job {self.name}")

    @property
    def scope(self) -> str:
        """Scope of the job's idempotency records: its dotted name."""
        return self.name


def _template_fields(template: str) -> set[str]:
    fields = set()
    for _literal, name, _spec, _conversion in string.Formatter().parse(template):
        if name is None:
            continue
        root = name.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise ValueError(f"positional field {{{name}}} in {template!r}; use parameter names")
        fields.add(root)
    return fields


def _check_template(func: Callable[..., Any], template: Template, what: str) -> None:
    if template is None or callable(template):
        return
    if not isinstance(template, str):
        raise TypeError(
            f"@locked_job {func.__qualname__}: {what} must be a str template, a "
            f"callable or None, got {template!r}"
        )
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # any keyword may arrive; checked when the job is enqueued
    try:
        unknown = _template_fields(template) - set(params)
    except ValueError as exc:
        raise ValueError(f"@locked_job {func.__qualname__}: bad {what}: {exc}") from exc
    if unknown:
        raise ValueError(
            f"@locked_job {func.__qualname__}: {what} {template!r} uses "
            f"{', '.join(sorted(unknown))}, which {func.__qualname__}() does not take "
            f"(parameters: {', '.join(params) or 'none'})"
        )


# Every decorated job, by dotted name: for the system checks and the dashboard.
registry: dict[str, JobSpec[Any, Any]] = {}


def registered_jobs() -> list[JobSpec[Any, Any]]:
    """Every ``@locked_job``, after importing the ``jobs`` / ``tasks`` modules of the apps."""
    from django.utils.module_loading import autodiscover_modules

    autodiscover_modules("jobs", "tasks")
    return sorted(registry.values(), key=lambda spec: spec.name)


@dataclass(frozen=True)
class TimeoutFinding:
    """A W002 / W006 finding about one job and one RQ job timeout."""

    id: str
    message: str
    hint: str


def job_timeout(value: Any, queue: Any) -> float:
    """RQ's timeout (s) for a job enqueued with ``job_timeout=value`` on ``queue``.

    ``None`` means the queue's default; ``-1`` (RQ's "no timeout") is ``math.inf``. Strings
    such as ``"10m"`` are parsed as RQ parses them.
    """
    from rq.utils import parse_timeout

    seconds = parse_timeout(value)
    if seconds is None:
        seconds = parse_timeout(getattr(queue, "_default_timeout", None)) or 180
    return math.inf if seconds == -1 else float(seconds)


def timeout_findings(spec: JobSpec[Any, Any], timeout: float) -> list[TimeoutFinding]:
    """W002 and W006 for ``spec`` running under an RQ job timeout of ``timeout`` seconds."""
    from . import conf

    current = conf.get()
    shown = "none (-1)" if math.isinf(timeout) else f"{timeout:g}s"
    found = []
    ttl = spec.ttl if spec.ttl is not None else current.LOCK_TTL
    if spec.lock is not None and not spec.heartbeat and ttl < timeout:
        found.append(
            TimeoutFinding(
                "W002",
                f"{spec.name}: lock TTL {ttl:g}s is shorter than its RQ job timeout {shown} with "
                "heartbeat off: a slow run loses its lock to a second worker.",
                "Turn heartbeat on, or make ttl longer than job_timeout.",
            )
        )
    lease = current.IDEMPOTENCY_LEASE
    if spec.lock is None and spec.idempotency_key is not None and timeout > lease:
        found.append(
            TimeoutFinding(
                "W006",
                f"{spec.name}: RQ job timeout {shown} is longer than IDEMPOTENCY_LEASE "
                f"{lease:g}s and the job has no lock: a duplicate delivered after the lease "
                "takes the claim over and runs while the first run still works.",
                "Raise JOBLOCK['IDEMPOTENCY_LEASE'] above job_timeout, lower job_timeout, "
                "or give the job a lock.",
            )
        )
    return found


def locked_job(
    queue: Any,
    *,
    lock: Template = None,
    idempotency_key: Template = None,
    ttl: float | None = None,
    heartbeat: bool = True,
    on_conflict: str = "requeue",
    max_wait: float | None = None,
    on_lost: Callable[..., Any] | None = None,
    atomic: bool = True,
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
    """
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
    if not isinstance(atomic, bool):
        raise ValueError(f"@locked_job: atomic must be True or False, got {atomic!r}")
    if not atomic and idempotency_key is not None:
        raise ValueError(
            "@locked_job: atomic=False is only for jobs without an idempotency_key (the "
            "record of success commits in the same transaction as the effect)"
        )

    def decorate(func: Callable[P, R]) -> LockedJob[P, R]:
        _check_template(func, lock, "lock")
        _check_template(func, idempotency_key, "idempotency_key")
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
            on_conflict=on_conflict,
            max_wait=max_wait,
            on_lost=on_lost,
            rq_options=dict(rq_options),
            atomic=atomic,
        )

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            from .runner import run

            return cast(R, run(spec, args, kwargs))

        def enqueue(
            args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **rq_options: Any
        ) -> Any:
            from .queues import get_queue

            kwargs = kwargs or {}
            arguments = spec.bind(args, kwargs)  # TypeError now, not in the worker
            meta = {
                "joblock": {
                    "resource": spec.resource(arguments),
                    "idempotency_key": spec.key(arguments),
                }
            }
            queue = get_queue(spec.queue)  # an unknown queue name fails here, loudly
            options = {**spec.rq_options, **rq_options}
            options["meta"] = {**options.get("meta", {}), **meta}
            if "job_timeout" in rq_options:
                _warn_per_call(spec, job_timeout(rq_options["job_timeout"], queue))
            # args=/kwargs= keep RQ from mistaking a job argument named like an RQ option
            # (``description``, ``timeout``...) for one.
            return queue.enqueue(wrapper, args=args, kwargs=kwargs, **options)

        def delay(*args: P.args, **kwargs: P.kwargs) -> Any:
            return enqueue(args, kwargs)

        locked = cast(Any, wrapper)
        locked.delay = delay
        locked.enqueue = enqueue
        locked.spec = spec
        registry[spec.name] = spec
        return cast(LockedJob[P, R], locked)

    return decorate


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
