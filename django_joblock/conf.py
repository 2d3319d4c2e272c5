"""The single ``JOBLOCK`` setting: typed defaults, read lazily, reset on ``setting_changed``.

All durations are in seconds (floats allowed). Every key is optional; unknown keys are an error
(system check ``django_joblock.E002``) because a typo such as ``LOCK_TLL`` would otherwise be
silently ignored and the default used.

``get()`` returns a frozen :class:`JoblockSettings`. It validates on first use and raises
:class:`~django_joblock.exceptions.JoblockConfigError` naming the bad key, so a broken setting is
never half-applied; ``problems()`` returns the same findings for the system checks.
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .exceptions import JoblockConfigError

DAY = 86400.0

DEFAULT_BACKOFF: dict[str, float] = {"base": 1.0, "factor": 2.0, "max": 300.0}
DEFAULT_ALERTS: dict[str, float] = {
    # Fraction of acquire attempts that found the lock busy, over WINDOW seconds.
    "CONTENTION_RATIO": 0.5,
    # Renewal failures within WINDOW seconds.
    "RENEW_FAILURES": 5,
    # A lock held this many times longer than its family's usual (p95) hold time.
    "HOLD_FACTOR": 10,
    # Active locks growing monotonically for this many seconds.
    "ACTIVE_GROWTH": 1800,
    # The sliding window the rates above are computed over.
    "WINDOW": 300,
}

DEFAULTS: dict[str, Any] = {
    "REDIS_ALIAS": "default",
    "KEY_PREFIX": "joblock",
    "LOCK_TTL": 30.0,
    "HEARTBEAT_INTERVAL": None,  # None = LOCK_TTL / 3
    "MAX_HOLD": None,
    "ACQUIRE_WAIT": 0.0,
    # How long a waiting acquire keeps its place in line without a sign of life, and how long a
    # lock handed to a waiter lives until that waiter renews it: a waiter that dies (or stops)
    # delays the line by at most this long. Waiters refresh their ticket every quarter of it
    # (at most every second).
    "WAITER_TTL": 2.0,
    "ON_LOCK_LOST": "abort",
    "REQUEUE_BACKOFF": DEFAULT_BACKOFF,
    "REQUEUE_MAX_WAIT": 3600.0,
    "IDEMPOTENCY_TTL": 7 * DAY,
    "IDEMPOTENCY_LEASE": 300.0,
    "STUCK_AFTER": 900.0,
    "ALERTS": DEFAULT_ALERTS,
    # Upper bound of the socket timeout the renewal thread uses (it also stays below TTL/5).
    "RENEW_TIMEOUT": 2.0,
    # Metrics in Redis: on/off, and how long the per-minute buckets are kept.
    "METRICS": True,
    "METRICS_RETENTION": DAY,
    # Bearer token that may read the Prometheus view without a staff login (None: staff only).
    "METRICS_TOKEN": None,
}

ON_LOCK_LOST_CHOICES = ("abort", "flag")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")

# The range of every number a user gives, in settings and in arguments (``lock(ttl=...)``,
# ``@locked_job(max_wait=...)``...). Finite always: NaN passes every comparison, so a NaN
# interval would silently stop renewals, and an infinite or absurd TTL cannot be sent to Redis.
MAX_TTL = 7 * DAY  # longest lock TTL / lease: how long a crashed holder can block a resource
MAX_DURATION = 365 * DAY  # longest wait, hold, window or retention


@dataclass(frozen=True)
class Range:
    """Allowed values of one number: from ``low`` (excluded if ``open_low``) to ``high``."""

    low: float
    high: float
    open_low: bool = False
    unit: str = "seconds"

    def describe(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"{'>' if self.open_low else '>='} {self.low:g} and <= {self.high:g}{unit}"

    def problem(self, value: object) -> str:
        """Why ``value`` is not allowed ("" if it is)."""
        kind = f"number of {self.unit}" if self.unit else "number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a {kind}, got {value!r}"
        # Only floats can be NaN or infinite (math.isfinite would overflow on a huge int).
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite {kind}, got {value!r}"
        if value < self.low or (self.open_low and value == self.low) or value > self.high:
            return f"must be {self.describe()}, got {value!r}"
        return ""

    def check(self, what: str, value: object) -> float:
        """``value`` as a float, or ``ValueError`` naming ``what`` and the allowed range."""
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{what} {problem}.")
        assert isinstance(value, (int, float))
        return float(value)


TTL_RANGE = Range(0.01, MAX_TTL)
WAIT_RANGE = Range(0.0, MAX_DURATION)
HOLD_RANGE = Range(0.0, MAX_DURATION, open_low=True)
MAX_WAIT_RANGE = Range(0.0, MAX_DURATION, open_low=True)
LEASE_RANGE = Range(0.01, MAX_TTL)
WAITER_TTL_RANGE = Range(0.1, 3600.0)

# Top-level numbers; None is also allowed for the keys in _OPTIONAL.
_NUMBERS: dict[str, Range] = {
    "LOCK_TTL": TTL_RANGE,
    "HEARTBEAT_INTERVAL": Range(0.001, MAX_TTL),
    "MAX_HOLD": HOLD_RANGE,
    "ACQUIRE_WAIT": WAIT_RANGE,
    "WAITER_TTL": WAITER_TTL_RANGE,
    "REQUEUE_MAX_WAIT": WAIT_RANGE,
    "IDEMPOTENCY_TTL": Range(1.0, 10 * 365 * DAY),
    "IDEMPOTENCY_LEASE": LEASE_RANGE,
    "STUCK_AFTER": Range(0.0, MAX_DURATION, open_low=True),
    "RENEW_TIMEOUT": Range(0.001, 60.0),
    # Buckets are a minute long and expire after the retention (EXPIRE takes whole seconds).
    "METRICS_RETENTION": Range(60.0, MAX_DURATION),
}
_OPTIONAL = frozenset({"HEARTBEAT_INTERVAL", "MAX_HOLD"})
_SUB_NUMBERS: dict[str, dict[str, Range]] = {
    "REQUEUE_BACKOFF": {
        "base": Range(0.0, DAY, open_low=True),
        "factor": Range(1.0, 100.0, unit=""),
        "max": Range(0.0, DAY, open_low=True),
    },
    "ALERTS": {
        "CONTENTION_RATIO": Range(0.0, 1.0, open_low=True, unit=""),
        "RENEW_FAILURES": Range(1.0, 1e9, unit=""),
        "HOLD_FACTOR": Range(1.0, 1e6, unit=""),
        "ACTIVE_GROWTH": Range(0.0, MAX_DURATION, open_low=True),
        "WINDOW": Range(60.0, DAY),
    },
}


@dataclass(frozen=True)
class Problem:
    """One finding about the setting: a check id suffix (``E003``), the key and a message."""

    id: str
    key: str
    message: str


@dataclass(frozen=True)
class JoblockSettings:
    """The validated ``JOBLOCK`` setting. Durations in seconds."""

    REDIS_ALIAS: str
    KEY_PREFIX: str
    LOCK_TTL: float
    HEARTBEAT_INTERVAL: float | None
    MAX_HOLD: float | None
    ACQUIRE_WAIT: float
    WAITER_TTL: float
    ON_LOCK_LOST: str
    REQUEUE_BACKOFF: dict[str, float]
    REQUEUE_MAX_WAIT: float
    IDEMPOTENCY_TTL: float
    IDEMPOTENCY_LEASE: float
    STUCK_AFTER: float
    ALERTS: dict[str, float]
    RENEW_TIMEOUT: float
    METRICS: bool
    METRICS_RETENTION: float
    METRICS_TOKEN: str | None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def heartbeat_interval(self, ttl: float) -> float:
        """Renewal interval for a lock of ``ttl`` seconds: the setting, else ``ttl / 3``.

        The setting is capped at ``ttl / 2`` so that a global ``HEARTBEAT_INTERVAL`` cannot make
        a lock with a shorter TTL expire between two renewals.
        """
        if self.HEARTBEAT_INTERVAL is not None:
            return min(self.HEARTBEAT_INTERVAL, ttl / 2)
        return ttl / 3


def _check_number(key: str, value: object, allowed: Range, *, optional: bool) -> list[Problem]:
    if value is None and optional:
        return []
    problem = allowed.problem(value)
    return [Problem("E003", key, f"JOBLOCK[{key!r}] {problem}.")] if problem else []


def _check_mapping(key: str, value: object, defaults: dict[str, float]) -> list[Problem]:
    if not isinstance(value, dict):
        return [Problem("E003", key, f"JOBLOCK[{key!r}] must be a dict, got {value!r}.")]
    found = [
        Problem(
            "E002",
            f"{key}.{sub}",
            f"Unknown key JOBLOCK[{key!r}][{sub!r}]; known: {', '.join(sorted(defaults))}.",
        )
        for sub in value
        if sub not in defaults
    ]
    for sub, sub_value in value.items():
        if sub in defaults:
            found += _check_number(
                f"{key}.{sub}", sub_value, _SUB_NUMBERS[key][sub], optional=False
            )
    return found


def problems(raw: object) -> list[Problem]:
    """Every problem with a raw ``JOBLOCK`` value, without raising. Used by the checks."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        return [Problem("E001", "JOBLOCK", f"JOBLOCK must be a dict, got {type(raw).__name__}.")]
    found: list[Problem] = [
        Problem(
            "E002",
            str(key),
            f"Unknown key JOBLOCK[{key!r}]; known keys: {', '.join(sorted(DEFAULTS))}.",
        )
        for key in raw
        if key not in DEFAULTS
    ]
    for key, allowed in _NUMBERS.items():
        if key in raw:
            found += _check_number(key, raw[key], allowed, optional=key in _OPTIONAL)
    for key in ("REDIS_ALIAS", "KEY_PREFIX"):
        value = raw.get(key, DEFAULTS[key])
        if not isinstance(value, str) or not value:
            found.append(
                Problem("E003", key, f"JOBLOCK[{key!r}] must be a non-empty string, got {value!r}.")
            )
    prefix = raw.get("KEY_PREFIX", DEFAULTS["KEY_PREFIX"])
    if isinstance(prefix, str) and prefix and not _PREFIX_RE.match(prefix):
        found.append(
            Problem(
                "E003",
                "KEY_PREFIX",
                f"JOBLOCK['KEY_PREFIX'] {prefix!r} may only use [A-Za-z0-9_.-] (at most 64).",
            )
        )
    if not isinstance(raw.get("METRICS", True), bool):
        found.append(
            Problem(
                "E003",
                "METRICS",
                f"JOBLOCK['METRICS'] must be True or False, got {raw['METRICS']!r}.",
            )
        )
    token = raw.get("METRICS_TOKEN")
    if token is not None and (not isinstance(token, str) or len(token) < 16):
        found.append(
            Problem(
                "E003",
                "METRICS_TOKEN",
                "JOBLOCK['METRICS_TOKEN'] must be None or "
                "a secret string of at least 16 characters.",
            )
        )
    on_lost = raw.get("ON_LOCK_LOST", DEFAULTS["ON_LOCK_LOST"])
    if on_lost not in ON_LOCK_LOST_CHOICES:
        found.append(
            Problem(
                "E003",
                "ON_LOCK_LOST",
                f"JOBLOCK['ON_LOCK_LOST'] must be one of {ON_LOCK_LOST_CHOICES}, got {on_lost!r}.",
            )
        )
    if "REQUEUE_BACKOFF" in raw:
        found += _check_mapping("REQUEUE_BACKOFF", raw["REQUEUE_BACKOFF"], DEFAULT_BACKOFF)
    if "ALERTS" in raw:
        found += _check_mapping("ALERTS", raw["ALERTS"], DEFAULT_ALERTS)
    if any(p.id.startswith("E") for p in found):
        return found
    merged = _merge(raw)
    ttl, interval = merged["LOCK_TTL"], merged["HEARTBEAT_INTERVAL"]
    if interval is not None and interval >= ttl:
        found.append(
            Problem(
                "E004",
                "HEARTBEAT_INTERVAL",
                f"JOBLOCK['HEARTBEAT_INTERVAL'] ({interval}s) must be shorter than "
                f"LOCK_TTL ({ttl}s), or the lock expires between renewals.",
            )
        )
    elif interval is not None and interval > ttl / 2:
        found.append(
            Problem(
                "W001",
                "HEARTBEAT_INTERVAL",
                f"JOBLOCK['HEARTBEAT_INTERVAL'] ({interval}s) is more than half of "
                f"LOCK_TTL ({ttl}s): one slow renewal loses the lock. Use TTL/3.",
            )
        )
    if merged["IDEMPOTENCY_TTL"] < merged["REQUEUE_MAX_WAIT"]:
        found.append(
            Problem(
                "W003",
                "IDEMPOTENCY_TTL",
                f"JOBLOCK['IDEMPOTENCY_TTL'] ({merged['IDEMPOTENCY_TTL']}s) is "
                f"shorter than REQUEUE_MAX_WAIT ({merged['REQUEUE_MAX_WAIT']}s): a "
                "requeued duplicate could outlive the record that blocks it.",
            )
        )
    if merged["IDEMPOTENCY_TTL"] < merged["IDEMPOTENCY_LEASE"]:
        found.append(
            Problem(
                "W005",
                "IDEMPOTENCY_TTL",
                f"JOBLOCK['IDEMPOTENCY_TTL'] ({merged['IDEMPOTENCY_TTL']}s) is shorter than "
                f"IDEMPOTENCY_LEASE ({merged['IDEMPOTENCY_LEASE']}s): a record would expire "
                "while its claim may still be running.",
            )
        )
    return found


