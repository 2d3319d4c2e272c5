"""Instructions per job: plain RQ against ``@locked_job``, counted by valgrind, not timed.

    python benchmarks/job_instructions.py [--jobs N] [--kinds K,K,...] [--database-url URL]

``benchmarks/jobs.py`` times jobs; on a shared machine its ratios move by up to 0.1 between
two runs of the same commit. The instructions a worker process executes per job do not (the
same count within about 0.5 %, run after run, whatever else the machine does), so this is the
figure to compare a change against. For each kind of job, a burst ``JoblockSimpleWorker`` in a
child process run by ``valgrind --tool=callgrind`` drains N jobs; the count of the same worker
draining nothing (start-up, teardown) is subtracted. Only the worker's own work is counted:
what Redis and PostgreSQL do, and the wait for their replies, are in ``jobs.py``'s figures, not
here. "vs plain" is plain RQ's count over the kind's (as a throughput ratio: 1.00x is plain RQ's
cost, lower costs more); the floor is ``jobs.py``'s hand-written job (PostgreSQL only).

Redis: a private redis-server when the binary is on PATH (else ``REDIS_URL``); database: a
throwaway PostgreSQL database next to ``--database-url`` (default ``DATABASE_URL``, else
postgres://postgres@127.0.0.1:5432/postgres), or a throwaway SQLite file with
``--database-url sqlite``. Needs ``valgrind`` on PATH.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from jobs import FLOOR, OURS, database, job_kinds, setup  # noqa: E402
from locks import private_redis  # noqa: E402

# --kinds names -> jobs.py's kinds (the same jobs; the floor on PostgreSQL only).
KINDS = {
    "plain": "no-op: plain RQ",
    "lock": "no-op: @locked_job (lock)",
    "idempotency": "no-op: @locked_job (lock + idempotency)",
    "plain_update": "UPDATE: plain RQ",
    "floor": FLOOR,
    "ours": OURS,
}


def worker_main(url: str, db: dict[str, Any]) -> None:
    """The counted process: drain the queue with a burst worker (RQ's maintenance skipped, as
    in ``jobs.py``)."""
    setup(url, db, create=False)
    logging.getLogger("rq").setLevel(logging.WARNING)
    from rq.utils import now

    from django_joblock.jobs.queues import get_queue
    from django_joblock.worker import JoblockSimpleWorker

    queue = get_queue("bench")
    worker = JoblockSimpleWorker([queue], connection=queue.connection)
    worker.last_cleaned_at = now()
    worker.work(burst=True, logging_level="WARNING")


def counted(url: str, db: dict[str, Any]) -> int:
    """Instructions a worker process executed (valgrind's count)."""
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--worker",
        "--url",
        url,
        "--db",
        json.dumps(db),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"the counted worker failed:\n{done.stdout}\n{done.stderr[-3000:]}")
    return int(found.group(1))


def per_job(url: str, db: dict[str, Any], enqueue: Callable[[int], Any], jobs: int) -> float:
    """Instructions per job of ``jobs`` jobs ``enqueue`` makes, beyond a worker's own."""
    from django_joblock.jobs.queues import get_queue

    queue = get_queue("bench")
    for i in range(3):  # the scripts loaded on the server, the rows and records warm
        enqueue(10_000 + i)
    counted(url, db)
    idle = counted(url, db)
    for i in range(jobs):
        enqueue(i)
    busy = counted(url, db)
    if queue.count or len(queue.failed_job_registry):
        raise SystemExit(f"jobs left or failed: {queue.count}, {len(queue.failed_job_registry)}")
    return (busy - idle) / jobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres",
        help="a PostgreSQL server to create a throwaway database on, or 'sqlite'",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.url, json.loads(args.db))
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be at least 1, got {args.jobs}")
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"unknown --kinds {unknown}: choose from {', '.join(KINDS)}")
    url, server = private_redis()
    db, drop = database(args.database_url)
    try:
        setup(url, db)
        from django.db import connection

        from django_joblock.jobs.queues import get_queue

        made = job_kinds(get_queue("bench"), floor=connection.vendor == "postgresql")
        run = f"count{os.getpid()}"
        found = {
            KINDS[kind]: per_job(url, db, made[KINDS[kind]](run), args.jobs)
            for kind in kinds
            if KINDS[kind] in made
        }
        print(
            f"Python {sys.version.split()[0]}; database {connection.vendor}; instructions per "
            f"job of a JoblockSimpleWorker draining {args.jobs} jobs (valgrind callgrind)\n"
        )
        header = f"{'job':42} {'M instr/job':>12} {'vs plain':>9}"
        print(header)
        print("-" * len(header))
        for name, count in found.items():
            plain = found.get(name.split(":", 1)[0] + ": plain RQ")
            ratio = f"{plain / count:8.2f}x" if plain else ""
            print(f"{name:42} {count / 1e6:12.2f} {ratio}")
        if FLOOR in found and OURS in found:
            ours = OURS.split(": ", 1)[1]
            print(f"\n{ours} against the floor: {found[FLOOR] / found[OURS]:.2f}x")
    finally:
        drop()
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
