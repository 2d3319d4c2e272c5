"""Server time of the "Job locks" admin dashboard at 1k / 10k / 100k active locks, with
1,000,000 idempotency records in PostgreSQL.

    python benchmarks/dashboard.py [--sizes 1000,10000,100000] [--records 1000000]

Locks are taken with the real acquire script and indexed as the renewal thread indexes them
(pipelined, TTL 10 minutes so none expires during the run), spread over 20 families, 1 in 50
contended, with metrics for the last hour. Records are bulk-inserted with ``generate_series``
(5 % of them ``running`` past their lease). The page is rendered through Django's test client
by a superuser; the figure is the median of 5 renders (server time, no network or browser).
Redis: a private redis-server (or ``REDIS_URL``); PostgreSQL: ``DATABASE_URL`` (default
postgres://postgres@127.0.0.1:5432/postgres), in a throwaway database that is dropped at exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from locks import private_redis

FAMILIES = 20


def setup(redis_url: str, pg_url: str) -> tuple[str, object]:
    import dj_database_url
    import psycopg

    base = dj_database_url.parse(pg_url)
    name = f"joblock_dash_{os.getpid()}"
    admin = psycopg.connect(
        host=base["HOST"],
        port=base["PORT"] or 5432,
        user=base["USER"],
        dbname=base["NAME"],
        autocommit=True,
    )
    admin.execute(f'CREATE DATABASE "{name}"')
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "django.contrib.staticfiles",
            "django_joblock",
        ],
        DATABASES={"default": {**base, "NAME": name}},
        CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": redis_url}},
        MIDDLEWARE=[
            "django.contrib.sessions.middleware.SessionMiddleware",
            "django.contrib.auth.middleware.AuthenticationMiddleware",
            "django.contrib.messages.middleware.MessageMiddleware",
        ],
        ROOT_URLCONF="bench_urls",
        TEMPLATES=[
            {
                "BACKEND": "django.template.backends.django.DjangoTemplates",
                "APP_DIRS": True,
                "OPTIONS": {
                    "context_processors": [
                        "django.template.context_processors.request",
                        "django.contrib.auth.context_processors.auth",
                        "django.contrib.messages.context_processors.messages",
                    ]
                },
            }
        ],
        STATIC_URL="static/",
        USE_TZ=True,
        SECRET_KEY="bench",
        ALLOWED_HOSTS=["*"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return name, admin


def add_locks(start: int, stop: int) -> None:
    """Hold locks ``start..stop-1`` the way real holders do (the acquire script, which writes
    the index entry and the family in the same call), pipelined."""
    from django_joblock import conf
    from django_joblock.backend import client, send
    from django_joblock.locks import index, waiting
    from django_joblock.locks.keys import LockKeys, owner_hash
    from django_joblock.locks.scripts import ACQUIRE, FENCE_COUNTER_TTL_MS

    found = client("default")
    prefix = conf.get().KEY_PREFIX
    for chunk in range(start, stop, 2000):
        calls = []
        for i in range(chunk, min(stop, chunk + 2000)):
            keys = LockKeys(prefix, f"fam{i % FAMILIES}:{i}")
            token, job_id = f"{i:032x}", f"job-{i}"
            entry = (keys.resource, owner_hash(token), 600.0, job_id, 0)
            index_keys, index_args = index.in_script(found, prefix, entry)
            details = [token, 600_000, FENCE_COUNTER_TTL_MS, "bench-host", 1, job_id, "bench.job"]
            calls.append(
                (ACQUIRE, [*waiting.lock_keys(keys), *index_keys], [*details, "", *index_args])
            )
        send(found, calls)


def add_metrics() -> None:
    from django_joblock import metrics

    for i in range(5000):
        fam = f"fam{i % FAMILIES}"
        metrics.record_acquire(fam, "bench.job", 0.002 * (i % 7), acquired=i % 50 != 0)
        metrics.observe("hold_seconds", fam, "bench.job", 0.01 * (i % 13))
        if i % 50 == 0:
            metrics.count("requeued", fam, "bench.job")
        if i % 97 == 0:
            metrics.count("duplicates_blocked", fam, "bench.job")
    metrics.flush_now()


def add_records(count: int) -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO django_joblock_idempotencyrecord
              (scope, key, fingerprint, status, result, error, token, fence, lock_resource,
               rq_job_id, attempts, lease_expires_at, created_at, updated_at, finished_at,
               expires_at)
            SELECT 'bench.job', 'refund:' || g, '', CASE WHEN g %% 20 = 0 THEN 'running'
                   ELSE 'succeeded' END, '{"ok": true}'::jsonb, '', md5(g::text), g,
                   'fam' || (g %% 20) || ':' || g, 'job-' || g, 1,
                   CASE WHEN g %% 20 = 0 THEN now() - interval '1 hour' ELSE NULL END,
                   now() - interval '2 hours', now() - interval '2 hours', NULL,
                   now() + interval '7 days'
            FROM generate_series(1, %s) AS g
        """,
            [count],
        )
        cursor.execute("ANALYZE django_joblock_idempotencyrecord")


def render_ms(client: object, url: str, times: int = 5) -> tuple[float, int]:
    samples, size = [], 0
    for _ in range(times):
        started = time.perf_counter()
        response = client.get(url)  # type: ignore[attr-defined]
        samples.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, response.status_code
        size = len(response.content)
    return statistics.median(samples), size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    redis_url, server = private_redis()
    pg_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    name, admin = setup(redis_url, pg_url)
    try:
        from django.contrib.auth.models import User
        from django.test import Client

        started = time.perf_counter()
        add_records(args.records)
        print(
            f"{args.records:,} idempotency records inserted in "
            f"{time.perf_counter() - started:.1f}s (5 % running past their lease)"
        )
        add_metrics()
        client = Client()
        client.force_login(User.objects.create_superuser("bench", "b@example.com", "x"))
        print(
            f"\n{'active locks':>12} {'dashboard ms':>13} {'page KB':>8} "
            f"{'records changelist ms':>22}"
        )
        held = 0
        for size in sizes:
            add_locks(held, size)
            held = size
            dash, kb = render_ms(client, "/admin/django_joblock/dashboard/")
            records, _ = render_ms(client, "/admin/django_joblock/idempotencyrecord/", 3)
            print(f"{size:>12,} {dash:>13.0f} {kb / 1024:>8.0f} {records:>22.0f}")
    finally:
        from django.db import connections

        connections.close_all()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')  # type: ignore[attr-defined]
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
