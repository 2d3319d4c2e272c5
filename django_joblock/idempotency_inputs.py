"""What an idempotency claim accepts: keys, scopes, fingerprints and results.

- A key is a non-empty ``str`` of at most ``MAX_KEY_LENGTH`` characters without NUL; a scope a
  ``str`` of at most ``MAX_SCOPE_LENGTH`` without NUL (the columns' sizes; PostgreSQL cannot
  store NUL in text). Anything else is a ``ValueError`` naming it, raised by ``idempotent()``
  and, for ``@locked_job``, at enqueue time.
- A key's metrics *family* is its part before the first ``:`` (``refund:R-1`` -> ``refund``),
  and ``other`` for a key without one (``invoice-42``) or with an unusual prefix, so that keys
  never become metric series of their own.
- A fingerprint is the sha256 of the canonical JSON of the arguments.
- A result is checked with the encoder the record stores it with (``DjangoJSONEncoder``, no NaN
  or infinity), so a result that passes the check can always be saved.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

MAX_KEY_LENGTH = 255
MAX_SCOPE_LENGTH = 100
OTHER_FAMILY = "other"
_FAMILY_RE = re.compile(r"[A-Za-z0-9_.@/-]{1,64}\Z")


def key_family(key: str) -> str:
    """The metrics family of an idempotency key: its part before the first ``:`` when it has
    one (and that part is 1-64 of ``A-Z a-z 0-9 _ . @ / -``), else ``"other"``.

    Bounded on purpose: ``invoice-42`` is ``other``, never a series of its own.
    """
    prefix, colon, _rest = key.partition(":")
    return prefix if colon and _FAMILY_RE.match(prefix) else OTHER_FAMILY


def validate_key(key: object, *, what: str = "idempotent()") -> str:
    """``key`` if it is a usable idempotency key, else ``ValueError`` naming it.

    A key is a non-empty ``str`` of at most ``MAX_KEY_LENGTH`` characters without NUL (which
    PostgreSQL cannot store in text).
    """
    if not isinstance(key, str):
        raise ValueError(
            f"{what}: idempotency key must be a str, got {type(key).__name__}: {key!r}."
        )
    if not key or len(key) > MAX_KEY_LENGTH:
        shown = key if len(key) <= 80 else key[:77] + "..."
        raise ValueError(
            f"{what}: idempotency key must be 1 to {MAX_KEY_LENGTH} characters, got "
            f"{len(key)}: {shown!r}."
        )
    if "\x00" in key:
        raise ValueError(f"{what}: idempotency key {key!r} contains a NUL character.")
    return key


def validate_scope(scope: object, *, what: str = "idempotent()") -> str:
    """``scope`` if usable (a ``str`` of at most ``MAX_SCOPE_LENGTH``, no NUL), else
    ``ValueError`` naming it."""
    if not isinstance(scope, str):
        raise ValueError(
            f"{what}: idempotency scope must be a str, got {type(scope).__name__}: {scope!r}."
        )
    if len(scope) > MAX_SCOPE_LENGTH:
        raise ValueError(
            f"{what}: idempotency scope must be at most {MAX_SCOPE_LENGTH} characters, got "
            f"{len(scope)}: {scope!r}."
        )
    if "\x00" in scope:
        raise ValueError(f"{what}: idempotency scope {scope!r} contains a NUL character.")
    return scope


def check_result(result: Any) -> str:
    """``result`` as the JSON the record stores (``DjangoJSONEncoder``, no NaN/infinity).

    Raises ``TypeError`` / ``ValueError`` for a value that cannot be stored.
    """
    return json.dumps(result, cls=DjangoJSONEncoder, allow_nan=False)


def fingerprint_of(value: Any) -> str:
    """sha256 of the canonical JSON of ``value`` (sorted keys, no spaces)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder)
    return hashlib.sha256(canonical.encode()).hexdigest()
