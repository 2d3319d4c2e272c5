"""Exponential backoff with full jitter (AWS architecture blog, "Exponential Backoff And Jitter"):
a delay uniform in ``[0, min(max_delay, base * factor**attempt)]`` spreads contenders out
instead of retrying in lock-step, as a fixed rate or plain exponential delay does."""

from __future__ import annotations

import random

_rng = random.SystemRandom()


def ceiling(attempt: int, *, base: float, factor: float, max_delay: float) -> float:
    """The largest delay (seconds) allowed for ``attempt`` (0-based)."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    # Avoid float overflow for a large attempt count: once past max_delay, stay there.
    return float(min(max_delay, base * factor ** min(attempt, 64)))


def full_jitter(attempt: int, *, base: float, factor: float, max_delay: float) -> float:
    """A random delay in seconds for ``attempt`` (0-based): uniform in ``[0, ceiling]``."""
    return _rng.uniform(0.0, ceiling(attempt, base=base, factor=factor, max_delay=max_delay))
