"""Processes that race each other, for the multi-process tests.

``python -m tests.racers MODE ARGS`` is one racer (the functions below are their bodies); each
waits for the ``go`` key so that all start racing at the same moment. In the test process,
:func:`start` starts one and :func:`run_all` starts many, sends ``go`` once all are ready and
returns their outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import django

from tests.harness import ROOT, child_env


def start(*args: str) -> subprocess.Popen[str]:
    """Start ``python -m tests.racers ARGS`` on the test settings and test database."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.racers", *args],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_all(client: Any, commands: list[tuple[str, ...]], timeout: float = 120) -> list[str]:
    """Start every racer, wait until all are ready, send ``go``; their stdouts (all exit 0)."""
    procs = [start(*cmd) for cmd in commands]
    deadline = time.monotonic() + timeout
    while int(client.get("test:ready") or 0) < len(procs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    client.set("test:go", 1)
    failures, outputs = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        outputs.append(out)
        if proc.returncode != 0:
            failures.append(f"exit {proc.returncode}: {err[-2000:]}")
    assert not failures, "\n".join(failures)
    return outputs


def _wait_for_go(client) -> None:  # type: ignore[no-untyped-def]
    client.incr("test:ready")
    deadline = time.monotonic() + 60
    while not client.exists("test:go"):
        if time.monotonic() > deadline:
            raise SystemExit("never got the go signal")
        time.sleep(0.005)


def fence_race(rounds: int) -> None:
    """Acquire one resource ``rounds`` times; log (acquisition order, fence) for each hold."""
    from django_redis import get_redis_connection

    from django_joblock import lock

    client = get_redis_connection("default")
    _wait_for_go(client)
    for _ in range(rounds):
        with lock("race:1", ttl=10, wait=60) as held:
            order = client.incr("test:order")
            client.rpush("test:fences", f"{order}:{held.fence}:{os.getpid()}")


def increment(rounds: int, use_lock: bool) -> None:
    """Racy read-sleep-write increments of one counter, with or without the lock."""
    from django_redis import get_redis_connection

    from django_joblock import lock

    client = get_redis_connection("default")
    _wait_for_go(client)
    for _ in range(rounds):
        if use_lock:
            with lock("counter:1", ttl=10, wait=60):
                _racy_increment(client)
        else:
            _racy_increment(client)


def _racy_increment(client) -> None:  # type: ignore[no-untyped-def]
    value = int(client.get("test:counter") or 0)
    time.sleep(0.002)  # widen the window between read and write
    client.set("test:counter", value + 1)


def claim(key: str, hold: float) -> None:
    """Claim ``key``; print ``ran`` / ``replay`` / ``in_progress``."""
    from django_redis import get_redis_connection

    from django_joblock import IdempotencyInProgress, idempotent

    client = get_redis_connection("default")
    _wait_for_go(client)
    try:
        with idempotent(key) as claimed:
            if claimed.done:
                print("replay", flush=True)
                return
            client.incr("test:effects")
            time.sleep(hold)
            claimed.succeed({"pid": os.getpid()})
            print("ran", flush=True)
    except IdempotencyInProgress:
        print("in_progress", flush=True)


def claim_and_hang(key: str, lease: float) -> None:
    """Claim ``key`` with a short lease, say so on stdout, then hang until killed."""
    from django_joblock import idempotent

    with idempotent(key, lease=lease):
        print("claimed", flush=True)
        time.sleep(600)


# mode -> the body, called with the command line's strings
MODES: dict[str, Callable[..., None]] = {
    "fence_race": lambda rounds: fence_race(int(rounds)),
    "increment": lambda rounds, how: increment(int(rounds), how == "lock"),
    "claim": lambda key, hold: claim(key, float(hold)),
    "claim_and_hang": lambda key, lease: claim_and_hang(key, float(lease)),
}

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    mode, *args = sys.argv[1:]
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}")
    MODES[mode](*args)
