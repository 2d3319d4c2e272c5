"""Hot resources: jobs that all need the same resource, drained by real RQ workers, side by side.

    python benchmarks/hot_key.py [--jobs 60] [--ms 50] [--workers 4] [--rounds 3]
                                 [--resources 10] [--requeue-rounds 1]

Scenarios: N jobs of D ms on **one** resource, N jobs over M resources with Zipf-like
popularity (resource k drawn with weight 1/(k+1), fixed seed), and N jobs on one resource
that allows **three** runs at once (``RateLimit(concurrency=3)`` against
``@locked_job(concurrency=3)``). W ``SimpleWorker`` processes
(``JoblockSimpleWorker``), one of them with RQ's scheduler, drain each batch. Contenders:

- plain RQ with RQ's own ``RateLimit(key=<resource>, concurrency=1)`` (rq >= 3.0; 3 in the
  last scenario);
- ``@locked_job(lock="hot:{k}")`` as a new user writes it (admission, the new default);
- ``@locked_job(..., admission=False)``: the requeue-only path (rq 2.x behaviour), which
  waits for RQ's scheduler in whole seconds; run ``--requeue-rounds`` times only (it is slow);
- ``@locked_task(lock="hot:{k}")``: the same as a Django task on django-joblock's RQ backend
  (``django_joblock.jobs.rq_tasks.RQBackend``; the workers run ``joblock_worker``'s job class
  for tasks, ``django_joblock.jobs.rq_tasks.Job``). Needs django-tasks-rq; skipped without it.

Contenders alternate within each round (interleaved, so machine noise hits all alike).
Printed per scenario and contender: makespan (first enqueue to last job end; median over
rounds), efficiency = serial floor / makespan, where the floor is max(the busiest
resource's jobs x D, N x D / W), requeues per job, and p50 / p99 of the wait from enqueue
(``job.created_at``) to the start of the job's body, over every job of every round;
"vs RateLimit" is the median of per-round makespan ratios (RateLimit / contender; > 1 is
faster). Redis: a private redis-server when the binary is on PATH (else ``REDIS_URL``);
database: a throwaway SQLite file, migrated.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from locks import private_redis  # noqa: E402

from tests.procs.workers import WorkerProcesses  # noqa: E402

QUEUE = "hot"
#: The @locked_task contender runs (django-joblock's RQ backend is built on django-tasks-rq).
TASKS = importlib.util.find_spec("django_tasks_rq") is not None


def setup(url: str, db_path: str, *, migrate: bool) -> None:
    import django
    from django.conf import settings

    apps = ["django.contrib.contenttypes", "django.contrib.auth", "django_joblock"]
    tasks: dict[str, Any] = {}
    if TASKS:  # the RQ backend's queues are django-rq's (the other contenders use them too)
        apps.insert(2, "django_rq")
        tasks = {
            "RQ_QUEUES": {QUEUE: {"USE_REDIS_CACHE": "default"}},
            "TASKS": {
                "default": {
                    "BACKEND": "django_joblock.jobs.rq_tasks.RQBackend",
                    "QUEUES": [QUEUE],
                }
            },
        }
    settings.configure(
        INSTALLED_APPS=apps,
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": db_path}},
        CACHES={"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": url}},
        USE_TZ=True,
        SECRET_KEY="bench",  # migrate claims KEY_PREFIX with it (W016)
        JOBLOCK={"REQUEUE_MAX_WAIT": 3600},
        **tasks,
    )
    django.setup()
    if migrate:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)


def worker_main(url: str, db_path: str, index: int) -> None:
    setup(url, db_path, migrate=False)
    from django_joblock.jobs.queues import get_queue
    from django_joblock.worker import JoblockSimpleWorker

    queue = get_queue(QUEUE)
    # joblock_worker's default job class with django-tasks-rq: runs tasks and plain jobs alike.
    job_class = {"job_class": "django_joblock.jobs.rq_tasks.Job"} if TASKS else {}
    worker = JoblockSimpleWorker(
        [queue], connection=queue.connection, name=f"hot-{index}", **job_class
    )
    worker.work(with_scheduler=index == 0, logging_level="WARNING")


def __getattr__(name: str) -> Any:
    """``hot_key.hot_task``, the ``@locked_task`` contender, made on first use: a Django task
    needs the settings, which this script configures at run time. Workers import it by that
    dotted path (RQ refuses functions of ``__main__``)."""
    if name != "hot_task":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from bench_jobs import _work

    from django_joblock import locked_task

    def hot_task(k: int, ms: float, tag: str) -> tuple[float, float]:
        return _work(ms)

    hot_task.__module__, hot_task.__qualname__ = __name__, "hot_task"
    made = globals()["hot_task"] = locked_task(lock="hot:{k}", queue_name=QUEUE)(hot_task)
    return made


@dataclass
class Sample:
    makespan: float
    floor: float
    requeues: int
    jobs: int
    waits: list[float] = field(default_factory=list)


def zipf_keys(n: int, m: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return rng.choices(range(m), weights=[1 / (k + 1) for k in range(m)], k=n)


def drain(
    queue: Any,
    keys: list[int],
    ms: float,
    workers: int,
    enqueue: Callable[..., Any],
    concurrency: int = 1,
) -> Sample:
    from rq.job import Job

    tag = f"{time.monotonic_ns()}"
    started = time.time()
    jobs = [enqueue(k, ms, tag) for k in keys]
    ids = [job.id for job in jobs]
    deadline = time.monotonic() + 3600
    while True:
        pipe = queue.connection.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(Job.key_for(job_id), "status")
        statuses = Counter((s or b"missing").decode() for s in pipe.execute())
        if statuses["finished"] + statuses["failed"] == len(ids):
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"not drained within an hour: {statuses}")
        time.sleep(0.05)
    if statuses["failed"]:
        raise SystemExit(f"{statuses['failed']} jobs failed")
    ends, waits, requeues = [], [], 0
    for job in Job.fetch_many(ids, connection=queue.connection):
        assert job is not None
        begin, end = job.return_value()
        ends.append(end)
        waits.append(max(0.0, begin - job.created_at.timestamp()))
        requeues += int(job.get_meta(refresh=False).get("joblock", {}).get("requeues", 0))
    busiest = max(Counter(keys).values())
    floor = max(busiest * ms / 1000 / concurrency, len(keys) * ms / 1000 / workers)
    return Sample(max(ends) - started, floor, requeues, len(keys), waits)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


REQUEUE = "@locked_job(admission=False), requeue"
RATE_LIMIT = "plain RQ + RQ's RateLimit"


def parse_args() -> argparse.Namespace:
    """The command line (``--worker``, ``--url`` and ``--db``: a worker process's own)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--ms", type=float, default=50.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resources", type=int, default=10, help="M, for the Zipf scenario")
    parser.add_argument("--requeue-rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    return parser.parse_args()


def start_workers(crew: WorkerProcesses, queue: Any, url: str, db_path: str, count: int) -> None:
    """Start ``count`` worker processes of this script and wait until they are all registered
    and the first one's scheduler runs."""
    from rq import Worker
    from rq.scheduler import RQScheduler

    for index in range(count):
        crew.start(
            [sys.executable, __file__, "--worker", str(index), "--url", url, "--db", db_path]
        )
    deadline = time.monotonic() + 60
    while len(Worker.all(queue=queue)) < count or not queue.connection.exists(
        RQScheduler.get_locking_key(QUEUE)
    ):
        if time.monotonic() > deadline:
            raise SystemExit(f"workers did not start:\n{crew.logs()}")
        time.sleep(0.1)


def make_contenders(queue: Any) -> dict[str, Callable[..., Any]]:
    """name -> enqueue one job ``(k, ms, tag)`` on resource ``k``, the contender's way."""
    from bench_jobs import hot_locked, hot_plain, hot_requeue
    from rq import RateLimit

    contenders: dict[str, Callable[..., Any]] = {
        RATE_LIMIT: lambda k, ms, tag: queue.enqueue(
            hot_plain, args=(k, ms, tag), rate_limit=RateLimit(key=f"hot:{k}", concurrency=1)
        ),
        "@locked_job (admission, default)": lambda k, ms, tag: hot_locked.delay(k, ms, tag),
        REQUEUE: lambda k, ms, tag: hot_requeue.delay(k, ms, tag),
    }
    if TASKS:
        import hot_key  # this file as a module: the task's dotted path is hot_key.hot_task

        contenders["@locked_task (RQ backend)"] = lambda k, ms, tag: hot_key.hot_task.enqueue(
            k, ms, tag
        )
    return contenders


def limited_contenders(queue: Any) -> dict[str, Callable[..., Any]]:
    """The N = 3 scenario's contenders: RQ's RateLimit(concurrency=3) and
    @locked_job(concurrency=3)."""
    from bench_jobs import hot_limited, hot_plain
    from rq import RateLimit

    return {
        RATE_LIMIT: lambda k, ms, tag: queue.enqueue(
            hot_plain, args=(k, ms, tag), rate_limit=RateLimit(key=f"quota:{k}", concurrency=3)
        ),
        "@locked_job(concurrency=3)": lambda k, ms, tag: hot_limited.delay(k, ms, tag),
    }


def run_scenario(
    queue: Any,
    keys: list[int],
    args: argparse.Namespace,
    contenders: dict[str, Callable[..., Any]],
    concurrency: int = 1,
) -> dict[str, list[Sample]]:
    """Drain ``keys`` with each contender in turn, round after round (the requeue path for
    ``--requeue-rounds`` only); contender -> its samples."""
    samples: dict[str, list[Sample]] = {name: [] for name in contenders}
    for round_no in range(max(args.rounds, args.requeue_rounds)):
        for name, enqueue in contenders.items():
            limit = args.requeue_rounds if name == REQUEUE else args.rounds
            if round_no < limit:
                sample = drain(queue, keys, args.ms, args.workers, enqueue, concurrency)
                samples[name].append(sample)
    return samples


def print_header(args: argparse.Namespace) -> None:
    """The run's parameters and the table's header."""
    print(
        f"{args.jobs} jobs x {args.ms:g} ms, {args.workers} SimpleWorkers (one with the "
        f"scheduler); {args.rounds} interleaved rounds ({args.requeue_rounds} for the "
        "requeue path)\n",
        flush=True,
    )
    header = (
        f"{'scenario':22} {'contender':38} {'makespan':>9} {'effic.':>7} "
        f"{'vs RateLimit':>12} {'requeues/job':>12} {'p50 wait':>9} {'p99 wait':>9}"
    )
    print(header)
    print("-" * len(header))


def print_scenario(scenario: str, samples: dict[str, list[Sample]]) -> None:
    """The table's rows of one scenario: its serial floor, then one row per contender that
    ran."""
    floor = samples[next(iter(samples))][0].floor
    print(
        f"{scenario:22} {'serial floor':38} {floor:8.2f}s {1.0:7.2f} "
        f"{'':>12} {'':>12} {'':>9} {'':>9}"
    )
    base = samples[RATE_LIMIT]
    for name, runs in samples.items():
        if not runs:
            continue
        makespan = statistics.median(s.makespan for s in runs)
        ratios = [b.makespan / s.makespan for b, s in zip(base, runs, strict=False)]
        waits = [w for s in runs for w in s.waits]
        requeues = sum(s.requeues for s in runs) / sum(s.jobs for s in runs)
        print(
            f"{scenario:22} {name:38} {makespan:8.2f}s {floor / makespan:7.2f} "
            f"{statistics.median(ratios):11.2f}x {requeues:12.2f} "
            f"{quantile(waits, 0.5):8.2f}s {quantile(waits, 0.99):8.2f}s",
            flush=True,
        )


def benchmark(args: argparse.Namespace, url: str, db_path: str, crew: WorkerProcesses) -> None:
    """Set up Django, start the workers, and print the table of every scenario."""
    setup(url, db_path, migrate=True)
    from django_joblock.jobs.queues import get_queue

    queue = get_queue(QUEUE)
    start_workers(crew, queue, url, db_path, args.workers)
    contenders = make_contenders(queue)
    scenarios = {
        "1 resource": [0] * args.jobs,
        f"{args.resources} resources, Zipf": zipf_keys(args.jobs, args.resources, args.seed),
    }
    print_header(args)
    for scenario, keys in scenarios.items():
        print_scenario(scenario, run_scenario(queue, keys, args, contenders))
    limited = run_scenario(queue, [0] * args.jobs, args, limited_contenders(queue), 3)
    print_scenario("1 resource, 3 at once", limited)


def main() -> int:
    args = parse_args()
    if args.worker is not None:
        worker_main(args.url, args.db, args.worker)
        return 0

    url, server = private_redis()
    db = tempfile.NamedTemporaryFile(suffix=".sqlite3", delete=False)
    crew = WorkerProcesses(cwd=HERE.parent)
    drained = False
    try:
        benchmark(args, url, db.name, crew)
        drained = True
    finally:
        crew.stop()  # each worker and its scheduler process
        if drained:
            crew.remove_logs()
        else:
            print(f"worker logs kept in {crew.log_dir}", file=sys.stderr)
        if server is not None:
            server.stop()
        os.unlink(db.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
