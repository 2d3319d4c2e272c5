"""Acquire + release throughput and latency of django-joblock against its peers, in one run.

    python benchmarks/locks.py [--cycles N] [--rounds R] [--hold-locks N] [--hold-ttl S]
                               [--hot-procs P] [--hot-cycles N] [--hot-hold S] [--hot-rounds R]

Every contender does the same thing: build a lock object for one resource, acquire it without
waiting, release it. The ``limit=3`` row is a lock with three holders' slots (its acquire is
the line's script, which looks at every slot and indexes the holding it takes: two round trips
per cycle, as for one slot).
Contenders run in interleaved rounds (A B C ... A B C ...) so that machine
noise hits them alike; cycles/s is the median over rounds, latency percentiles are over every
cycle. Ratios are against the raw floor (``SET NX PX`` + ``EVALSHA`` compare-and-delete) and
against python-redis-lock with ``auto_renewal``, measured in this same run.

The second part is the hot lock: P processes (default 4) each run N cycles (default 50) of
"acquire one resource waiting up to 60 s (TTL 10 s), work 10 ms, release", all on the same
resource, started together. The floor is P x N x hold (2.0 s); efficiency = floor / makespan
(first acquire to last release, one clock for all processes); each acquire's wait is timed.
Contenders, interleaved over rounds: ours (``lock(wait=60)``: in line, woken on release),
redis-py ``Lock(blocking_timeout=60)`` (sleep polling, its default 0.1 s sleep) and
python-redis-lock (``blocking=True``, BLPOP on a signal the release pushes; its ``timeout`` may
not exceed ``expire`` without auto-renewal, so it waits in TTL-long blocks).

The fourth part (``benchmarks/replica_acks.py``) prices ``JOBLOCK["REPLICA_ACKS"] = 1`` against
0 on a private primary with one replica.

The third part holds many locks in one process for a few TTL periods and reports the renewal
thread's round trips and CPU per TTL period.

Redis: ``REDIS_URL`` (default redis://127.0.0.1:6379/0); a private redis-server on a free port is
started instead when the binary is on PATH and ``REDIS_URL`` is not set. Keys are namespaced
under ``bench`` and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.procs import redis_server
from tests.procs.redis_server import RedisServer

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def private_redis() -> tuple[str, RedisServer | None]:
    """``REDIS_URL`` if set; else a private redis-server on a free port when the binary is on
    PATH (the caller stops it); else the default local Redis."""
    if os.environ.get("REDIS_URL") or not redis_server.available():
        return os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), None
    server = RedisServer()
    server.start()
    return server.url(), server


def setup_django(url: str, metrics: bool | None = None) -> None:
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_joblock"],
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
            CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}},
            JOBLOCK={"KEY_PREFIX": "bench"},
            USE_TZ=True,
        )
        django.setup()


def contenders(url: str) -> dict[str, Callable[[str], Any]]:
    """name -> one acquire+release cycle on a resource."""
    from django_redis import get_redis_connection

    client = get_redis_connection("default")
    release_sha = client.script_load(RELEASE)

    def raw_floor(resource: str) -> None:
        key = f"bench:raw:{resource}"
        token = secrets.token_hex(16)
        if client.set(key, token, nx=True, px=30_000):
            client.evalsha(release_sha, 1, key, token)

    def redis_py(resource: str) -> None:
        held = client.lock(f"bench:redispy:{resource}", timeout=30)
        if held.acquire(blocking=False):
            held.release()

    found: dict[str, Callable[[str], Any]] = {
        "raw SET NX PX + Lua release (floor)": raw_floor,
        "redis-py Lock": redis_py,
    }
    found.update(python_redis_lock_contenders(client))
    found.update(pottery_contenders(url))
    found[SCRIPTS_ONLY] = scripts_only()
    found["django-joblock, heartbeat off"] = joblock_cycle(False)
    found["django-joblock, heartbeat on"] = joblock_cycle(True)
    found[METRICS_OFF] = joblock_cycle(True)
    found["django-joblock, limit=3"] = joblock_cycle(True, limit=3)
    return found


def python_redis_lock_contenders(client: Any) -> dict[str, Callable[[str], None]]:
    """python-redis-lock's cycles without and with ``auto_renewal``, on ``client``; none when
    it is not installed."""
    try:
        import redis_lock
    except ImportError:
        print("(python-redis-lock not installed: pip install --group bench)")
        return {}

    # python-redis-lock wants decoded responses off; django-redis' client fits.
    def prl(auto: bool) -> Callable[[str], None]:
        def cycle(resource: str) -> None:
            held = redis_lock.Lock(client, f"prl:{resource}", expire=30, auto_renewal=auto)
            if held.acquire(blocking=False):
                held.release()

        return cycle

    return {"python-redis-lock": prl(False), "python-redis-lock auto_renewal": prl(True)}


def pottery_contenders(url: str) -> dict[str, Callable[[str], None]]:
    """pottery's ``Redlock`` cycle on one master at ``url``; none when pottery is not
    installed."""
    try:
        from pottery import Redlock
    except ImportError:
        print("(pottery not installed: pip install --group bench)")
        return {}
    import redis

    pottery_client = redis.Redis.from_url(url)

    def pottery_cycle(resource: str) -> None:
        held = Redlock(
            key=f"bench:pottery:{resource}", masters={pottery_client}, auto_release_time=30
        )
        if held.acquire(blocking=False):
            held.release()

    return {"pottery Redlock (1 master)": pottery_cycle}


def joblock_cycle(heartbeat: bool, limit: int = 1) -> Callable[[str], None]:
    """Our ``Lock``'s cycle, with its heartbeat on or off, on a lock of ``limit`` holders (three
    slots are looked at by each acquire of a ``limit=3`` lock; it takes the first free one)."""
    from django_joblock import Lock

    def cycle(resource: str) -> None:
        held = Lock(resource, ttl=30, heartbeat=heartbeat, limit=limit)
        if held.acquire():
            held.release()

    return cycle


METRICS_OFF = "django-joblock, heartbeat on, metrics off"
SCRIPTS_ONLY = "django-joblock's scripts alone (ceiling)"


def scripts_only() -> Callable[[str], None]:
    """Our ACQUIRE and RELEASE as ``Lock`` sends them (the same client, keys and arguments: the
    fence, holder details, line check, index entry), with none of our Python around them: no
    renewal, state, metrics, signals or logs. The most any ``Lock`` built on these scripts and
    redis-py's public API can reach; what ``Lock`` adds is the gap to this row."""
    from django_joblock import Lock
    from django_joblock.backend import client
    from django_joblock.locks import index, waiting
    from django_joblock.locks.info import holder_details
    from django_joblock.locks.scripts import ACQUIRE, FENCE_COUNTER_TTL_MS, RELEASE

    found = client()

    def cycle(resource: str) -> None:
        held = Lock(resource, ttl=30)  # for its keys and token only: not acquired
        keys, entry = held.keys, held.index_entry()
        index_keys, index_args = index.in_script(found, keys.prefix, entry)
        args = [held.token, held.ttl_ms, FENCE_COUNTER_TTL_MS, *holder_details()[2]]
        if ACQUIRE(found, [*waiting.lock_keys(keys), *index_keys], [*args, *index_args]) > 0:
            release_keys = [*waiting.lock_keys(keys), keys.wake(""), *index_keys[:1]]
            RELEASE(found, release_keys, [held.token, "", *index_args[1:2]])

    return cycle


