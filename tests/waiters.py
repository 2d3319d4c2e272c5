"""Processes that wait for a lock, for the tests of ``lock(wait=...)``.

``python -m tests.waiters wait RESOURCE INDEX TTL WAIT HOLD [nobeat]``: wait in line for the
lock; once it has it, push ``{"index", "fence", "acquired_ms"}`` (the lock hash's server-clock
time of the acquisition) to the Redis list ``test:order``, hold it ``HOLD`` seconds, release,
exit 0; exit 3 if ``WAIT`` ran out first.

``python -m tests.waiters hold RESOURCE TTL``: take the lock (one try), print ``held FENCE``
and hang until killed.

:class:`Waiters` starts them on the test settings with a given ``JOBLOCK`` and kills whatever
is left at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

from tests.harness import ROOT, child_env


class Waiters:
    """Child processes of this module; :meth:`close` kills the ones still running."""

    def __init__(self, joblock: dict[str, Any] | None = None) -> None:
        self.joblock = joblock or {}
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.waiters", *args],
            cwd=ROOT,
            env=child_env(self.joblock),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)


def _wait(resource: str, index: int, ttl: float, wait: float, hold: float, beat: bool) -> int:
    from django_redis import get_redis_connection

    from django_joblock import lock

    client = get_redis_connection("default")
    held = lock(resource, ttl=ttl, wait=wait, heartbeat=beat)
    if not held.acquire():
        return 3
    acquired_ms = int(client.hget(held.key, "acquired_ms"))
    record = {"index": index, "fence": held.fence, "acquired_ms": acquired_ms}
    client.rpush("test:order", json.dumps(record))
    time.sleep(hold)
    return 0 if held.release() else 4


def _hold(resource: str, ttl: float) -> None:
    from django_joblock import lock

    held = lock(resource, ttl=ttl)
    if not held.acquire():
        raise SystemExit(3)
    print(f"held {held.fence}", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    mode, *rest = sys.argv[1:]
    if mode == "wait":
        resource, index, ttl, wait, hold, *flags = rest
        sys.exit(
            _wait(
                resource,
                int(index),
                float(ttl),
                float(wait),
                float(hold),
                beat="nobeat" not in flags,
            )
        )
    elif mode == "hold":
        _hold(rest[0], float(rest[1]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
