"""The kinds of value a ``JOBLOCK`` key can take, each with its check and its description.

:mod:`django_joblock.conf` declares every key with one of these rules; each rule says why a
value is refused (:meth:`problem`, empty when it is fine: the system checks' message), how
the settings reference describes what it allows (:meth:`allowed`) and how a valid value is
stored (:meth:`clean`). :class:`Range` is also what the arguments standing in for a setting
are checked with (``lock(ttl=)``...): every number finite and inside its range.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

DAY = 86400.0


def number(value: float) -> str:
    """A number as the settings reference writes it: ``604800 (7 days)``, ``0.5``."""
    text = str(int(value)) if value == int(value) else f"{value:g}"
    if value >= DAY and value % DAY == 0:
        days = int(value // DAY)
        text += f" ({days} day{'s' if days > 1 else ''})"
    return text


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

    def allowed(self) -> str:
        """The range as the settings reference writes it (``0.01 to 604800 (7 days)``)."""
        return f"{'> ' if self.open_low else ''}{number(self.low)} to {number(self.high)}"

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

    def clean(self, value: Any) -> Any:
        return float(value)


@dataclass(frozen=True)
class Text:
    """A non-empty string, optionally matching ``pattern`` (described as ``shape``)."""

    pattern: str = ""
    shape: str = ""

    def allowed(self) -> str:
        return self.shape

    def problem(self, value: object) -> str:
        if not isinstance(value, str) or not value:
            return f"must be a non-empty string, got {value!r}"
        if self.pattern and not re.fullmatch(self.pattern, value):
            return f"{value!r} may only use {self.shape}"
        return ""

    def clean(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Count:
    """A whole number from ``low`` to ``high`` (a bool or a float such as 1.5 is refused)."""

    low: int
    high: int
    unit: str = ""

    def allowed(self) -> str:
        return f"{self.low} to {self.high}"

    def problem(self, value: object) -> str:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be a whole number, got {value!r}"
        if not self.low <= value <= self.high:
            return f"must be >= {self.low} and <= {self.high} {self.unit}".rstrip() + (
                f", got {value!r}"
            )
        return ""

    def clean(self, value: Any) -> Any:
        return int(value)


@dataclass(frozen=True)
class Choice:
    values: tuple[str, ...]

    def allowed(self) -> str:
        return " or ".join(f'`"{v}"`' for v in self.values)

    def problem(self, value: object) -> str:
        return "" if value in self.values else f"must be one of {self.values}, got {value!r}"

    def clean(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Flag:
    def allowed(self) -> str:
        return "`True` or `False`"

    def problem(self, value: object) -> str:
        return "" if isinstance(value, bool) else f"must be True or False, got {value!r}"

    def clean(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Secret:
    """A secret string of at least ``length`` characters (never echoed back)."""

    length: int = 16

    def allowed(self) -> str:
        return f"a string of {self.length}+ characters"

    def problem(self, value: object) -> str:
        if isinstance(value, str) and len(value) >= self.length:
            return ""
        return f"must be None or a secret string of at least {self.length} characters"

    def clean(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class SubKey:
    """One sub-key of a dict setting (``REQUEUE_BACKOFF``, ``ALERTS``)."""

    default: float
    range: Range
    doc: str
    alert: str = ""  # ALERTS: the alert the threshold belongs to


@dataclass(frozen=True)
class Mapping:
    """A dict setting whose (optional) sub-keys are numbers; unknown sub-keys are E002."""

    keys: dict[str, SubKey]

    def defaults(self) -> dict[str, float]:
        return {name: sub.default for name, sub in self.keys.items()}

    def allowed(self) -> str:
        return "a dict, see below"

    def problem(self, value: object) -> str:
        return "" if isinstance(value, dict) else f"must be a dict, got {value!r}"

    def clean(self, value: Any) -> Any:
        return {**self.defaults(), **{k: float(v) for k, v in value.items()}}


Rule = Range | Count | Text | Choice | Flag | Secret | Mapping
