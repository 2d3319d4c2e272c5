"""Redis calls as data, so that one flow serves the sync and the asyncio clients.

A lock's flows (acquire once, wait in line, release with hand-over, give back, renew) are
generators that *yield* the Redis calls they need as steps and receive each reply (or have
its exception thrown in, at the ``yield``, as if the call had been made there). A driver
runs the calls: :func:`drive` on a redis-py client, :func:`django_joblock.async_backend.drive`
on a ``redis.asyncio`` client. The logic of a flow, retries and error handling included,
lives once, in its generator; the drivers know nothing of locks.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, NamedTuple, TypeVar

from .backend import Call, Script, send

T = TypeVar("T")


class Send(NamedTuple):
    """Send ``calls`` (and ``extra``) in one round trip, as :func:`~.backend.send` does; the
    reply is its list of replies, a command the server refused giving its exception."""

    calls: Sequence[Call]
    extra: Sequence[Call] = ()


class RunScript(NamedTuple):
    """Run ``script`` on ``keys`` and ``args``; the reply is the script's, a refusal raised."""

    script: Script
    keys: Sequence[str]
    args: Sequence[Any]


class Block(NamedTuple):
    """``BLPOP key timeout`` on the driver's blocking client; the reply is ``BLPOP``'s (None
    when the timeout (s) passed)."""

    key: str
    timeout: float


Step = Send | RunScript | Block
Steps = Generator[Step, Any, T]


def advance(steps: Steps[Any], reply: Any, error: BaseException | None) -> Step:
    """The flow's next step, given the last call's ``reply``, or with its ``error`` thrown in
    at its step. Raises ``StopIteration`` (its value the flow's result) when the flow ended.
    Both drivers call it: one call per step, kept that cheap because an uncontended acquire
    is a flow of one step."""
    if error is None:
        return steps.send(reply)
    return steps.throw(error)


def drive(steps: Steps[T], found: Any, blocking: Any = None) -> T:
    """Run ``steps`` on the redis-py client ``found`` (``Block`` steps on ``blocking``) and
    return the flow's result. Whatever a call raises is thrown into the flow at its step."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = advance(steps, reply, error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            if isinstance(step, Send):
                reply = send(found, step.calls, step.extra)
            elif isinstance(step, RunScript):
                reply = step.script(found, step.keys, step.args)
            else:
                reply = blocking.blpop([step.key], timeout=step.timeout)
            error = None
        except BaseException as exc:  # noqa: BLE001 - thrown into the flow, which decides
            reply = None
            error = exc
