"""What an idempotency claim accepts: keys, scopes, fingerprints and results. Bad keys and scopes
are a ``ValueError`` naming them (``idempotent()``; ``@locked_job`` at enqueue); results are checked
with the encoder the record stores them with (docs/idempotency.md)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from typing import Any, TypeVar

from django.core.serializers.json import DjangoJSONEncoder

from ..exceptions import IdempotencyError

MAX_KEY_LENGTH = 255  # the columns' sizes
MAX_SCOPE_LENGTH = 100
_FAMILY_RE = re.compile(r"[A-Za-z0-9_.@/-]{1,64}\Z")
# Nesting followed by _canonical; deeper (or a cycle) is represented by its type and repr.
_MAX_DEPTH = 32
_Error = TypeVar("_Error", bound=IdempotencyError)


def key_family(key: str) -> str:
    """The metrics family of a key, bounded: its part before the first ``:`` when that is 1-64
    of ``A-Z a-z 0-9 _ . @ / -`` (``refund:R-1`` -> ``refund``), else ``"other"``."""
    prefix, colon, _rest = key.partition(":")
    return prefix if colon and _FAMILY_RE.match(prefix) else "other"


def validate_key(key: object, *, what: str = "idempotent()") -> str:
    """``key`` if it is a non-empty ``str`` of at most ``MAX_KEY_LENGTH`` characters without
    NUL (PostgreSQL cannot store NUL in text), else ``ValueError`` naming it."""
    return _validate(key, what, "key", 1, MAX_KEY_LENGTH)


def validate_scope(scope: object, *, what: str = "idempotent()") -> str:
    """``scope`` if it is a ``str`` of at most ``MAX_SCOPE_LENGTH`` characters without NUL."""
    return _validate(scope, what, "scope", 0, MAX_SCOPE_LENGTH)


def _validate(value: object, what: str, name: str, low: int, high: int) -> str:
    prefix = f"{what}: idempotency {name}"
    if not isinstance(value, str):
        raise ValueError(f"{prefix} must be a str, got {type(value).__name__}: {value!r}.")
    if not low <= len(value) <= high:
        shown = value if len(value) <= 80 else value[:77] + "..."
        size = f"{low} to {high}" if low else f"at most {high}"
        raise ValueError(f"{prefix} must be {size} characters, got {len(value)}: {shown!r}.")
    if not storable_text(value):
        raise ValueError(
            f"{prefix} {value!r} contains a NUL character or a lone surrogate, which "
            "PostgreSQL cannot store."
        )
    return value


def storable_text(value: str) -> bool:
    """Whether a text column of any backend can store ``value``: no NUL and no lone surrogate
    (a ``str`` that is not UTF-8, such as a file name decoded with ``surrogateescape``), which
    PostgreSQL refuses."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable_error(error: str, limit: int) -> str:
    """``error`` (an exception's text) as a text column of any backend stores it, cut to
    ``limit`` characters: a NUL written as ``\\x00`` and a lone surrogate as ``\\udcff``.

    An exception's message is anything its raiser chose (a provider's response body, a file
    name decoded with ``surrogateescape``); PostgreSQL refuses NUL and lone surrogates fail to
    encode on every backend, and the failure must still be recorded, never replaced by that
    error."""
    error = error.replace("\x00", "\\x00")
    error = error.encode("utf-8", "backslashreplace").decode("utf-8")
    return error[:limit]


def error_for(kind: type[_Error], key: str, scope: str, why: str) -> _Error:
    """``kind`` with a message naming ``key`` and ``scope``, then ``why``."""
    return kind(f"Idempotency key {key!r} (scope {scope!r}) {why}", key=key, scope=scope)


def check_result(result: Any, *, key: str, scope: str) -> None:
    """Raise :class:`IdempotencyError` unless :func:`storable_json` can store ``result``."""
    try:
        storable_json(result)
    except (TypeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        why = (
            "has a result that cannot be stored as JSON (no NaN, infinity, NUL or lone "
            f"surrogate): {exc}"
        )
        raise error_for(IdempotencyError, key, scope, why) from exc


# A JSON-escaped NUL: \u0000 not itself escaped (preceded by an even run of backslashes).
_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# A JSON-escaped lone surrogate (json.dumps escapes every non-ASCII character): a high one not
# followed by a low one, or a low one not preceded by a high one; not itself escaped, as above.
_LONE_SURROGATE = re.compile(
    r"(?<!\\)(?:\\\\)*(?:\\ud[89ab][0-9a-f]{2}(?!\\ud[c-f][0-9a-f]{2})"
    r"|(?<!\\ud[89ab][0-9a-f]{2})\\ud[c-f][0-9a-f]{2})"
)


def storable_json(value: Any) -> str:
    """``value`` as JSON (Django's encoder) that a ``JSONField`` stores on any backend: no NaN,
    infinity, NUL or lone surrogate (PostgreSQL cannot hold one); else ``ValueError``
    (``TypeError``: not JSON)."""
    encoded = json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False)
    if _NUL.search(encoded):
        raise ValueError("a string in it contains NUL (\\x00), which PostgreSQL cannot store")
    if _LONE_SURROGATE.search(encoded):
        raise ValueError(
            "a string in it has a lone surrogate (not UTF-8), which PostgreSQL cannot store"
        )
    return encoded


def fingerprint_of(value: Any) -> str:
    """sha256 of the canonical JSON of ``value`` (sorted keys, no spaces). What JSON cannot
    encode (sets, bytes, unsortable keys, objects) goes through :func:`_canonical`: one
    fingerprint in every process, where a set's order or a default ``repr`` would vary."""
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
    with contextlib.suppress(TypeError, ValueError):  # Decimal, datetime, UUID...: as stored
        return json.loads(json.dumps(value, cls=DjangoJSONEncoder))
    meta = getattr(value, "_meta", None)
    if meta is not None and hasattr(meta, "label") and hasattr(value, "pk"):
        return {"__model__": meta.label, "pk": _canonical(value.pk, depth)}
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and not isinstance(value, type):
        return {"__type__": kind, "state": _canonical(state, depth)}
    return {"__type__": kind, "repr": repr(value)}