def measure(cycle: Callable[[str], Any], n: int, tag: str) -> tuple[float, list[float]]:
    latencies = []
    started = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        cycle(f"bench:{tag}:{i % 64}")
        latencies.append(time.perf_counter() - t0)
    return n / (time.perf_counter() - started), latencies


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def throughput_table(url: str, cycles: int, rounds: int) -> dict[str, float]:
    runs = contenders(url)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    lats: dict[str, list[float]] = {name: [] for name in runs}
    for cycle in runs.values():  # warm-up: scripts loaded, connections open
        measure(cycle, 200, "warm")
    names = list(runs)
    for index in range(rounds):
        # Rotate the starting contender each round so that none always runs first or last.
        for name in names[index % len(names) :] + names[: index % len(names)]:
            if name == METRICS_OFF:
                from django.test import override_settings

                with override_settings(JOBLOCK={"KEY_PREFIX": "bench", "METRICS": False}):
                    rate, latency = measure(runs[name], cycles, "run")
            else:
                rate, latency = measure(runs[name], cycles, "run")
            rates[name].append(rate)
            lats[name].extend(latency)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    floor_name, prl_name = "raw SET NX PX + Lua release (floor)", "python-redis-lock auto_renewal"

    def ratio(name: str, base: str) -> float:
        # Median of per-round ratios: each pair ran minutes apart at most, seconds apart
        # usually, so slow drift of this shared machine cancels out.
        return statistics.median(a / b for a, b in zip(rates[name], rates[base], strict=True))

    prl_auto = prl_name in rates
    print(
        f"\nacquire + release, {rounds} interleaved rounds x {cycles} cycles, one process; "
        "ratios are medians of per-round ratios\n"
    )
    header = f"{'contender':41} {'cycles/s':>10} {'p50 µs':>8} {'p99 µs':>8} {'vs floor':>9}"
    header += f" {'vs prl+auto':>11}" if prl_auto else ""
    print(header)
    print("-" * len(header))
    for name in runs:
        line = (
            f"{name:41} {medians[name]:10.0f} {pct(lats[name], 50) * 1e6:8.0f} "
            f"{pct(lats[name], 99) * 1e6:8.0f} {ratio(name, floor_name):8.2f}x"
        )
        if prl_auto:
            line += f" {ratio(name, prl_name):10.2f}x"
        print(line)
    on, off = "django-joblock, heartbeat on", METRICS_OFF
    print(
        f"\nmetrics on vs off (same run): {ratio(on, off):.3f}x cycles/s "
        f"({(1 - ratio(on, off)) * 100:+.1f}% cost; the target is at most 10%)"
    )
    print(
        f"against redis-py Lock (same run): heartbeat on {ratio(on, 'redis-py Lock'):.2f}x "
        f"(the target is >= 0.8x); our scripts alone {ratio(SCRIPTS_ONLY, 'redis-py Lock'):.2f}x"
    )
    return medians


