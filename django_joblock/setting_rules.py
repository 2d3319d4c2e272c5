"""The kinds of value a ``JOBLOCK`` key can take, and the rules between keys.

:mod:`django_joblock.conf` declares every key with a rule: :meth:`~Rule.problem` says why a value is
refused ("" if fine), :meth:`~Rule.allowed` how the settings reference describes what it allows,
:meth:`~Rule.clean` how a valid value is stored. :class:`Range` also checks the arguments standing
in for a setting (``lock(ttl=)``...): finite and in range."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

DAY = 86400.0
SHOWN = 80  # characters of a refused value that its message shows


def shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to :data:`SHOWN` characters: a refused value
    may be anything, a megabyte string or an int too long for Python to write (over 4300
    digits: ``repr`` raises ``ValueError``), which is named by its size."""
    if isinstance(value, int) and value.bit_length() > 1024:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    if len(text) > SHOWN:
        return text[: SHOWN - 1] + "…"
    return text


def number(value: float) -> str:
    """A number as the settings reference writes it: ``604800 (7 days)``, ``0.5``."""
    text = str(int(value)) if value == int(value) else f"{value:g}"
    if value >= DAY and value % DAY == 0:
        days = int(value // DAY)
        return f"{text} ({days} day{'s' if days > 1 else ''})"
    return text


class Rule:
    """What every rule does: by default any value is stored as given."""

    def allowed(self) -> str:
        return ""

    def problem(self, value: object) -> str:
        raise NotImplementedError

    def clean(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Range(Rule):
    """Allowed values of one number: from ``low`` (excluded if ``open_low``) to ``high``."""

    low: float
    high: float
    open_low: bool = False
    unit: str = "seconds"

    def allowed(self) -> str:
        return f"{'> ' if self.open_low else ''}{number(self.low)} to {number(self.high)}"

    def problem(self, value: object) -> str:
        kind = f"number of {self.unit}" if self.unit else "number"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a {kind}, got {shown(value)}"
        # Only floats can be NaN or infinite (math.isfinite would overflow on a huge int).
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite {kind}, got {shown(value)}"
        if value < self.low or (self.open_low and value == self.low) or value > self.high:
            low = f"{'>' if self.open_low else '>='} {self.low:g}"
            bounds = f"{low} and <= {self.high:g} {self.unit}".rstrip()
            return f"must be {bounds}, got {shown(value)}"
        return ""

    def check(self, what: str, value: object) -> float:
        """``value`` as a float, or ``ValueError`` naming ``what`` and the allowed range."""
        if problem := self.problem(value):
            raise ValueError(f"{what} {problem}.")
        assert isinstance(value, (int, float))
        return float(value)

    def clean(self, value: Any) -> Any:
        return float(value)


@dataclass(frozen=True)
class Text(Rule):
    """A non-empty string, optionally matching ``pattern`` (described as ``shape``)."""

    pattern: str = ""
    shape: str = ""

    def allowed(self) -> str:
        return self.shape

    def problem(self, value: object) -> str:
        if not isinstance(value, str) or not value:
            return f"must be a non-empty string, got {shown(value)}"
        if self.pattern and not re.fullmatch(self.pattern, value):
            return f"{shown(value)} may only use {self.shape}"
        return ""


@dataclass(frozen=True)
class Count(Rule):
    """A whole number from ``low`` to ``high`` (a bool or a float such as 1.5 is refused)."""

    low: int
    high: int
    unit: str = ""

    def allowed(self) -> str:
        return f"{self.low} to {self.high}"

    def problem(self, value: object) -> str:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be a whole number, got {shown(value)}"
        if not self.low <= value <= self.high:
            bounds = f">= {self.low} and <= {self.high} {self.unit}".rstrip()
            return f"must be {bounds}, got {shown(value)}"
        return ""

    def clean(self, value: Any) -> Any:
        return int(value)


@dataclass(frozen=True)
class Choice(Rule):
    values: tuple[str, ...]

    def problem(self, value: object) -> str:
        return "" if value in self.values else f"must be one of {self.values}, got {shown(value)}"


class Flag(Rule):
    def problem(self, value: object) -> str:
        return "" if isinstance(value, bool) else f"must be True or False, got {shown(value)}"


@dataclass(frozen=True)
class Secret(Rule):
    """A secret string of at least ``length`` characters (never echoed back)."""

    length: int = 16

    def allowed(self) -> str:
        return f"a string of {self.length}+ characters"

    def problem(self, value: object) -> str:
        ok = isinstance(value, str) and len(value) >= self.length
        return "" if ok else f"must be None or a secret string of at least {self.length} characters"


@dataclass(frozen=True)
class SubKey:
    """One sub-key of a dict setting (``REQUEUE_BACKOFF``, ``ALERTS``)."""

    default: float
    range: Range
    doc: str
    alert: str = ""  # ALERTS: the alert the threshold belongs to


@dataclass(frozen=True)
class Mapping(Rule):
    """A dict setting whose (optional) sub-keys are numbers; unknown sub-keys are E002."""

    keys: dict[str, SubKey]

    def defaults(self) -> dict[str, float]:
        return {name: sub.default for name, sub in self.keys.items()}

    def problem(self, value: object) -> str:
        return "" if isinstance(value, dict) else f"must be a dict, got {shown(value)}"

    def clean(self, value: Any) -> Any:
        return {**self.defaults(), **{k: float(v) for k, v in value.items()}}


@dataclass(frozen=True)
class Problem:
    """One finding about the setting: a check id suffix (``E003``) and its message."""

    id: str
    message: str


def between_keys(merged: dict[str, Any]) -> list[Problem]:
    """The problems between the keys of a ``merged`` setting whose every key is valid."""
    ttl = merged["LOCK_TTL"]
    beat = merged["HEARTBEAT_INTERVAL"]
    keep = merged["IDEMPOTENCY_TTL"]
    wait = merged["REQUEUE_MAX_WAIT"]
    lease = merged["IDEMPOTENCY_LEASE"]
    kept = merged["METRICS_RETENTION"]
    window = merged["ALERTS"]["WINDOW"]
    baseline = merged["ALERTS"]["BASELINE"]
    needed = window + baseline + 60  # the spike also reads the bucket between the two
    acks, ack_wait, socket = (
        merged[k] for k in ("REPLICA_ACKS", "REPLICA_ACK_TIMEOUT", "REDIS_TIMEOUT")
    )
    beat_is = f"JOBLOCK['HEARTBEAT_INTERVAL'] ({beat}s)"
    keep_is = f"JOBLOCK['IDEMPOTENCY_TTL'] ({keep}s) is shorter than"
    findings = [
        (
            "E004",
            beat is not None and beat >= ttl,
            f"{beat_is} must be shorter than LOCK_TTL ({ttl}s), "
            "or the lock expires between renewals.",
        ),
        (
            "W001",
            beat is not None and ttl / 2 < beat < ttl,
            f"{beat_is} is more than half of LOCK_TTL ({ttl}s): "
            "one slow renewal loses the lock. Use TTL/3.",
        ),
        (
            "W003",
            keep < wait,
            f"{keep_is} REQUEUE_MAX_WAIT ({wait}s): "
            "a requeued duplicate could outlive the record that blocks it.",
        ),
        (
            "W005",
            keep < lease,
            f"{keep_is} IDEMPOTENCY_LEASE ({lease}s): "
            "a record would expire while its claim may still run.",
        ),
        (
            "W013",
            baseline <= window,
            f"JOBLOCK['ALERTS']['BASELINE'] ({baseline:g}s) is not longer than "
            f"WINDOW ({window:g}s): the contention_spike alert never fires.",
        ),
        (
            "W014",
            needed > kept,
            f"JOBLOCK['METRICS_RETENTION'] ({kept:g}s) is shorter than the alerts read back "
            f"(ALERTS WINDOW {window:g}s + BASELINE {baseline:g}s + 60 s = {needed:g}s): "
            "they would see less than their window.",
        ),
        (
            "W017",
            acks > 0 and ack_wait >= socket,
            f"JOBLOCK['REPLICA_ACK_TIMEOUT'] ({ack_wait:g}s) is not shorter than REDIS_TIMEOUT "
            f"({socket:g}s): an acquire's WAIT for REPLICA_ACKS outlasts the socket timeout, so "
            "replicas that lag end it with a socket timeout (and a reconnect) instead of the "
            "shortfall.",
        ),
    ]
    return [Problem(id_, message) for id_, bad, message in findings if bad]
