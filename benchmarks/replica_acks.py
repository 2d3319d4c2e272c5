"""The cost of ``JOBLOCK["REPLICA_ACKS"]``: acquire + release on a primary with one replica.

    python benchmarks/replica_acks.py [--cycles N] [--rounds R]

(``benchmarks/locks.py`` prints the same table as its last part.) A private primary and its
replica (``redis-server`` on free ports, on loopback) carry the locks. Two contenders, in
interleaved rounds, do what ``benchmarks/locks.py`` times (build a lock, acquire without
waiting, release; heartbeat on): ``REPLICA_ACKS = 0`` (the default) and ``REPLICA_ACKS = 1``
(each acquire also renews and ``WAIT``s for the replica, in one more round trip). Prints
cycles/s (median over rounds), p50/p99 latency and the ratio of the two, side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.procs.redis_server import RedisServer

Measure = Callable[[Callable[[str], Any], int, str], tuple[float, list[float]]]


def table(
    cycles: int, rounds: int, measure: Measure, pct: Callable[[list[float], float], float]
) -> None:
    """Print the REPLICA_ACKS table (Django must be set up; its settings are overridden)."""
    from django.test import override_settings

    from django_joblock import Lock

    primary = RedisServer()
    primary.start()
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
    replica.start()
    try:
        with replica.client() as client:
            deadline = time.monotonic() + 10
            while client.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise SystemExit("the replica did not sync")
                time.sleep(0.05)
        caches = {
            "default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": primary.url()}
        }

        def cycle(resource: str) -> None:
            held = Lock(resource, ttl=30)
            if held.acquire():
                held.release()

        names = {"REPLICA_ACKS = 0 (default)": 0, "REPLICA_ACKS = 1 (1 replica)": 1}
        rates: dict[str, list[float]] = {name: [] for name in names}
        lats: dict[str, list[float]] = {name: [] for name in names}

        def run(acks: int, n: int, tag: str) -> tuple[float, list[float]]:
            joblock = {"KEY_PREFIX": "bench", "REPLICA_ACKS": acks}
            with override_settings(CACHES=caches, JOBLOCK=joblock):
                return measure(cycle, n, tag)

        for acks in names.values():  # warm-up: scripts loaded, connections open
            run(acks, 200, "warm")
        order = list(names)
        for index in range(rounds):
            for name in order[index % 2 :] + order[: index % 2]:
                rate, latency = run(names[name], cycles, "run")
                rates[name].append(rate)
                lats[name].extend(latency)
    finally:
        replica.stop()
        primary.stop()
    base = order[0]
    print(
        f"\nREPLICA_ACKS: acquire + release, heartbeat on, primary + 1 replica on loopback; "
        f"{rounds} interleaved rounds x {cycles} cycles\n"
    )
    print(f"{'contender':30} {'cycles/s':>10} {'p50 µs':>8} {'p99 µs':>8} {'vs acks=0':>10}")
    for name in order:
        ratio = statistics.median(a / b for a, b in zip(rates[name], rates[base], strict=True))
        print(
            f"{name:30} {statistics.median(rates[name]):10.0f} "
            f"{pct(lats[name], 50) * 1e6:8.0f} {pct(lats[name], 99) * 1e6:8.0f} {ratio:9.2f}x"
        )


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from locks import measure, pct, setup_django

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    setup_django("redis://127.0.0.1:1/0")  # every contender overrides CACHES
    table(args.cycles, args.rounds, measure, pct)


if __name__ == "__main__":
    main()