ASYNC_OURS = "django-joblock alock, heartbeat on"
ASYNC_REDIS_PY = "redis-py asyncio Lock"
ASYNC_REDIS_PY_TIMED = "redis-py asyncio Lock, socket_timeout=5"


def async_table(url: str, cycles: int, rounds: int) -> float:
    """The asyncio row: our ``alock`` against redis-py's asyncio ``Lock`` (``SET NX PX`` + Lua
    release, on ``redis.asyncio``), each cycle awaited in one event loop, interleaved rounds.
    Returns the median of per-round ratios (ours / redis-py's)."""
    import asyncio

    rates = asyncio.run(async_rates(url, cycles, rounds))

    def ratio(base: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[ASYNC_OURS], rates[base], strict=True))

    print(f"\nasyncio: acquire + release awaited, {rounds} interleaved rounds x {cycles} cycles\n")
    for name, values in rates.items():
        print(f"{name:41} {statistics.median(values):10.0f} cycles/s")
    print(
        f"alock against redis-py's asyncio Lock (same run): {ratio(ASYNC_REDIS_PY):.2f}x (the "
        f"target is >= 0.8x); against it with a socket timeout, as ours has: "
        f"{ratio(ASYNC_REDIS_PY_TIMED):.2f}x"
    )
    return ratio(ASYNC_REDIS_PY)


async def async_rates(url: str, cycles: int, rounds: int) -> dict[str, list[float]]:
    """cycles/s per round of each asyncio contender, in interleaved rounds."""
    import redis.asyncio

    from django_joblock import alock

    async def ours(resource: str) -> None:
        held = alock(resource, ttl=30)
        if await held.aacquire():
            await held.arelease()

    def theirs(on: Any) -> Callable[[str], Any]:
        async def cycle(resource: str) -> None:
            held = on.lock(f"bench:aredispy:{resource}", timeout=30)
            if await held.acquire(blocking=False):
                await held.release()

        return cycle

    client = redis.asyncio.Redis.from_url(url)
    # What our clients always have (a Redis that stops answering raises within REDIS_TIMEOUT):
    # each read in an asyncio timeout, which costs the loop some work.
    timed = redis.asyncio.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    runs = {ASYNC_REDIS_PY: theirs(client), ASYNC_REDIS_PY_TIMED: theirs(timed), ASYNC_OURS: ours}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for cycle in runs.values():  # warm-up: scripts loaded, connections open
        for i in range(200):
            await cycle(f"bench:warm:{i % 64}")
    names = list(runs)
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            started = time.perf_counter()
            for i in range(cycles):
                await runs[name](f"bench:run:{i % 64}")
            rates[name].append(cycles / (time.perf_counter() - started))
    await client.aclose()
    await timed.aclose()
    return rates


