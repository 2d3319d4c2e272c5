"""What an idempotency claim accepts: keys, scopes, fingerprints and results.

- A key is a non-empty ``str`` of at most ``MAX_KEY_LENGTH`` characters without NUL; a scope a
  ``str`` of at most ``MAX_SCOPE_LENGTH`` without NUL (the columns' sizes; PostgreSQL cannot
  store NUL in text). Anything else is a ``ValueError`` naming it, raised by ``idempotent()``
  and, for ``@locked_job``, at enqueue time.
- A key's metrics *family* is its part before the first ``:`` (``refund:R-1`` -> ``refund``),
  and ``other`` for a key without one (``invoice-42``) or with an unusual prefix, so that keys
  never become metric series of their own.
- A fingerprint is the sha256 of the canonical JSON of the arguments (sets, bytes and plain
  objects included: :func:`fingerprint_of`).
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
    """sha256 of the canonical JSON of ``value`` (sorted keys, no spaces).

    A value JSON cannot encode as it is (a set, bytes, a dict whose keys JSON cannot sort, a
    model instance, a dataclass or another plain object) is encoded through
    :func:`_canonical` instead, so that the same value has the same fingerprint in every
    process: a set's order follows the per-process hash seed and a default ``repr`` holds a
    memory address, either of which would make a replay in another worker a mismatch.
    """
    try:
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        canonical = _dumps(_canonical(value, 0))
    return hashlib.sha256(canonical.encode()).hexdigest()


# Nesting followed by _canonical; deeper (or a cycle) is represented by its type and repr.
_MAX_DEPTH = 32


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _canonical(value: Any, depth: int) -> Any:
    """A JSON value standing for ``value``, the same in every process (see
    :func:`fingerprint_of`). Tagged (``{"__set__": ...}``) where plain JSON would make two
    different values alike."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if depth > _MAX_DEPTH:
        return {"__type__": kind, "repr": repr(value)}
    depth += 1
    if isinstance(value, (list, tuple)):
        return [_canonical(item, depth) for item in value]
    if isinstance(value, dict):
        pairs = [(_canonical(k, depth), _canonical(v, depth)) for k, v in value.items()]
        if all(isinstance(k, str) for k, _ in pairs):
            return dict(pairs)
        return {"__items__": sorted(([_dumps(k), v] for k, v in pairs), key=lambda kv: kv[0])}
    if isinstance(value, (set, frozenset)):
        return {"__set__": sorted(_dumps(_canonical(item, depth)) for item in value)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": bytes(value).hex()}
    try:  # Decimal, datetime, UUID, lazy strings...: as the records store them
        return json.loads(json.dumps(value, cls=DjangoJSONEncoder))
    except (TypeError, ValueError):
        pass
    meta = getattr(value, "_meta", None)
    if meta is not None and hasattr(meta, "label") and hasattr(value, "pk"):
        return {"__model__": meta.label, "pk": _canonical(value.pk, depth)}
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and not isinstance(value, type):
        return {"__type__": kind, "state": _canonical(state, depth)}
    return {"__type__": kind, "repr": repr(value)}
