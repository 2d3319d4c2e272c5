"""What an idempotency claim accepts: keys, scopes, fingerprints and results.

Bad keys and scopes are a ``ValueError`` naming them, raised by ``idempotent()`` and, for
``@locked_job``, at enqueue time. Results are checked with the encoder the record stores them
with, so a result that passes can always be saved.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from ..exceptions import IdempotencyError

MAX_KEY_LENGTH = 255  # the columns' sizes
MAX_SCOPE_LENGTH = 100
_FAMILY_RE = re.compile(r"[A-Za-z0-9_.@/-]{1,64}\Z")
# Nesting followed by _canonical; deeper (or a cycle) is represented by its type and repr.
_MAX_DEPTH = 32


def key_family(key: str) -> str:
    """The metrics family of a key: its part before the first ``:`` when that part is 1-64 of
    ``A-Z a-z 0-9 _ . @ / -`` (``refund:R-1`` -> ``refund``), else ``"other"``: bounded on
    purpose, so that ``invoice-42`` never becomes a metric series of its own."""
    prefix, colon, _rest = key.partition(":")
    return prefix if colon and _FAMILY_RE.match(prefix) else "other"


def validate_key(key: object, *, what: str = "idempotent()") -> str:
    """``key`` if it is a non-empty ``str`` of at most ``MAX_KEY_LENGTH`` characters without
    NUL (PostgreSQL cannot store NUL in text), else ``ValueError`` naming it."""
    return _validate(key, what, "key", 1, MAX_KEY_LENGTH)


def validate_scope(scope: object, *, what: str = "idempotent()") -> str:
    """``scope`` if it is a ``str`` of at most ``MAX_SCOPE_LENGTH`` characters without NUL,
    else ``ValueError`` naming it."""
    return _validate(scope, what, "scope", 0, MAX_SCOPE_LENGTH)


def _validate(value: object, what: str, name: str, low: int, high: int) -> str:
    if not isinstance(value, str):
        raise ValueError(
            f"{what}: idempotency {name} must be a str, got {type(value).__name__}: {value!r}."
        )
    if not low <= len(value) <= high:
        shown = value if len(value) <= 80 else value[:77] + "..."
        size = f"{low} to {high}" if low else f"at most {high}"
        raise ValueError(
            f"{what}: idempotency {name} must be {size} characters, got {len(value)}: {shown!r}."
        )
    if "\x00" in value:
        raise ValueError(f"{what}: idempotency {name} {value!r} contains a NUL character.")
    return value


def check_result(result: Any, *, key: str, scope: str) -> None:
    """Raise :class:`IdempotencyError` unless ``result`` can be stored as the record stores it
    (``DjangoJSONEncoder``, no NaN or infinity)."""
    try:
        json.dumps(result, cls=DjangoJSONEncoder, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise IdempotencyError(
            f"Result for idempotency key {key!r} cannot be stored as JSON "
            f"(DjangoJSONEncoder, no NaN or infinity): {exc}",
            key=key,
            scope=scope,
        ) from exc


def fingerprint_of(value: Any) -> str:
    """sha256 of the canonical JSON of ``value`` (sorted keys, no spaces). What JSON cannot
    encode as it is (sets, bytes, unsortable keys, objects) goes through :func:`_canonical`, so
    that a value has one fingerprint in every process (a set's order and a default ``repr``
    vary per process, and would make a replay in another worker a mismatch)."""
    try:
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        canonical = _dumps(_canonical(value, 0))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _canonical(value: Any, depth: int) -> Any:
    """A JSON value standing for ``value``, the same in every process; tagged
    (``{"__set__": ...}``) where plain JSON would make two different values alike."""
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
