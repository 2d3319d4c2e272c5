"""The note an operator's release leaves for the holder that finds its lock gone.

An operator release (admin force release, ``joblock_release``, ``joblock_reap``) writes, just
before its compare-and-delete (and takes back if nothing was released), a short-lived note
``P:{order:123}:released``: JSON ``{"owner", "action", "actor", "reason", "audit"}``, so a
holder noticing the loss can never look before the note exists. ``owner`` is the hash of the
released token: a note speaks about that holding only. The audit row's id is added once the
row is written. The note lives ``max(2 x lock TTL, 60 s)``: a holder notices a loss within
one TTL, and reads the note on its loss path only (in the job's thread, never the renewal
thread), to report "released by an operator (... audit #12)" instead of "expired".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any


def ttl_ms(lock_ttl_ms: int | None) -> int:
    """How long a note lives for a lock of ``lock_ttl_ms``: twice that, at least a minute."""
    return max(2 * int(lock_ttl_ms or 0), 60_000)


@dataclass(frozen=True)
class OperatorRelease:
    """Who released which holding of a lock, why, and the audit row (once written)."""

    owner: str
    action: str
    actor: str
    reason: str
    audit: int | None = None

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def decode(cls, raw: Any) -> OperatorRelease | None:
        try:
            data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
            texts = {name: str(data[name]) for name in ("owner", "action", "actor", "reason")}
            return cls(**texts, audit=None if data.get("audit") is None else int(data["audit"]))
        except (TypeError, ValueError, KeyError, AttributeError):
            return None

    def describe(self) -> str:
        """E.g. ``released by an operator (force_release by alice, audit #12): wedged``."""
        audit = f", audit #{self.audit}" if self.audit is not None else ""
        return (
            f"released by an operator ({self.action} by {self.actor or 'unknown'}{audit}): "
            f"{self.reason}"
        )


def read(found: Any, key: str, owner: str) -> OperatorRelease | None:
    """The note at ``key`` about ``owner``'s holding, if an operator released it."""
    note = OperatorRelease.decode(found.get(key) or "null")
    return note if note is not None and note.owner == owner else None
