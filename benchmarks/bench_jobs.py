"""No-op jobs for benchmarks/jobs.py (RQ refuses functions defined in ``__main__``)."""

from __future__ import annotations

from django_joblock import locked_job


def plain(i: int) -> int:
    return i


@locked_job("bench", lock="bench:{i}")
def lock_only(i: int) -> int:
    return i


@locked_job("bench", lock="bench:{i}", idempotency_key="bench:{run}:{i}")
def lock_and_idempotency(i: int, run: str) -> int:
    return i
