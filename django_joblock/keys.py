"""Resource validation and the canonical Redis key layout.

A *resource* names the unit of exclusivity (``order:123``), never a job id: two deliveries of the
same work carry different job ids but touch the same resource. Its *family* is the part before
the first ``:`` (``order``); metrics and the dashboard group by family, never by resource id, so
their cardinality stays bounded.

Key layout (``P`` = ``JOBLOCK["KEY_PREFIX"]``)::

    P:{order:123}:lock      HASH   the lock: token, fence, holder details (TTL = lock TTL)
    P:{order:123}:fence     STRING last fence issued for the resource (expires after a day)
    P:{order:123}:queue     ZSET   tickets of waiting acquires, score = arrival order
    P:{order:123}:tickets   HASH   ticket -> its expiry (server ms) and the lock's details,
                                   packed (MessagePack), for a release to hand the lock over
    P:{order:123}:wake:T    LIST   "fence next": pushed when the lock is handed to ticket T,
                                   whose waiter blocks on it (BLPOP)
    P:{order:123}:released  STRING an operator's note on a release (django_joblock.tombstones)
    P:active:order          ZSET   active-lock index of a family: member "resource#owner",
                                   score = expiry in Unix ms (a hint; readers prune and verify)
    P:families              SET    families with locks in the index (pruned when idle)
    P:deliveries:<H>        LIST   the last deliveries of one idempotency key (H: a hash of
                                   scope and key), JSON, newest last; on the *queue's* Redis,
                                   beside RQ's jobs (django_joblock.deliveries)
    P:{metrics}:b:<minute>  HASH   metric increments of one 60 s bucket (expire after
                                   METRICS_RETENTION); fields: see django_joblock.metrics
    P:{metrics}:total       HASH   all-time metric totals (Prometheus counters)
    P:{metrics}:active      ZSET   samples of the active-lock count (the growth alert)

Each structure has one owner that encodes and decodes it: the lock hash
:mod:`django_joblock.holders` (written by the scripts of :mod:`django_joblock.scripts`), the
fence counter the acquire script, the waiting line :mod:`django_joblock.waiting`, the
operator's note :mod:`django_joblock.tombstones`, the active-lock index and the families set
:mod:`django_joblock.active_index`, the metric hashes and samples
:mod:`django_joblock.metrics`.

The braces are a Redis Cluster hash tag: every key a script touches hashes to the same slot.
Resources cannot contain braces, so a resource can never break out of its tag.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from .exceptions import InvalidResource

RESOURCE_RE = re.compile(r"[A-Za-z0-9_.:@/-]{1,200}\Z")
MAX_RESOURCE_LENGTH = 200


def validate_resource(resource: object) -> str:
    """Return ``resource`` unchanged if valid, else raise :class:`InvalidResource` naming it."""
    if not isinstance(resource, str):
        raise InvalidResource(
            f"Lock resource must be a str, got {type(resource).__name__}: {resource!r}."
        )
    if not RESOURCE_RE.match(resource):
        if not resource:
            reason = "it is empty"
        elif len(resource) > MAX_RESOURCE_LENGTH:
            reason = f"it is {len(resource)} characters long (at most {MAX_RESOURCE_LENGTH})"
        else:
            bad = sorted({c for c in resource if not re.match(r"[A-Za-z0-9_.:@/-]", c)})
            reason = f"it contains {''.join(bad)!r}; allowed: A-Z a-z 0-9 _ . : @ / -"
        shown = resource if len(resource) <= 80 else resource[:77] + "..."
        raise InvalidResource(f"Invalid lock resource {shown!r}: {reason}.")
    return resource


def family(resource: str) -> str:
    """The family of a resource: the part before its first ``:`` (``order:1`` -> ``order``)."""
    return resource.split(":", 1)[0]


def owner_hash(token: str) -> str:
    """A short, stable, non-reversible name for an owner token, safe to log and display: what
    "owner" means everywhere (the token itself is the secret)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


_OWNER_RE = re.compile(r"[0-9a-f]{12}\Z")


def is_owner_hash(value: object) -> bool:
    """True for a string shaped like :func:`owner_hash`'s result."""
    return isinstance(value, str) and bool(_OWNER_RE.match(value))


@dataclass(frozen=True)
class LockKeys:
    """The keys of one resource under one prefix."""

    prefix: str
    resource: str

    @property
    def lock(self) -> str:
        return f"{self.prefix}:{{{self.resource}}}:lock"

    @property
    def fence(self) -> str:
        return f"{self.prefix}:{{{self.resource}}}:fence"

    @property
    def queue(self) -> str:
        return f"{self.prefix}:{{{self.resource}}}:queue"

    @property
    def tickets(self) -> str:
        return f"{self.prefix}:{{{self.resource}}}:tickets"

    def wake(self, ticket: str) -> str:
        """The list the waiter holding ``ticket`` blocks on (pushed when handed the lock)."""
        return f"{self.prefix}:{{{self.resource}}}:wake:{ticket}"

    @property
    def family(self) -> str:
        return family(self.resource)

    @property
    def index(self) -> str:
        return active_index_key(self.prefix, self.family)


def metric_bucket_key(prefix: str, minute: int) -> str:
    """The metric bucket of the minute starting at Unix time ``minute`` (a multiple of 60)."""
    return f"{prefix}:{{metrics}}:b:{minute}"


def metric_totals_key(prefix: str) -> str:
    """The all-time metric totals (same ``{metrics}`` hash tag as the buckets)."""
    return f"{prefix}:{{metrics}}:total"


def active_samples_key(prefix: str) -> str:
    """Samples of the active-lock count, for the growth alert."""
    return f"{prefix}:{{metrics}}:active"


def active_index_key(prefix: str, family_name: str) -> str:
    """The active-lock ZSET of one family."""
    return f"{prefix}:active:{family_name}"


def families_key(prefix: str) -> str:
    """The SET of families that have held a lock."""
    return f"{prefix}:families"


def deliveries_key(prefix: str, scope: str, key: str) -> str:
    """The delivery history of idempotency ``key`` in ``scope`` (bounded length: a hash)."""
    digest = hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()[:32]
    return f"{prefix}:deliveries:{digest}"


def timeline_key(prefix: str, family_name: str) -> str:
    """The recent runs of one family's resources (a bounded LIST, see ``timeline``)."""
    return f"{prefix}:timeline:{family_name}"
