"""Who held a resource and who waited, when: the recent runs of each family, for the
dashboard's timeline.

Every run of a ``@locked_job`` with a lock, by an RQ worker, appends one :class:`Span` when it
ends: its resource, RQ job id and function, when it started (Unix seconds, the worker's
clock), how long it ran, how long it waited from enqueue to start, and its outcome (``ran``,
``replayed``, ``requeued`` or ``skipped``: found the resource busy, ``aborted``: lost its
lock, ``failed``, ``gave_up``). A span's end is its release.

The spans are a Redis LIST per family on the *queue's* connection (key
``keys.timeline_key``), written by :mod:`django_joblock.outcomes` in the same round trip as the
job's outcome meta (no extra round trip), trimmed to the last :data:`KEPT` and expiring
:data:`TTL` seconds after the last write. ``lock()`` calls outside a job are not on it.
Losing it loses the picture, never correctness.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from . import conf
from .backend import REDIS_ERRORS, text
from .deliveries import Delivery
from .keys import timeline_key

__all__ = ["KEPT", "TTL", "Span", "add_commands", "recent"]

#: Spans kept per family (the newest).
KEPT = 500
#: Seconds a family's timeline lives after its last run.
TTL = 3600


@dataclass(frozen=True)
class Span:
    """One run on a resource: started at ``started`` (Unix seconds) and held ``took`` s."""

    resource: str
    job_id: str
    func: str
    started: float
    took: float
    waited: float | None
    outcome: str

    @property
    def ended(self) -> float:
        return self.started + self.took

    @classmethod
    def of(cls, run: Delivery, func: str) -> Span:
        """The span of a run recorded as ``run`` (its delivery entry) of job function ``func``."""
        return cls(
            resource=run.resource,
            job_id=run.job_id,
            func=func,
            started=run.started or 0.0,
            took=run.took or 0.0,
            waited=run.waited,
            outcome=run.outcome,
        )


def add_commands(family: str, span: Span) -> list[list[Any]]:
    """The commands that append ``span`` to ``family``'s timeline, for the job's own outcome
    round trip on the queue's connection (:func:`django_joblock.outcomes.finish`)."""
    name = timeline_key(conf.get().KEY_PREFIX, family)
    return [
        ["RPUSH", name, json.dumps(span.__dict__, separators=(",", ":"))],
        ["LTRIM", name, -KEPT, -1],
        ["EXPIRE", name, TTL],
    ]


def recent(family: str, clients: list[Any], *, since: float | None = None) -> list[Span]:
    """``family``'s spans that ended after ``since`` (Unix seconds; default 10 minutes ago),
    read from ``clients`` (one connection per queue server and database:
    ``health.queue_connections()``), oldest first. A Redis that does not answer is left
    out."""
    since = time.time() - 600 if since is None else since
    name = timeline_key(conf.get().KEY_PREFIX, family)
    found: list[Span] = []
    for client in clients:
        try:
            raw = client.lrange(name, 0, -1)
        except REDIS_ERRORS:
            continue
        for item in raw:
            try:
                span = Span(**json.loads(text(item)))
            except (ValueError, TypeError):
                continue  # written by another version: skip, never fail the page
            if span.ended >= since:
                found.append(span)
    return sorted(found, key=lambda span: (span.started, span.job_id))
