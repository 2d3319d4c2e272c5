"""The single ``JOBLOCK`` setting: one declaration per key, read lazily, reset on
``setting_changed``.

Each key is a field of :class:`JoblockSettings` with its default, rule (:mod:`.setting_rules`)
and docs; validation, the system checks and the tables of ``docs/settings.md`` come from there.
Durations are seconds. Every key is optional (one whose default is ``None`` may be set to
``None``); an unknown one (``LOCK_TLL``) is an error."""

from __future__ import annotations

import copy
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from . import setting_rules as rules
from .exceptions import JoblockConfigError
from .setting_rules import DAY, Mapping, Problem, Range, SubKey

__all__ = ["DAY", "JoblockSettings", "Problem", "Range", "get", "problems", "reset"]

DOTTED_PATH = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+"  # pkg.module.name
# Finite always: a NaN interval would silently stop renewals (NaN passes every comparison).
MAX_TTL = 7 * DAY  # longest lock TTL / lease: how long a crashed holder can block a resource
MAX_DURATION = 365 * DAY  # longest wait, hold, window or retention


def _setting(default: Any, rule: rules.Rule, doc: str) -> Any:
    """Declare one key: its default (``None``: the key may be ``None``), rule and docs."""
    meta = {"rule": rule, "doc": doc}
    if isinstance(default, dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


# The ranges of the arguments that stand in for a setting (``lock(ttl=)``...) too.
TTL_RANGE = Range(0.01, MAX_TTL)
LEASE_RANGE = Range(0.01, MAX_TTL)
WAIT_RANGE = Range(0.0, MAX_DURATION)
POSITIVE = Range(0.0, MAX_DURATION, open_low=True)
HOLD_RANGE = Range(0.0, MAX_DURATION, open_low=True)
MAX_WAIT_RANGE = Range(0.0, MAX_DURATION, open_low=True)
SHARE = Range(0.0, 1.0, open_low=True, unit="")


def _times(high: float) -> Range:
    return Range(1.0, high, unit="")


BACKOFF = Mapping(
    {
        "base": SubKey(1.0, Range(0.0, DAY, open_low=True), "ceiling of the first delay"),
        "factor": SubKey(2.0, _times(100.0), "growth of the ceiling per requeue"),
        "max": SubKey(300.0, Range(0.0, DAY, open_low=True), "largest ceiling"),
    }
)


def _count(doc: str, alert: str, default: float = 1.0) -> SubKey:
    """An alert threshold counted within ``WINDOW`` (1: any occurrence)."""
    return SubKey(default, _times(1e9), f"{doc} in `WINDOW`", alert)


ALERT_RULES = Mapping(
    {
        "CONTENTION_RATIO": SubKey(
            0.5,
            SHARE,
            "share of a family's acquires finding the lock busy in `WINDOW` (20+ attempts)",
            "contention",
        ),
        "CONTENTION_SPIKE": SubKey(
            3.0,
            _times(1000.0),
            "a family's contention in `WINDOW` is this many times that in `BASELINE` (and >= 10 %)",
            "contention_spike",
        ),
        "BASELINE": SubKey(
            3600.0,
            Range(600.0, 7 * DAY),
            "the period before `WINDOW` that `CONTENTION_SPIKE` compares with",
            "contention_spike",
        ),
        "RENEW_FAILURES": _count("failed renewals", "renew_failures", 5.0),
        "ACQUIRE_ERRORS": _count("acquires failed as Redis was unavailable", "acquire_errors"),
        "LOCKS_LOST": _count("locks lost by their holder", "locks_lost"),
        "GIVEN_UP": _count("jobs that gave up on a busy lock", "given_up"),
        "NEAR_TIMEOUT": _count(
            "runs that took `TIMEOUT_RATIO`+ of their `job_timeout`", "near_timeout"
        ),
        "TIMEOUT_RATIO": SubKey(
            0.8,
            Range(0.1, 1.0, unit=""),
            "the share of its `job_timeout` that counts a run for `near_timeout`",
            "near_timeout",
        ),
        "LONG_WAIT": SubKey(
            300.0,
            POSITIVE,
            "a family's p99 wait from enqueue to start in `WINDOW`",
            "long_wait",
        ),
        "HOLD_FACTOR": SubKey(
            10.0,
            _times(1e6),
            "a lock held this many times its family's p95 hold time (and over 5 s)",
            "long_hold",
        ),
        "ACTIVE_GROWTH": SubKey(
            1800.0,
            POSITIVE,
            "active locks grew without falling this long",
            "active_growth",
        ),
        "WINDOW": SubKey(300.0, Range(60.0, DAY), "the sliding window of the rates above"),
    }
)


@dataclass(frozen=True)
class JoblockSettings:
    """The validated ``JOBLOCK`` setting, one field per key. Durations in seconds."""

    REDIS_ALIAS: str = _setting(
        "default",
        rules.Text(),
        "the django-redis cache whose connection the locks, metrics and (without django-rq) "
        "queues use",
    )
    REDIS_CLIENT: str | None = _setting(
        None,
        rules.Text(DOTTED_PATH, "a dotted path (`pkg.module.name`)"),
        "dotted path of a no-argument callable returning the redis-py client of the locks and "
        "metrics instead of `REDIS_ALIAS`'s (Redis Cluster), see "
        "[topologies.md](topologies.md#redis-cluster)",
    )
    REPLICA_ACKS: int = _setting(
        0,
        rules.Count(0, 32, "replicas"),
        "replicas that must have a new lock before an acquire succeeds, and a heartbeat's "
        "renewal before it counts (Redis `WAIT`; 0: do not wait), see "
        "[topologies.md](topologies.md#redis-sentinel)",
    )
    REPLICA_ACK_TIMEOUT: float = _setting(
        0.5,
        Range(0.001, 60.0),
        "how long an acquire waits for `REPLICA_ACKS`; short of them it gives the lock back and "
        "raises `LockBackendUnavailable` (renewals wait at most this, and count as failed)",
    )
    KEY_PREFIX: str = _setting(
        "joblock",
        rules.Text(r"[A-Za-z0-9_.-]{1,64}", "`[A-Za-z0-9_.-]`, 1 to 64 characters"),
        "prefix of every Redis key",
    )
    LOCK_TTL: float = _setting(30.0, TTL_RANGE, "TTL of a lock given no `ttl=`")
    HEARTBEAT_INTERVAL: float | None = _setting(
        None,
        Range(0.1, MAX_TTL),  # each lock renewed at most 10 times a second
        "renewal interval; `None`: TTL / 3; at most TTL / 2 per lock; < `LOCK_TTL` (E004)",
    )
    MAX_HOLD: float | None = _setting(
        None,
        HOLD_RANGE,
        "stop renewing after this long (a hung holder keeps a lock `MAX_HOLD` + TTL); `None`: "
        "no limit, see [locks.md](locks.md#rules-process-context-restart-clock)",
    )
    ACQUIRE_WAIT: float = _setting(
        0.0,
        WAIT_RANGE,
        "default `wait` of `lock()`, inline `@locked_job` calls and synchronous queues (0: one "
        "try); a worker's job tries once, then applies `on_conflict`",
    )
    WAITER_TTL: float = _setting(
        2.0,
        Range(0.1, 3600.0),
        "how long a waiter keeps its place in line unrefreshed, and the TTL of a lock handed to "
        "it until it renews, see [locks.md](locks.md#waiting-for-a-lock)",
    )
    ON_LOCK_LOST: str = _setting(
        "abort",
        rules.Choice(("abort", "flag")),
        '`@locked_job` on a lost lock: `"abort"` raises `LockLost` in the job, `"flag"` only '
        "sets `lock.lost`",
    )
    REQUEUE_BACKOFF: dict[str, float] = _setting(  # noqa: RUF009 - a fresh dict per instance
        BACKOFF.defaults(), BACKOFF, "requeue delays on contention, see below"
    )
    REQUEUE_MAX_WAIT: float = _setting(
        3600.0,
        WAIT_RANGE,
        "a job gives up on a busy lock after this long (`LockContentionTimeout`; per job: "
        "`max_wait=`)",
    )
    IDEMPOTENCY_TTL: float = _setting(
        7 * DAY,
        Range(1.0, 10 * 365 * DAY),
        "a record expires this long after its claim or success (`joblock_purge` deletes it)",
    )
    IDEMPOTENCY_LEASE: float = _setting(
        300.0,
        LEASE_RANGE,
        "lease of a running claim; another claim waits (`IdempotencyInProgress`) until it "
        "ends, then takes over",
    )
    STUCK_AFTER: float = _setting(900.0, POSITIVE, "a lock held longer is shown as `overdue`")
    ALERTS: dict[str, float] = _setting(  # noqa: RUF009
        ALERT_RULES.defaults(), ALERT_RULES, "alert thresholds"
    )
    REDIS_TIMEOUT: float = _setting(
        2.0,
        Range(0.01, 60.0),
        "socket timeout of the locks' Redis client: a Redis that does not answer raises "
        "`LockBackendUnavailable` within it",
    )
    METRICS: bool = _setting(True, rules.Flag(), "record metrics in Redis")
    METRICS_RETENTION: float = _setting(
        DAY, Range(60.0, MAX_DURATION), "how long per-minute metric buckets are kept"
    )
    METRICS_TOKEN: str | None = _setting(
        None, rules.Secret(), "bearer token of the Prometheus view; `None`: staff users only"
    )
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def heartbeat_interval(self, ttl: float) -> float:
        """Renewal interval of a ``ttl``-second lock: the setting capped at ``ttl / 2`` (a global
        value must not let a shorter-lived lock expire between renewals), else ``ttl / 3``."""
        if self.HEARTBEAT_INTERVAL is not None:
            return min(self.HEARTBEAT_INTERVAL, ttl / 2)
        return ttl / 3


KEYS = {f.name: f for f in dataclasses.fields(JoblockSettings) if f.name != "raw"}


def default_of(key: str) -> Any:
    """The default of ``key`` (a fresh copy for the dict settings)."""
    declared = KEYS[key]
    if declared.default_factory is not dataclasses.MISSING:
        return declared.default_factory()
    return declared.default


DEFAULTS: dict[str, Any] = {key: default_of(key) for key in KEYS}
RENAMED = {"RENEW_TIMEOUT": "REDIS_TIMEOUT"}  # old key -> its name now (E002 says so)


def _value_problems(key: str, value: object) -> list[Problem]:
    rule = KEYS[key].metadata["rule"]
    if value is None and DEFAULTS[key] is None:
        return []
    if problem := rule.problem(value):
        return [Problem("E003", f"JOBLOCK[{key!r}] {problem}.")]
    if not isinstance(rule, Mapping):
        return []
    assert isinstance(value, dict)
    found = []
    for sub, sub_value in value.items():
        where = f"JOBLOCK[{key!r}][{sub!r}]"
        if sub not in rule.keys:
            known = ", ".join(sorted(rule.keys))
            found.append(Problem("E002", f"Unknown key {where}; known: {known}."))
        elif problem := rule.keys[sub].range.problem(sub_value):
            found.append(Problem("E003", f"{where} {problem}."))
    return found


def problems(raw: object) -> list[Problem]:
    """Every problem with a raw ``JOBLOCK`` value, without raising. Used by the checks."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        return [Problem("E001", f"JOBLOCK must be a dict, got {type(raw).__name__}.")]
    found = []
    for key, value in raw.items():
        if key in KEYS:
            found += _value_problems(key, value)
        else:
            renamed = f" (renamed {RENAMED[key]!r})" if key in RENAMED else ""
            known = ", ".join(sorted(KEYS))
            found.append(Problem("E002", f"Unknown key JOBLOCK[{key!r}]{renamed}; known: {known}."))
    errors = any(p.id.startswith("E") for p in found)
    return found if errors else found + rules.between_keys(_merge(raw))


def _merge(raw: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with the (valid) raw values, cleaned (numbers as floats)."""
    merged = dict(DEFAULTS)
    for key, value in raw.items():
        merged[key] = None if value is None else KEYS[key].metadata["rule"].clean(value)
    return merged


_lock = threading.Lock()
_cached: JoblockSettings | None = None


def get() -> JoblockSettings:
    """The validated setting, built once per change of ``settings.JOBLOCK``; raises
    :class:`JoblockConfigError` naming every error-level problem (never half-applied)."""
    global _cached
    current = _cached
    if current is not None:
        return current
    with _lock:
        if _cached is None:
            raw = getattr(django_settings, "JOBLOCK", None)
            if errors := [p for p in problems(raw) if p.id.startswith("E")]:
                found = " ".join(f"[django_joblock.{p.id}] {p.message}" for p in errors)
                raise JoblockConfigError(f"Invalid JOBLOCK setting: {found}")
            _cached = JoblockSettings(**_merge(dict(raw or {})), raw=dict(raw or {}))
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