HOT = {
    "ours": "django-joblock lock(wait=60)",
    "redis-py": "redis-py Lock(blocking_timeout=60)",
    "prl": "python-redis-lock (blocking)",
}


def hot_child(name: str, url: str, cycles: int, hold: float) -> None:
    """One process of the hot-lock run: wait for ``go``, then ``cycles`` hot cycles; print JSON."""
    import redis

    setup_django(url)
    client = redis.Redis.from_url(url)
    if name == "ours":
        from django_joblock import Lock

        def take() -> Any:
            held = Lock("hot:1", ttl=10, wait=60)
            if not held.acquire():
                raise SystemExit("ours: not acquired within 60 s")
            return held

    elif name == "redis-py":

        def take() -> Any:
            held = client.lock("bench:hot:redispy", timeout=10, blocking_timeout=60)
            if not held.acquire():
                raise SystemExit("redis-py: not acquired within 60 s")
            return held

    else:
        import redis_lock

        def take() -> Any:
            held = redis_lock.Lock(client, "bench:hot:prl", expire=10)
            if not held.acquire(blocking=True):
                raise SystemExit("python-redis-lock: not acquired")
            return held

    take().release()  # warm: scripts loaded, connections open
    client.incr("bench:hot:ready")
    while not client.exists("bench:hot:go"):
        time.sleep(0.001)
    waits = []
    first = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
    for _ in range(cycles):
        t0 = time.monotonic()
        held = take()
        waits.append(time.monotonic() - t0)
        time.sleep(hold)
        held.release()
    print(json.dumps({"start": first, "end": time.monotonic(), "waits": waits}))


def hot_round(name: str, url: str, procs: int, cycles: int, hold: float) -> tuple[float, list]:
    """One hot-lock run of contender ``name``: (makespan, every acquire's wait)."""
    import redis

    client = redis.Redis.from_url(url)
    client.delete("bench:hot:ready", "bench:hot:go")
    command = [sys.executable, __file__, "--hot-child", name, "--url", url]
    command += ["--hot-cycles", str(cycles), "--hot-hold", str(hold)]
    children = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(procs)
    ]
    deadline = time.monotonic() + 60
    while int(client.get("bench:hot:ready") or 0) < procs:
        if time.monotonic() > deadline or any(child.poll() is not None for child in children):
            for child in children:
                child.kill()
            raise SystemExit(f"{name}: a child did not start: {children[0].communicate()[1]}")
        time.sleep(0.01)
    client.set("bench:hot:go", 1)
    results = []
    for child in children:
        out, err = child.communicate(timeout=600)
        if child.returncode != 0:
            raise SystemExit(f"{name}: child failed: {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    makespan = max(r["end"] for r in results) - min(r["start"] for r in results)
    return makespan, [wait for r in results for wait in r["waits"]]


def hot_table(url: str, procs: int, cycles: int, hold: float, rounds: int) -> None:
    names = ["ours", "redis-py"]
    try:
        import redis_lock  # noqa: F401

        names.append("prl")
    except ImportError:
        print("(python-redis-lock not installed: pip install --group bench)")
    floor = procs * cycles * hold
    efficiencies: dict[str, list[float]] = {name: [] for name in names}
    makespans: dict[str, list[float]] = {name: [] for name in names}
    waits: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names) :] + names[: index % len(names)]:
            makespan, round_waits = hot_round(name, url, procs, cycles, hold)
            makespans[name].append(makespan)
            efficiencies[name].append(floor / makespan)
            waits[name].extend(round_waits)
    print(
        f"\nhot lock: {procs} processes x {cycles} cycles of acquire(ttl=10, wait=60) + "
        f"{hold * 1000:g} ms work + release, one resource; floor {floor:.2f} s; "
        f"{rounds} interleaved rounds (medians of makespan and efficiency; waits over all)\n"
    )
    header = (
        f"{'contender':38} {'makespan':>9} {'efficiency':>10} {'p50 wait':>9} "
        f"{'p99 wait':>9} {'max wait':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        print(
            f"{HOT[name]:38} {statistics.median(makespans[name]):8.2f}s "
            f"{statistics.median(efficiencies[name]):10.3f} {pct(waits[name], 50) * 1000:7.1f}ms "
            f"{pct(waits[name], 99) * 1000:7.1f}ms {max(waits[name]) * 1000:7.1f}ms"
        )
    bound = 1.5 * (procs - 1) * hold + 0.020
    ours_p99 = pct(waits["ours"], 99)
    print(
        f"\nours p99 wait {ours_p99 * 1000:.1f} ms; target <= 1.5 x (P-1) x hold + 20 ms = "
        f"{bound * 1000:.0f} ms: {'met' if ours_p99 <= bound else 'NOT met'}"
    )
    if "prl" in names:
        ours_eff = statistics.median(efficiencies["ours"])
        prl_eff = statistics.median(efficiencies["prl"])
        print(
            f"ours efficiency {ours_eff:.3f} vs python-redis-lock {prl_eff:.3f} (target >=): "
            f"{'met' if ours_eff >= prl_eff else 'NOT met'}"
        )


