"""Resources, their families, owner hashes and the lock layer's Redis keys.

A *resource* names the unit of exclusivity (``order:123``), never a job id: two deliveries of
the same work carry different job ids but touch the same resource. Its *family* is the part
before the first ``:`` (``order``; ``other`` for a resource without one); metrics and the
dashboard group by family, never by resource id, so their cardinality stays bounded.

Keys of one resource (``P`` = ``JOBLOCK["KEY_PREFIX"]``), all under its hash tag so that every
key a script touches is in one Redis Cluster slot (a resource cannot contain braces)::

    P:{order:123}:lock      HASH    token, fence, holder details (TTL = the lock's TTL)
    P:{order:123}:lock:I    HASH    the same, for slot I (1..N-1) of a lock with limit=N
    P:{order:123}:fence     STRING  last fence issued (expires a day after the last acquire)
    P:{order:123}:queue     ZSET    tickets of waiting acquires in arrival order
    P:{order:123}:tickets   HASH    ticket -> its expiry and the details of a handed-over lock
    P:{order:123}:wake:T    LIST    "fence next-ticket lock-hash", pushed when handed to T
    P:{order:123}:released  STRING  an operator's note on a release (locks/notes.py); for
                            slot I of a lock with a limit, P:{order:123}:released:I
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property

from ..exceptions import InvalidResource

MAX_RESOURCE_LENGTH = 200
# Most holders a lock with a limit may have at once (``lock(limit=N)``): each slot is a key
# its scripts look at, so N is what one acquire costs the server.
MAX_LIMIT = 100
_CHARS = "A-Za-z0-9_.:@/-"
RESOURCE_RE = re.compile(rf"[{_CHARS}]{{1,{MAX_RESOURCE_LENGTH}}}\Z")
# A family is a resource's part before its first ':' (no ':' itself).
FAMILY_RE = re.compile(rf"[{_CHARS.replace(':', '')}]{{1,{MAX_RESOURCE_LENGTH}}}\Z")


def validate_resource(resource: object) -> str:
    """Return ``resource`` unchanged if valid, else raise :class:`InvalidResource` naming it."""
    if not isinstance(resource, str):
        raise InvalidResource(
            f"Lock resource must be a str, got {type(resource).__name__}: {resource!r}."
        )
    if RESOURCE_RE.match(resource):
        return resource
    if not resource:
        reason = "it is empty"
    elif len(resource) > MAX_RESOURCE_LENGTH:
        reason = f"it is {len(resource)} characters long (at most {MAX_RESOURCE_LENGTH})"
    else:
        bad = sorted({c for c in resource if not re.match(f"[{_CHARS}]", c)})
        reason = f"it contains {''.join(bad)!r}; allowed: A-Z a-z 0-9 _ . : @ / -"
    shown = resource if len(resource) <= 80 else resource[:77] + "..."
    raise InvalidResource(f"Invalid lock resource {shown!r}: {reason}.")


def validate_family(name: object) -> str:
    """``name`` if it can be a family, else ``ValueError`` naming it."""
    if not isinstance(name, str) or not FAMILY_RE.match(name):
        raise ValueError(
            f"Invalid family {repr(name)[:80]}: 1 to 200 characters from A-Z a-z 0-9 _ . @ / - "
            "(the part of a resource before its first ':')."
        )
    return name


def family(resource: str) -> str:
    """The family of a resource: the part before its first ``:`` (``order:1`` -> ``order``);
    ``"other"`` without a ``:`` (``inv-42``), so that ids never become metric families."""
    name, colon, _rest = resource.partition(":")
    return name if colon else "other"


def owner_hash(token: str) -> str:
    """A short, stable, non-reversible name for an owner token, safe to log and display: what
    "owner" means everywhere (the token itself is the secret)."""
    return hashlib.sha256(token.encode()).hexdigest()[:12]


def is_owner_hash(value: object) -> bool:
    """True for a string shaped like :func:`owner_hash`'s result."""
    return isinstance(value, str) and re.fullmatch("[0-9a-f]{12}", value) is not None


def validate_limit(what: str, limit: object) -> int:
    """``limit`` if it is an int in 1..:data:`MAX_LIMIT` (most holders at once), else
    ``ValueError`` naming ``what``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(
            f"{what} limit must be an int in 1..{MAX_LIMIT} (most holders at once), got {limit!r}."
        )
    return limit


@dataclass(frozen=True)
class LockKeys:
    """The keys of one resource under one prefix; ``slot`` picks which lock hash ``lock`` is
    (slot 0, the only one of a lock without a limit, is ``P:{resource}:lock``). Each key is
    built once per object (an acquire and its release name them several times)."""

    prefix: str
    resource: str
    slot: int = 0

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{{{self.resource}}}:{name}"

    @cached_property
    def lock(self) -> str:
        return self.slot_key(self.slot)

    def slot_key(self, slot: int) -> str:
        """The lock hash of ``slot`` (0: ``P:{resource}:lock``)."""
        return self._key("lock") if slot == 0 else self._key(f"lock:{slot}")

    def more_slots(self, limit: int) -> list[str]:
        """The lock hashes of slots 1..``limit`` - 1: what a lock with that limit adds to
        slot 0's."""
        return [self.slot_key(slot) for slot in range(1, limit)]

    def at(self, slot: int) -> LockKeys:
        """These keys with ``lock`` naming ``slot``'s hash."""
        if slot == self.slot:
            return self
        return LockKeys(self.prefix, self.resource, slot)

    @cached_property
    def fence(self) -> str:
        return self._key("fence")

    @cached_property
    def queue(self) -> str:
        return self._key("queue")

    @cached_property
    def tickets(self) -> str:
        return self._key("tickets")

    @property
    def released(self) -> str:
        """The operator's note on a release of ``slot``'s holding (:mod:`.notes`)."""
        return self._key("released") if self.slot == 0 else self._key(f"released:{self.slot}")

    def wake(self, ticket: str) -> str:
        """The list the waiter holding ``ticket`` blocks on (pushed when handed the lock)."""
        return self._key(f"wake:{ticket}")

    @cached_property
    def family(self) -> str:
        return family(self.resource)
