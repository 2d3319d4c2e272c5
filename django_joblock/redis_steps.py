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


class Progress:
    """What the last call of a flow gave (a reply, or the exception it raised), and the flow's
    result once it ended: the state a driver keeps between steps."""

    def __init__(self) -> None:
        self.reply: Any = None
        self.error: BaseException | None = None
        self.result: Any = None

    def advance(self, steps: Steps[Any]) -> Step | None:
        """Give the flow the last call's reply, or throw its exception in at its step; the
        flow's next step, or None once it returned (its value in :attr:`result`)."""
        error = self.error
        self.error = None
        try:
            if error is None:
                return steps.send(self.reply)
            return steps.throw(error)
        except StopIteration as stop:
            self.result = stop.value
            return None

    def replied(self, reply: Any) -> None:
        self.reply = reply

    def failed(self, error: BaseException) -> None:
        self.reply = None
        self.error = error


def drive(steps: Steps[T], found: Any, blocking: Any = None) -> T:
    """Run ``steps`` on the redis-py client ``found`` (``Block`` steps on ``blocking``) and
    return the flow's result. Whatever a call raises is thrown into the flow at its step."""
    outcome = Progress()
    while True:
        step = outcome.advance(steps)
        if step is None:
            return outcome.result  # type: ignore[no-any-return]
        try:
            outcome.replied(_run(step, found, blocking))
        except BaseException as exc:  # noqa: BLE001 - thrown into the flow, which decides
            outcome.failed(exc)


def _run(step: Step, found: Any, blocking: Any) -> Any:
    if isinstance(step, Send):
        return send(found, step.calls, step.extra)
    if isinstance(step, RunScript):
        return step.script(found, step.keys, step.args)
    return blocking.blpop([step.key], timeout=step.timeout)
