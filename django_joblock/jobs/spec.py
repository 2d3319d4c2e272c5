"""What ``@locked_job`` knows about one function (:class:`JobSpec`): its templates, RQ options
and timeouts, shared by the enqueue side, the work horse and the system checks. A bad argument
raises ``ValueError`` / ``TypeError`` naming it and what is allowed (docs/jobs.md)."""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import math
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, ParamSpec, TypeVar

import rq
from rq import Retry
from rq.exceptions import TimeoutFormatError
from rq.queue import Queue
from rq.utils import parse_timeout

from .. import conf
from ..idempotency.inputs import validate_key
from ..locks.keys import validate_resource

P = ParamSpec("P")
R = TypeVar("R")


class OnConflict(enum.StrEnum):
    """What ``@locked_job`` does when its resource is busy (``on_conflict``; :mod:`.requeue`)."""

    REQUEUE = "requeue"  # requeue with backoff + jitter; give up after max_wait as failed
    SKIP = "skip"  # finish without running (counted and logged)
    FAIL = "fail"  # raise LockNotAcquired


CONFLICT_POLICIES = tuple(policy.value for policy in OnConflict)
Template = str | Callable[..., str] | None


@dataclass
class JobSpec(Generic[P, R]):
    """Everything ``@locked_job`` was told about one function."""

    func: Callable[P, R]
    queue: Any
    lock: Template
    idempotency_key: Template
    ttl: float | None
    heartbeat: bool
    on_conflict: OnConflict
    max_wait: float | None
    on_lost: Callable[..., Any] | None
    rq_options: dict[str, Any] = field(default_factory=dict)
    atomic: bool = True
    admission: bool = True
    dedupe: bool = False
    on_commit: bool = True
    on_rq: bool = True  # False: a @locked_task whose backend runs it elsewhere (no RQ queue)
    idempotency_scope: str | None = None  # ``scope=``: None for the dotted name
    concurrency: int = 1  # runs of one resource at once: its lock's ``limit``

    @property
    def name(self) -> str:
        """Dotted path RQ stores for the job (module + qualified name)."""
        return f"{self.func.__module__}.{self.func.__qualname__}"

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.func)

    @functools.cached_property
    def awaited(self) -> bool:
        """An ``async def`` function: its body is awaited inside the flow (``async_body``)."""
        return inspect.iscoroutinefunction(self.func)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults applied (``TypeError`` if they do not fit)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}(): {exc}") from exc
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
                f"@locked_job {self.name}: cannot build the {what} from {template!r} "
                f"with arguments {sorted(arguments)}: {exc!r}"
            ) from exc
        if not isinstance(value, str):
            raise ValueError(f"@locked_job {self.name}: the {what} must be a str, got {value!r}")
        return value

    def resource(self, arguments: dict[str, Any]) -> str | None:
        value = self.render(self.lock, arguments, "lock resource")
        return None if value is None else validate_resource(value)

    def key(self, arguments: dict[str, Any]) -> str | None:
        value = self.render(self.idempotency_key, arguments, "idempotency key")
        return None if value is None else validate_key(value, what=f"@locked_job {self.name}")

    @property
    def scope(self) -> str:
        """The scope of the job's idempotency records: ``scope=`` if given, else its dotted
        :attr:`name` (then renaming or moving the function starts a new scope)."""
        if self.idempotency_scope is not None:
            return self.idempotency_scope
        return self.name


def check_template(func: Callable[..., Any], template: Template, what: str) -> None:
    """Refuse a template field ``func`` does not take (with ``**kwargs``: checked at enqueue)."""
    if template is None or callable(template):
        return
    where = f"@locked_job {func.__qualname__}"
    if not isinstance(template, str):
        raise TypeError(f"{where}: {what} must be a str, a callable or None, got {template!r}")
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    fields = set()
    try:
        for _literal, name, _spec, _conversion in string.Formatter().parse(template):
            if name is None:
                continue
            root = name.split(".", 1)[0].split("[", 1)[0]
            if not root or root.isdigit():
                raise ValueError(f"positional field {{{name}}} in {template!r}; use names")
            fields.add(root)
    except ValueError as exc:
        raise ValueError(f"{where}: bad {what}: {exc}") from exc
    if unknown := ", ".join(sorted(fields - set(params))):
        known = ", ".join(params) or "none"
        raise ValueError(f"{where}: {what} {template!r} uses {unknown}; parameters: {known}")


class TimeoutFinding(NamedTuple):
    """A W002 / W006 finding about one job and one RQ job timeout."""

    id: str
    message: str
    hint: str


