"""Claim + succeed throughput of django-joblock's idempotency records on PostgreSQL, against a
naive ``get_or_create`` + ``save`` baseline, measured side by side in one run.

    python benchmarks/idempotency.py [--ops N] [--rounds R]

Uses ``DATABASE_URL`` (default postgres://postgres@127.0.0.1:5432/postgres) only to create a
throwaway database ``joblock_bench_<pid>``, which it migrates, uses and drops. Also prints the
SQL statements each path issues (Django's query capture).

The baseline is what a hand-rolled version usually looks like: it is *not* race-free (two
workers can both see "not done" between the SELECT and the UPDATE), so it is a speed reference,
not a correctness peer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def setup(url: str) -> tuple[str, Any]:
    import dj_database_url
    import psycopg

    base = dj_database_url.parse(url)
    name = f"joblock_bench_{os.getpid()}"
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
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_joblock"],
        DATABASES={"default": {**base, "NAME": name}},
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
            }
        },
        USE_TZ=True,
        SECRET_KEY="bench",  # migrate claims KEY_PREFIX with it (W016)
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return name, admin


def ours(prefix: str, n: int) -> None:
    from django.db import transaction

    from django_joblock import idempotent

    for i in range(n):
        with idempotent(f"{prefix}:{i}") as claim:
            if claim.done:
                continue
            with transaction.atomic():
                claim.succeed({"i": i})


def naive(prefix: str, n: int) -> None:
    from django.db import transaction
    from django.utils import timezone

    from django_joblock.models import IdempotencyRecord

    for i in range(n):
        now = timezone.now()
        record, _created = IdempotencyRecord.objects.get_or_create(
            scope="naive",
            key=f"{prefix}:{i}",
            defaults={"created_at": now, "updated_at": now, "expires_at": now},
        )
        if record.status == "succeeded":
            continue
        with transaction.atomic():
            record.status, record.result, record.updated_at = "succeeded", {"i": i}, now
            record.save()


def _data_statements(ctx: Any) -> int:
    control = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE SAVEPOINT")
    return sum(1 for q in ctx.captured_queries if not q["sql"].upper().startswith(control))


def count_statements() -> dict[str, int]:
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from django_joblock import idempotent

    counts = {}
    with CaptureQueriesContext(connection) as ctx:
        spec = idempotent("count:happy")
        claim = spec.__enter__()
    counts["ours: claim (first delivery)"] = _data_statements(ctx)
    with CaptureQueriesContext(connection) as ctx, transaction.atomic():
        claim.succeed({"ok": True})
    counts["ours: succeed"] = _data_statements(ctx)
    spec.__exit__(None, None, None)
    with CaptureQueriesContext(connection) as ctx, idempotent("count:happy") as replay:
        assert replay.done
    counts["ours: claim (duplicate, replayed)"] = _data_statements(ctx)
    with CaptureQueriesContext(connection) as ctx:
        naive("count", 1)
    counts["naive: get_or_create + save (first delivery)"] = _data_statements(ctx)
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    name, admin = setup(url)
    try:
        from django.db import connection

        print(
            f"PostgreSQL {connection.cursor().connection.info.server_version} "
            f"(database {name}); {args.rounds} interleaved rounds x {args.ops} keys\n"
        )
        rates: dict[str, list[float]] = {
            "django-joblock idempotent()": [],
            "naive get_or_create + save": [],
        }
        runs = {"django-joblock idempotent()": ours, "naive get_or_create + save": naive}
        for round_no in range(args.rounds):
            for label, fn in runs.items():
                started = time.perf_counter()
                fn(f"r{round_no}", args.ops)
                rates[label].append(args.ops / (time.perf_counter() - started))
        base = "naive get_or_create + save"
        print(f"{'first delivery: claim + succeed':34} {'ops/s':>8} {'vs naive':>9}")
        for label, values in rates.items():
            ratio = statistics.median(a / b for a, b in zip(values, rates[base], strict=True))
            print(f"{label:34} {statistics.median(values):8.0f} {ratio:8.2f}x")
        print("\nSQL statements per call (transaction control not counted)")
        for label, count in count_statements().items():
            print(f"  {label:46} {count}")
    finally:
        from django.db import connections

        connections.close_all()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