def hold_many(count: int, ttl: float) -> None:
    from django_joblock import Lock
    from django_joblock.locks.renewal import renewer

    held = [Lock(f"hold:{i}", ttl=ttl) for i in range(count)]
    started = time.perf_counter()
    for one in held:
        if not one.acquire():
            raise SystemExit(f"could not take {one.resource}")
    acquired_in = time.perf_counter() - started
    time.sleep(ttl)  # settle: every lock has been renewed at least once
    before, t0, cpu0 = renewer().stats(), time.perf_counter(), time.process_time()
    periods = 3
    time.sleep(ttl * periods)
    after, elapsed = renewer().stats(), time.perf_counter() - t0
    # The main thread sleeps: the process's CPU is the renewal thread's (and the GC's).
    cpu_total = time.process_time() - cpu0
    lost = sum(1 for one in held if not one.held)
    trips = (after.round_trips - before.round_trips) / periods
    renewed = (after.renewed - before.renewed) / periods
    cpu = cpu_total / periods
    print(
        f"\n{count} locks held by one process, TTL {ttl:g}s (heartbeat every {ttl / 3:.2f}s); "
        f"acquired in {acquired_in:.1f}s; measured over {periods} TTL periods ({elapsed:.1f}s)\n"
    )
    print(
        f"  renewal threads            : 1 (threads alive in process: "
        f"{__import__('threading').active_count()})"
    )
    print(f"  round trips per TTL period : {trips:.1f}")
    print(f"  renewals per TTL period    : {renewed:.0f} ({renewed / count:.2f} per lock)")
    print(f"  renewals per round trip    : {renewed / max(trips, 1):.0f}")
    print(
        f"  CPU per TTL (main asleep)  : {cpu * 1000:.0f} ms = {cpu / ttl * 100:.1f}% of one core "
        "(the target is below 5%)"
    )
    print(f"  locks lost                 : {lost}")
    for one in held:
        one.release()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--hold-locks", type=int, default=10_000)
    parser.add_argument("--hold-ttl", type=float, default=10.0)
    parser.add_argument("--hot-procs", type=int, default=4)
    parser.add_argument("--hot-cycles", type=int, default=50)
    parser.add_argument("--hot-hold", type=float, default=0.010)
    parser.add_argument("--hot-rounds", type=int, default=5)
    parser.add_argument("--replica-rounds", type=int, default=5, help="REPLICA_ACKS table; 0: skip")
    parser.add_argument("--hot-child", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hot_child:
        hot_child(args.hot_child, args.url, args.hot_cycles, args.hot_hold)
        return 0
    url, server = private_redis()
    try:
        setup_django(url)
        import redis

        print(
            f"Redis {redis.Redis.from_url(url).info('server')['redis_version']} at {url}; "
            f"Python {sys.version.split()[0]}; redis-py {redis.__version__}"
        )
        if args.cycles and args.rounds:
            throughput_table(url, args.cycles, args.rounds)
            async_table(url, args.cycles, args.rounds)
        if args.hot_rounds:
            hot_table(url, args.hot_procs, args.hot_cycles, args.hot_hold, args.hot_rounds)
        if args.hold_locks:
            hold_many(args.hold_locks, args.hold_ttl)
        if args.replica_rounds and redis_server.available():
            from replica_acks import table

            table(args.cycles or 2000, args.replica_rounds, measure, pct)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
