"""A short, real walkthrough of the lock core against your Redis.

Run with ``python -m example_site.walkthrough`` (the demo, ``./scripts/demo``, is the RQ
scenario; this is the lock alone). Each step prints what happened and checks it; the process
exits non-zero if a check fails.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_site.settings")
    import django

    django.setup()
    from django_redis import get_redis_connection

    from django_joblock import LockNotAcquired, lock

    try:
        get_redis_connection("default").ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no Redis here"
        print(
            f"Redis does not answer at {os.environ.get('REDIS_URL', 'redis://127.0.0.1:6379/0')}"
            f": {exc}\nStart one (redis-server) or set REDIS_URL.",
            file=sys.stderr,
        )
        return 2
    resource = f"walkthrough:{os.getpid()}"
    failures = 0

    def step(ok: bool, text: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"  [{'ok' if ok else 'FAIL'}] {text}")

    print(f"1. Take a lock on {resource!r} (TTL 3 s, heartbeat on)")
    with lock(resource, ttl=3) as held:
        step(held.held, f"held, fence={held.fence}, owner hash={held.owner}")
        print("2. A second worker tries the same resource")
        try:
            with lock(resource, ttl=3):
                step(False, "second worker got the lock")
        except LockNotAcquired as exc:
            step(True, f"refused: {exc}")
        print("3. Work for 7 s (more than 2 TTLs); the heartbeat keeps the lock")
        time.sleep(7)
        step(held.held, f"still held, {held.remaining():.2f}s of validity left")
        first_fence = held.fence
    print("4. Released; the next holder gets a larger fence")
    with lock(resource, ttl=3) as again:
        step(
            again.fence is not None and first_fence is not None and again.fence > first_fence,
            f"fence {first_fence} -> {again.fence}",
        )
    print("5. A holder without heartbeat whose TTL runs out loses the lock")
    short = lock(resource, ttl=0.5, heartbeat=False)
    short.acquire()
    time.sleep(0.8)
    released = short.release()
    step(short.lost and not released, f"lost={short.lost}; release() returned {released}: not ours")
    print("All steps passed." if not failures else f"{failures} step(s) failed.")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
