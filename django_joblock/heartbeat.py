"""What the renewal thread keeps for one holding, and the commands of one renewal round trip.

An :class:`Entry` refers to its lock *weakly*: a lock nobody references any more can be
collected, and the thread then lets it expire instead of renewing it forever. Its ``RENEW``
command and active-index member are encoded once per holding, the first time they are needed
(most locks are released before their first renewal), so a renewal costs no encoding work.

:func:`batch` turns the due work into one pre-encoded round trip for the lean command path:
every ``RENEW``, then the active-index writes of :mod:`django_joblock.active_index` (one ``ZADD``
per family index, one ``SADD`` of the families). No redis-py pipeline objects: with thousands of
held locks their per-command encoding and reply parsing was most of the thread's CPU.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from . import active_index, lua
from .lean import pack

L = TypeVar("L")


@dataclass
class RenewalStats:
    """Counters of this process's renewal thread (cumulative)."""

    round_trips: int = 0
    renewed: int = 0
    renew_failed: int = 0
    lost: int = 0
    index_writes: int = 0
    dropped: int = 0
    cpu_seconds: float = 0.0


@dataclass(eq=False, slots=True)
class Entry(Generic[L]):
    """One holding of one lock, as the renewal thread schedules it."""

    ref: weakref.ReferenceType[L]
    lock_id: int  # id() of the lock: the registry key, valid while ``ref`` returns the lock
    resource: str
    key: str
    alias: str
    index_key: str
    ttl_ms: int
    interval: float
    renew_due: float
    index_due: float
    renew_command: bytes = b""
    member: bytes = b""
    indexed: bool = False
    failures: int = 0
    in_flight: bool = False

    def encode(self, token: str, owner: str) -> None:
        """Encode this holding's commands (once): ``token`` is its lock's, ``owner`` its hash."""
        if not self.renew_command:
            self.renew_command = pack(("EVALSHA", lua.RENEW_SHA, 1, self.key, token, self.ttl_ms))
            self.member = active_index.member(self.resource, owner).encode()


def batch(items: Iterable[tuple[Entry[L], str, bool]], prefix: str) -> tuple[bytes, int, int]:
    """Encode one round trip for ``(entry, family, renew?)`` items (each already encoded).

    Returns ``(packed commands, number of commands, number of renewals)``; the renewals come
    first, in the order of the items that have ``renew`` set, so their replies do too. Every
    item's active-index entry is written (or refreshed) after them (see
    :func:`django_joblock.active_index.add_commands`), the families set with every batch: it
    must come back after a ``FLUSHDB`` or a restart without persistence.
    """
    renewals: list[bytes] = []
    entries = []
    wall_ms = int(time.time() * 1000)
    for entry, family, renew in items:
        if renew:
            renewals.append(entry.renew_command)
        entries.append((entry.index_key, family, entry.member, wall_ms + entry.ttl_ms))
    commands = renewals + [pack(command) for command in active_index.add_commands(prefix, entries)]
    return b"".join(commands), len(commands), len(renewals)