def _merge(raw: dict[str, Any]) -> dict[str, Any]:
    merged = {**DEFAULTS, **raw}
    merged["REQUEUE_BACKOFF"] = {**DEFAULT_BACKOFF, **raw.get("REQUEUE_BACKOFF", {})}
    merged["ALERTS"] = {**DEFAULT_ALERTS, **raw.get("ALERTS", {})}
    for key in _NUMBERS:
        if merged[key] is not None:
            merged[key] = float(merged[key])
    return merged


_lock = threading.Lock()
_cached: JoblockSettings | None = None


def get() -> JoblockSettings:
    """The validated setting, built once per change of ``settings.JOBLOCK``.

    Raises :class:`JoblockConfigError` listing every error-level problem.
    """
    global _cached
    current = _cached
    if current is not None:
        return current
    with _lock:
        if _cached is None:
            raw = getattr(django_settings, "JOBLOCK", None)
            errors = [p for p in problems(raw) if p.id.startswith("E")]
            if errors:
                raise JoblockConfigError(
                    "Invalid JOBLOCK setting: "
                    + " ".join(f"[django_joblock.{p.id}] {p.message}" for p in errors)
                )
            merged = _merge(dict(raw or {}))
            _cached = JoblockSettings(**merged, raw=dict(raw or {}))
        return _cached


def reset() -> None:
    """Forget the cached setting; the next :func:`get` reads ``settings.JOBLOCK`` again."""
    global _cached
    with _lock:
        _cached = None


@receiver(setting_changed)
def _on_setting_changed(setting: str, **kwargs: Any) -> None:
    if setting == "JOBLOCK":
        reset()
