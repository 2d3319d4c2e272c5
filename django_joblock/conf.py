"""The single ``JOBLOCK`` setting: one declaration per key, read lazily, reset on
``setting_changed``.

Each key is declared once, as a field of :class:`JoblockSettings` made with :func:`_setting`:
its default, the rule its value must follow (:mod:`django_joblock.setting_rules`) and its
documentation. Defaults, validation (and the ids of the system checks built on it) and the
reference tables of ``docs/settings.md`` (:mod:`django_joblock.settings_reference`) all come
from those declarations.

All durations are in seconds (floats allowed). Every key is optional; unknown keys are an error
(system check ``django_joblock.E002``) because a typo such as ``LOCK_TLL`` would otherwise be
silently ignored and the default used.

``get()`` returns a frozen :class:`JoblockSettings`. It validates on first use and raises
:class:`~django_joblock.exceptions.JoblockConfigError` naming the bad key, so a broken setting is
never half-applied; ``problems()`` returns the same findings for the system checks.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .exceptions import JoblockConfigError
from .setting_rules import (
    DAY,
    Choice,
    Count,
    Flag,
    Mapping,
    Range,
    Rule,
    Secret,
    SubKey,
    Text,
)

__all__ = ["DAY", "JoblockSettings", "Problem", "Range", "get", "problems", "reset"]

# Finite always: NaN passes every comparison, so a NaN interval would silently stop renewals,
# and an infinite or absurd TTL cannot be sent to Redis.
MAX_TTL = 7 * DAY  # longest lock TTL / lease: how long a crashed holder can block a resource
MAX_DURATION = 365 * DAY  # longest wait, hold, window or retention


def _setting(default: Any, rule: Rule, doc: str, *, optional: bool = False) -> Any:
    """Declare one key: its default, its rule (None allowed with ``optional``) and its docs."""
    meta = {"rule": rule, "doc": doc, "optional": optional}
    if isinstance(default, dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


TTL_RANGE = Range(0.01, MAX_TTL)
WAIT_RANGE = Range(0.0, MAX_DURATION)
HOLD_RANGE = Range(0.0, MAX_DURATION, open_low=True)
MAX_WAIT_RANGE = Range(0.0, MAX_DURATION, open_low=True)
LEASE_RANGE = Range(0.01, MAX_TTL)
WAITER_TTL_RANGE = Range(0.1, 3600.0)
ON_LOCK_LOST_CHOICES = ("abort", "flag")

BACKOFF = Mapping(
    {
        "base": SubKey(1.0, Range(0.0, DAY, open_low=True), "ceiling of the first delay"),
        "factor": SubKey(2.0, Range(1.0, 100.0, unit=""), "growth of the ceiling per requeue"),
        "max": SubKey(300.0, Range(0.0, DAY, open_low=True), "largest ceiling"),
    }
)
COUNT_RANGE = Range(1.0, 1e9, unit="")


def _count_rule(doc: str, alert: str) -> SubKey:
    """An alert threshold that is a count within ``WINDOW`` (default 1: any occurrence)."""
    return SubKey(1.0, COUNT_RANGE, doc, alert=alert)


ALERT_RULES = Mapping(
    {
        "CONTENTION_RATIO": SubKey(
            0.5,
            Range(0.0, 1.0, open_low=True, unit=""),
            "fraction of a family's acquire attempts that found the lock busy over `WINDOW` "
            "(needs 20+ attempts)",
            alert="contention",
        ),
        "CONTENTION_SPIKE": SubKey(
            3.0,
            Range(1.0, 1000.0, unit=""),
            "a family's contention over `WINDOW` is this many times its contention over the "
            "`BASELINE` before (and at least 10 %; 20+ attempts in each)",
            alert="contention_spike",
        ),
        "BASELINE": SubKey(
            3600.0,
            Range(600.0, 7 * DAY),
            "the period before `WINDOW` that `CONTENTION_SPIKE` compares with (seconds; "
            "longer than `WINDOW`, within `METRICS_RETENTION`)",
            alert="contention_spike",
        ),
        "RENEW_FAILURES": SubKey(
            5.0, COUNT_RANGE, "failed renewals within `WINDOW`", "renew_failures"
        ),
        "ACQUIRE_ERRORS": _count_rule(
            "acquires that failed because Redis was unavailable, within `WINDOW`", "acquire_errors"
        ),
        "LOCKS_LOST": _count_rule(
            "locks lost by their holder (expired, taken over, renewals failed) within `WINDOW`",
            "locks_lost",
        ),
        "GIVEN_UP": _count_rule(
            "jobs that gave up on a busy lock (`LockContentionTimeout`) within `WINDOW`", "given_up"
        ),
        "NEAR_TIMEOUT": _count_rule(
            "job runs within `WINDOW` that took `TIMEOUT_RATIO` or more of their RQ `job_timeout`",
            "near_timeout",
        ),
        "TIMEOUT_RATIO": SubKey(
            0.8,
            Range(0.1, 1.0, unit=""),
            "the share of its `job_timeout` that makes a run count for `near_timeout`",
            alert="near_timeout",
        ),
        "LONG_WAIT": SubKey(
            300.0,
            Range(0.0, MAX_DURATION, open_low=True),
            "a family's p99 wait from enqueue to start within `WINDOW` (seconds)",
            alert="long_wait",
        ),
        "HOLD_FACTOR": SubKey(
            10.0,
            Range(1.0, 1e6, unit=""),
            "a lock held this many times its family's p95 hold time (and over 5 s)",
            alert="long_hold",
        ),
        "ACTIVE_GROWTH": SubKey(
            1800.0,
            Range(0.0, MAX_DURATION, open_low=True),
            "active locks grew without falling for this many seconds",
            alert="active_growth",
        ),
        "WINDOW": SubKey(
            300.0, Range(60.0, DAY), "the sliding window of the rates above (seconds)"
        ),
    }
)


@dataclass(frozen=True)
class JoblockSettings:
    """The validated ``JOBLOCK`` setting, one field per key. Durations in seconds."""

    REDIS_ALIAS: str = _setting(
        "default",
        Text(),
        "the django-redis cache whose connection the locks, metrics and (without django-rq) "
        "the queues use",
    )
    REDIS_CLIENT: str | None = _setting(
        None,
        Text(
            r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+",
            "a dotted path (`pkg.module.name`)",
        ),
        "dotted path of a callable taking no arguments that returns the redis-py client of the "
        "locks and metrics, in place of the `REDIS_ALIAS` cache's connection: the way to put "
        "the locks on Redis Cluster (a `redis.cluster.RedisCluster`). Queues then come from "
        "django-rq's `RQ_QUEUES` (RQ does not run on Cluster); see "
        "[topologies.md](topologies.md#redis-cluster)",
        optional=True,
    )
    REPLICA_ACKS: int = _setting(
        0,
        Count(0, 32, "replicas"),
        "replicas that must have a new lock before an acquire succeeds (Redis `WAIT`); 0 = do "
        "not wait. Narrows the window in which a Sentinel failover forgets a lock; see "
        "[topologies.md](topologies.md#redis-sentinel)",
    )
    REPLICA_ACK_TIMEOUT: float = _setting(
        0.5,
        Range(0.001, 60.0),
        "how long an acquire waits for `REPLICA_ACKS` replicas; when fewer acknowledge, the "
        "lock is given back and the acquire raises `LockBackendUnavailable`",
    )
    KEY_PREFIX: str = _setting(
        "joblock",
        Text(r"[A-Za-z0-9_.-]{1,64}", "`[A-Za-z0-9_.-]`, 1 to 64 characters"),
        "prefix of every Redis key",
    )
    LOCK_TTL: float = _setting(
        30.0,
        TTL_RANGE,
        "TTL of a lock when `lock(ttl=...)` / `@locked_job(ttl=...)` is not given",
    )
    HEARTBEAT_INTERVAL: float | None = _setting(
        None,
        Range(0.001, MAX_TTL),
        "renewal interval; `None` = TTL / 3; a value is capped at TTL / 2 per lock; must be "
        "< `LOCK_TTL` (E004)",
        optional=True,
    )
    MAX_HOLD: float | None = _setting(
        None,
        HOLD_RANGE,
        "stop renewing a lock after this long (a hung holder cannot keep it forever; "
        "`renew()` stops too, so a lock is held at most `MAX_HOLD` + TTL); `None` = no limit, "
        "because RQ's `job_timeout` already bounds a hung job (see "
        "[locks.md](locks.md#rules-process-context-restart-clock))",
        optional=True,
    )
    ACQUIRE_WAIT: float = _setting(
        0.0,
        WAIT_RANGE,
        "default `wait` of `lock()`, of inline `@locked_job` calls and of jobs on a "
        "synchronous queue (`is_async=False`); 0 = one try. Jobs run by a worker try once (a "
        "parked job handed the resource waits up to 0.5 s for the job before it to let go), "
        "then apply `on_conflict`",
    )
    WAITER_TTL: float = _setting(
        2.0,
        WAITER_TTL_RANGE,
        "how long a waiting acquire keeps its place in line without a sign of life (it "
        "refreshes its ticket every quarter of this, at most every second), and the TTL a lock "
        "is handed over to a waiter with until the waiter renews it: a waiter that dies delays "
        "the line by at most this long. Longer tolerates longer pauses (GC, an overloaded "
        "host) before a waiter loses its place; see [locks.md](locks.md#waiting-for-a-lock)",
    )
    ON_LOCK_LOST: str = _setting(
        "abort",
        Choice(ON_LOCK_LOST_CHOICES),
        'what `@locked_job` does when the lock is lost mid-job: `"abort"` raises `LockLost` '
        'in the job; `"flag"` only sets `lock.lost`',
    )
    # _setting returns a dataclasses.field with a default_factory (a fresh dict per instance).
    REQUEUE_BACKOFF: dict[str, float] = _setting(  # noqa: RUF009
        BACKOFF.defaults(), BACKOFF, "requeue delays on contention, see below"
    )
    REQUEUE_MAX_WAIT: float = _setting(
        3600.0,
        WAIT_RANGE,
        "give up on a busy lock after this long: the job fails with `LockContentionTimeout` "
        "(per job: `max_wait=`, > 0)",
    )
    IDEMPOTENCY_TTL: float = _setting(
        7 * DAY,
        Range(1.0, 10 * 365 * DAY),
        "a record expires this long after it was claimed, or after its success; "
        "`joblock_purge` deletes expired ones",
    )
    IDEMPOTENCY_LEASE: float = _setting(
        300.0,
        LEASE_RANGE,
        "lease of a running claim; another claim waits (`IdempotencyInProgress`) until it "
        "ends, then takes over",
    )
    STUCK_AFTER: float = _setting(
        900.0,
        Range(0.0, MAX_DURATION, open_low=True),
        "a lock held longer than this is shown as `overdue` (dashboard, `joblock_locks --stuck`)",
    )
    ALERTS: dict[str, float] = _setting(  # noqa: RUF009
        ALERT_RULES.defaults(), ALERT_RULES, "alert thresholds"
    )
    REDIS_TIMEOUT: float = _setting(
        2.0,
        Range(0.01, 60.0),
        "socket timeout of every lock, renewal and operator command (the locks' own Redis "
        "client; a renewal's stays below TTL / 5 too): a Redis that does not answer raises "
        "`LockBackendUnavailable` within it",
    )
    METRICS: bool = _setting(True, Flag(), "record metrics in Redis (`False` turns it off)")
    # Buckets are a minute long and expire after the retention (EXPIRE takes whole seconds).
    METRICS_RETENTION: float = _setting(
        DAY, Range(60.0, MAX_DURATION), "how long per-minute metric buckets are kept"
    )
    METRICS_TOKEN: str | None = _setting(
        None,
        Secret(),
        "bearer token for the Prometheus view; `None`: staff users only",
        optional=True,
    )
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def heartbeat_interval(self, ttl: float) -> float:
        """Renewal interval for a lock of ``ttl`` seconds: the setting, else ``ttl / 3``.

        The setting is capped at ``ttl / 2`` so that a global ``HEARTBEAT_INTERVAL`` cannot make
        a lock with a shorter TTL expire between two renewals.
        """
        if self.HEARTBEAT_INTERVAL is not None:
            return min(self.HEARTBEAT_INTERVAL, ttl / 2)
        return ttl / 3


# Every key's declaration (a dataclasses.Field: default, metadata "rule", "doc", "optional").
KEYS = {f.name: f for f in dataclasses.fields(JoblockSettings) if f.name != "raw"}


def default_of(key: str) -> Any:
    """The default of ``key`` (a fresh copy for the dict settings)."""
    declared = KEYS[key]
    if declared.default_factory is not dataclasses.MISSING:
        return declared.default_factory()
    return declared.default


DEFAULTS: dict[str, Any] = {key: default_of(key) for key in KEYS}
RENAMED = {"RENEW_TIMEOUT": "REDIS_TIMEOUT"}  # old key -> its name now (E002 says so)


@dataclass(frozen=True)
class Problem:
    """One finding about the setting: a check id suffix (``E003``), the key and a message."""

    id: str
    key: str
    message: str


def _value_problems(key: str, value: object) -> list[Problem]:
    declared = KEYS[key]
    rule: Rule = declared.metadata["rule"]
    if value is None and declared.metadata["optional"]:
        return []
    problem = rule.problem(value)
    if problem:
        return [Problem("E003", key, f"JOBLOCK[{key!r}] {problem}.")]
    if not isinstance(rule, Mapping):
        return []
    assert isinstance(value, dict)
    found = []
    for sub, sub_value in value.items():
        if sub not in rule.keys:
            found.append(
                Problem(
                    "E002",
                    f"{key}.{sub}",
                    f"Unknown key JOBLOCK[{key!r}][{sub!r}]; known: "
                    f"{', '.join(sorted(rule.keys))}.",
                )
            )
            continue
        problem = rule.keys[sub].range.problem(sub_value)
        if problem:
            found.append(Problem("E003", f"{key}.{sub}", f"JOBLOCK[{key!r}][{sub!r}] {problem}."))
    return found


def _heartbeat(merged: dict[str, Any]) -> list[Problem]:
    ttl, interval = merged["LOCK_TTL"], merged["HEARTBEAT_INTERVAL"]
    if interval is not None and interval >= ttl:
        return [
            Problem(
                "E004",
                "HEARTBEAT_INTERVAL",
                f"JOBLOCK['HEARTBEAT_INTERVAL'] ({interval}s) must be shorter than "
                f"LOCK_TTL ({ttl}s), or the lock expires between renewals.",
            )
        ]
    if interval is not None and interval > ttl / 2:
        return [
            Problem(
                "W001",
                "HEARTBEAT_INTERVAL",
                f"JOBLOCK['HEARTBEAT_INTERVAL'] ({interval}s) is more than half of "
                f"LOCK_TTL ({ttl}s): one slow renewal loses the lock. Use TTL/3.",
            )
        ]
    return []


def _idempotency_ttl(merged: dict[str, Any]) -> list[Problem]:
    found = []
    ttl = merged["IDEMPOTENCY_TTL"]
    if ttl < merged["REQUEUE_MAX_WAIT"]:
        found.append(
            Problem(
                "W003",
                "IDEMPOTENCY_TTL",
                f"JOBLOCK['IDEMPOTENCY_TTL'] ({ttl}s) is shorter than REQUEUE_MAX_WAIT "
                f"({merged['REQUEUE_MAX_WAIT']}s): a requeued duplicate could outlive the "
                "record that blocks it.",
            )
        )
    if ttl < merged["IDEMPOTENCY_LEASE"]:
        found.append(
            Problem(
                "W005",
                "IDEMPOTENCY_TTL",
                f"JOBLOCK['IDEMPOTENCY_TTL'] ({ttl}s) is shorter than IDEMPOTENCY_LEASE "
                f"({merged['IDEMPOTENCY_LEASE']}s): a record would expire while its claim may "
                "still be running.",
            )
        )
    return found


def _alert_periods(merged: dict[str, Any]) -> list[Problem]:
    alerts, kept = merged["ALERTS"], merged["METRICS_RETENTION"]
    window, baseline = alerts["WINDOW"], alerts["BASELINE"]
    found = []
    if baseline <= window:
        found.append(
            Problem(
                "W013",
                "ALERTS.BASELINE",
                f"JOBLOCK['ALERTS']['BASELINE'] ({baseline:g}s) is not longer than "
                f"JOBLOCK['ALERTS']['WINDOW'] ({window:g}s): the contention_spike alert "
                "compares the window with a longer period before it, and never fires.",
            )
        )
    # The spike reads the baseline before the window and the bucket in between.
    needed = window + baseline + 60
    if needed > kept:
        found.append(
            Problem(
                "W014",
                "METRICS_RETENTION",
                f"JOBLOCK['METRICS_RETENTION'] ({kept:g}s) is shorter than the alerts read "
                f"back (ALERTS WINDOW {window:g}s + BASELINE {baseline:g}s + one 60 s bucket "
                f"= {needed:g}s): the older metrics are gone, so the alerts see less than "
                "their window and contention_spike compares with a cut-short baseline.",
            )
        )
    return found


# Checks between keys, run once every key on its own is valid.
_CROSS_CHECKS: tuple[Callable[[dict[str, Any]], list[Problem]], ...] = (
    _heartbeat,
    _idempotency_ttl,
    _alert_periods,
)


def problems(raw: object) -> list[Problem]:
    """Every problem with a raw ``JOBLOCK`` value, without raising. Used by the checks."""
    if raw is None:
        return []
    if not isinstance(raw, dict):
        return [Problem("E001", "JOBLOCK", f"JOBLOCK must be a dict, got {type(raw).__name__}.")]
    found = [
        Problem(
            "E002",
            str(key),
            f"Unknown key JOBLOCK[{key!r}]"
            + (f" (renamed {RENAMED[key]!r})" if key in RENAMED else "")
            + f"; known keys: {', '.join(sorted(KEYS))}.",
        )
        for key in raw
        if key not in KEYS
    ]
    for key in KEYS:
        if key in raw:
            found += _value_problems(key, raw[key])
    if any(p.id.startswith("E") for p in found):
        return found
    merged = _merge(raw)
    for cross in _CROSS_CHECKS:
        found += cross(merged)
    return found


def _merge(raw: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with the (valid) raw values, cleaned (numbers as floats)."""
    merged = dict(DEFAULTS)
    for key, value in raw.items():
        rule: Rule = KEYS[key].metadata["rule"]
        merged[key] = None if value is None else rule.clean(value)
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