@functools.cache
def rq_option_names() -> frozenset[str]:
    """The options of the installed rq's ``Queue.enqueue`` (``enqueue_call``'s, as spelt there)."""
    names = set(inspect.signature(Queue.enqueue_call).parameters)
    return frozenset((names - {"self", "func", "args", "kwargs", "timeout"}) | {"job_timeout"})


def check_rq_options(options: dict[str, Any], what: str) -> None:
    """``ValueError`` naming an option RQ does not know (given ``args=`` / ``kwargs=``, RQ drops
    it silently: ``job_timout=`` would keep the default), or a ``job_timeout`` it cannot use."""
    unknown = sorted(set(options) - rq_option_names())
    if unknown:
        verb = "is not an option" if len(unknown) == 1 else "are not options"
        raise ValueError(
            f"{what}: {', '.join(unknown)} {verb} of RQ's enqueue (rq {rq.__version__} takes "
            f"{', '.join(sorted(rq_option_names()))}); the job's own arguments go in "
            ".delay(...) or .enqueue(args=(...), kwargs={...})."
        )
    _check_option_types(options, what)
    value = options.get("job_timeout")
    if value is None:
        return
    seconds = None
    whole = isinstance(value, float) and value.is_integer()  # not NaN, not infinite
    if whole or (isinstance(value, (int, str)) and not isinstance(value, bool)):
        with contextlib.suppress(TimeoutFormatError, ValueError, OverflowError):
            seconds = parse_timeout(value)
    if seconds is None or (seconds != -1 and not 1 <= seconds <= conf.MAX_DURATION):
        raise ValueError(
            f"{what}: job_timeout must be whole seconds from 1 to {conf.MAX_DURATION:.0f} "
            "(365 days; RQ's alarm takes no more), an int or a str such as '90', '10m', '2h', "
            f"or -1 for none; got {value!r}"
        )


def _whole_seconds_or_forever(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -1 <= value <= 10**10


# What RQ's enqueue options must be, checked at decoration and at each enqueue (RQ itself
# raises deep inside its enqueue, or stores a value its worker then fails on).
_OPTION_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "retry": (lambda value: isinstance(value, Retry), "an rq.Retry, e.g. Retry(max=3)"),
    "meta": (lambda value: isinstance(value, dict), "a dict"),
    "at_front": (lambda value: isinstance(value, bool), "True or False"),
    "description": (lambda value: isinstance(value, str), "a str"),
    "result_ttl": (_whole_seconds_or_forever, "whole seconds, or -1 for ever"),
    "failure_ttl": (_whole_seconds_or_forever, "whole seconds, or -1 for ever"),
    "ttl": (_whole_seconds_or_forever, "whole seconds, or -1 for ever"),
}


def _check_option_types(options: dict[str, Any], what: str) -> None:
    """``ValueError`` naming an RQ option of :data:`_OPTION_TYPES` given a value RQ cannot use
    (None, RQ's "not set", is fine)."""
    for name, (fits, expected) in _OPTION_TYPES.items():
        value = options.get(name)
        if value is not None and not fits(value):
            raise ValueError(f"{what}: {name} must be {expected}; got {value!r}")


def job_timeout(value: Any, queue: Any) -> float:
    """RQ's timeout (s) for ``job_timeout=value`` on ``queue`` (None: its default; -1: inf)."""
    seconds = parse_timeout(value)
    if seconds is None:  # the queue's default, as RQ gives it to a job it creates (unsaved)
        seconds = parse_timeout(queue.create_job(len).timeout) or 180
    return math.inf if seconds == -1 else float(seconds)


def timeout_findings(spec: JobSpec[Any, Any], timeout: float) -> list[TimeoutFinding]:
    """W002 and W006 for ``spec`` running under an RQ job timeout of ``timeout`` seconds."""
    current = conf.get()
    shown = "none (-1)" if math.isinf(timeout) else f"{timeout:g}s"
    ttl = spec.ttl if spec.ttl is not None else current.LOCK_TTL
    lease = current.IDEMPOTENCY_LEASE
    found = []
    if spec.lock is not None and not spec.heartbeat and ttl < timeout:
        message = f"TTL {ttl:g}s < job_timeout {shown} and no heartbeat: a slow run loses its lock"
        found.append(("W002", message, "Turn heartbeat on, or make ttl longer than job_timeout."))
    if spec.lock is None and spec.idempotency_key is not None and timeout > lease:
        message = (
            f"RQ job timeout {shown} > IDEMPOTENCY_LEASE {lease:g}s and no lock: a duplicate "
            "delivered after the lease takes the claim over and runs beside the first run."
        )
        hint = "Raise JOBLOCK['IDEMPOTENCY_LEASE'] above job_timeout, lower it, or add a lock."
        found.append(("W006", message, hint))
    return [TimeoutFinding(id, f"{spec.name}: {message}", hint) for id, message, hint in found]
