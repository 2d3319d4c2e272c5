"""Child-process bodies for multi-process tests: ``python -m tests.procs MODE ARGS``.

Each child waits for the ``go`` key so that all start racing at the same moment.
"""

from __future__ import annotations

import os
import sys
import time

import django


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


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    mode, *args = sys.argv[1:]
    if mode == "fence_race":
        fence_race(int(args[0]))
    elif mode == "increment":
        increment(int(args[0]), args[1] == "lock")
    elif mode == "claim":
        claim(args[0], float(args[1]))
    elif mode == "claim_and_hang":
        claim_and_hang(args[0], float(args[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
