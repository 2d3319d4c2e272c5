"""Exponential backoff with full jitter (AWS architecture blog, "Exponential Backoff And Jitter").

Full jitter draws the delay uniformly from ``[0, min(cap, base * factor**attempt)]``: contenders
spread out instead of retrying in lock-step, which a fixed rate or plain exponential delay does.
"""

from __future__ import annotations

import random

_rng = random.SystemRandom()


def ceiling(attempt: int, *, base: float, factor: float, cap: float) -> float:
    """The largest delay (seconds) allowed for ``attempt`` (0-based)."""
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    # Avoid float overflow for a large attempt count: once past the cap, stay there.
    exponent = min(attempt, 64)
    return float(min(cap, base * factor**exponent))


def full_jitter(attempt: int, *, base: float, factor: float, cap: float) -> float:
    """A random delay in seconds for ``attempt`` (0-based): uniform in ``[0, ceiling]``."""
    return _rng.uniform(0.0, ceiling(attempt, base=base, factor=factor, cap=cap))
