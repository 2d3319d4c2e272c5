"""What an enqueue of a ``@locked_job`` or ``@locked_task`` does: split the call's arguments
from RQ's options as rq's ``Queue.enqueue`` does, check them in the caller (they bind to the
job's signature; resource, key, queue and RQ options are valid; a per-call ``job_timeout`` is
checked like W002 / W006, a finding logged as a warning with its id), add the job's joblock
state and admission plan to its meta (:mod:`.admission`), and put it on its queue: at once,
once per live logical job with ``dedupe=True`` (:mod:`.dedupe`), or when the caller's
transaction commits with ``on_commit=True``."""

from __future__ import annotations

import functools
import uuid
import warnings
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import transaction

from .. import metrics
from ..idempotency.inputs import fingerprint_of, key_family
from ..locks.keys import family
from ..logs import logger
from . import admission as admission_mod
from .dedupe import enqueue_once, job_id_for
from .queues import get_queue
from .spec import JobSpec, check_rq_options, job_timeout, rq_option_names, timeout_findings


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
        job_args = tuple(kwargs.pop("args", None) or ())  # None: RQ's "none", as for kwargs=
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
    at_commit = spec.on_commit and transaction.get_connection().in_atomic_block
    if at_commit:
        # Sent at the commit with the arguments as they are now, as RQ's enqueue (which
        # serializes them at once) would: the caller may change its dict before the commit, and
        # the resource, key and admission were planned with these. An argument the queue's
        # serializer refuses fails here, in the caller.
        args, kwargs = _as_delivered(queue, args, kwargs)

    def put() -> Any:
        # args=/kwargs= keep RQ from taking a job argument named like an RQ option for one.
        call = queue.enqueue if at is None else functools.partial(queue.enqueue_at, at)
        job = call(target, args=args, kwargs=kwargs, **options)
        if resource is not None and job.get_status(refresh=False) == admission_mod.PARKED:
            metrics.count("parked", family(resource), spec.name)  # contention the lock never sees
            metrics.flush_now()  # an enqueuing web process may never flush otherwise
        return job

    send = _deduplicated(put, spec, queue, key, (args, kwargs), per_call, options)
    if at_commit:
        return _send_at_commit(send, spec, queue, options)
    return send()


def _as_delivered(
    queue: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The job's arguments as its worker, and a fetch of the job, will see them: through the
    queue's serializer, and back. RQ's ``JSONSerializer`` gives a tuple back as a list and a
    dict's int keys as str (``{10: "a"}`` is ``{"10": "a"}``); a value the serializer refuses
    raises here, in the caller."""
    sent_args, sent_kwargs = queue.serializer.loads(queue.serializer.dumps((args, kwargs)))
    return tuple(sent_args), dict(sent_kwargs)


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
    options["meta"] = {**(options.get("meta") or {}), "joblock": state}  # None: RQ's "not set"


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
    call: tuple[tuple[Any, ...], dict[str, Any]],
    per_call: dict[str, Any],
    options: dict[str, Any],
) -> Callable[[], Any]:
    """``put`` itself, unless the job has ``dedupe=True``: then the RQ job id derived from the
    idempotency key goes in ``options`` now (``ValueError`` if ``per_call`` has a ``job_id``),
    and the returned call enqueues with ``put`` only if no job of that id is live, else returns
    the live one, made by the same call (other arguments: :class:`IdempotencyKeyMismatch`).

    "The same call" compares the live job's arguments, as its queue's serializer gives them
    back, with this ``call``'s arguments (args, kwargs) as that serializer will give them back:
    like with like, whatever the serializer changes (RQ's ``JSONSerializer``: int keys to str)."""
    if not spec.dedupe:
        return put
    assert key is not None
    if "job_id" in per_call:
        raise ValueError(
            f"{spec.name}: dedupe=True derives the RQ job id; got job_id={per_call['job_id']!r}"
        )
    job_id = job_id_for(spec.scope, key)
    options["job_id"] = job_id
    fingerprint = fingerprint_of(spec.bind(*_as_delivered(queue, *call)))

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
