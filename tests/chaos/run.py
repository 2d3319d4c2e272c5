"""Chaos run: K RQ workers x N logical jobs over M resources on PostgreSQL, under real faults.

    python -m tests.chaos.run                  # full: 8 workers x (2000 + 1000 + 1000 + 1000)
    python -m tests.chaos.run --short          # the version .ci/run runs (via pytest)
    python -m tests.chaos.run --negative       # fencing and idempotency off: must show damage

Each logical job adds a delta to its resource's balance with a deliberately racy
read-sleep-write, through ``fenced_update`` under ``@locked_job`` with an idempotency key;
a fifth of them are delivered twice (different job ids). Most wait for a busy resource parked
by admission (the default); 15 % are enqueued with ``admission=False`` (holders outside
admission: they requeue on contention and can take a lock that expired under a paused
holder). Four phases, each with the same faults: **uniform** (jobs spread over M resources),
**hot** (80 % of the jobs on 3 resources, the rest over 10), **loaded** (as uniform, with
every core busy: a load generator of one more busy process than cores competes with the
workers, Redis and PostgreSQL for the CPU) and **tasks** (as uniform, enqueued as Django tasks
on django-joblock's RQ backend: ``@locked_task``, with the jobs' ``retry`` and ``job_timeout``;
in the negative control a plain ``@task``). Faults, injected for real while
the queues drain: SIGKILL of work horses and of worker parents, SIGSTOP of horses for longer
than the lock TTL, one Redis restart (append-only file: the queues survive, as RQ needs),
added latency and a short black hole in a TCP proxy between the workers and Redis.

Checked afterwards: every logical job applied exactly once (or failed visibly with its
reason); each balance equals the sum of its applied deltas; accepted fences increase per
resource; no job lost; the queues drained within the bound (also per phase, with the
applied, double and visibly failed jobs and the resources with a lost update). Per phase:
drain time, requeues
and the wait from enqueue to start (p50 / p99 / max, from each job's ``meta["joblock"]
["waited"]``). Prints a table and, with ``--json PATH``, writes the report as JSON. Exit
status 1 if the run is damaged (safe mode) or shows no damage (negative control: then the run
is invalid).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
# Seconds RQ keeps its registry maintenance lock (Queue.acquire_maintenance_lock).
RQ_MAINTENANCE_LOCK = 899
sys.path.insert(0, str(ROOT))

from tests.harness import Proxy  # noqa: E402
from tests.procs.load import BusyCores  # noqa: E402
from tests.procs.redis_server import RedisServer, free_port  # noqa: E402
from tests.procs.workers import WorkerProcesses, joblock_worker_args  # noqa: E402


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.safe = not args.negative
        self.crew = WorkerProcesses(cwd=ROOT, log_dir=tempfile.mkdtemp(prefix="joblock-chaos-"))
        self.workers = self.crew.procs
        self.faults: list[str] = []
        self.hit: set[int] = set()
        self.rng = random.Random(args.seed)
        self.logical: dict[str, tuple[str, int]] = {}
        self.phase_of: dict[str, str] = {}  # resource -> its phase
        self.deliveries: list[tuple[str, str]] = []  # (job id, logical id), every phase
        self.phases: dict[str, dict[str, Any]] = {}

    # -- environment ---------------------------------------------------------------------
    def setup(self) -> None:
        import dj_database_url
        import psycopg

        self.redis = RedisServer(persistent=True)  # a restart keeps the queues, as RQ needs
        self.redis.start()
        self.proxy = Proxy(free_port(), self.redis.port)
        base_url = os.environ.get("DATABASE_URL") or "postgres://postgres@127.0.0.1:5432/postgres"
        base = dj_database_url.parse(base_url)
        self.dbname = f"joblock_chaos_{os.getpid()}"
        self.admin = psycopg.connect(
            host=base["HOST"],
            port=base["PORT"] or 5432,
            user=base["USER"],
            dbname=base["NAME"],
            autocommit=True,
        )
        self.admin.execute(f'CREATE DATABASE "{self.dbname}"')
        user = base["USER"] or "postgres"
        os.environ.update(
            CHAOS_DB_URL=f"postgres://{user}@{base['HOST']}:{base['PORT'] or 5432}/{self.dbname}",
            CHAOS_REDIS_URL=f"redis://127.0.0.1:{self.proxy.listen_port}/0",
            CHAOS_MODE="safe" if self.safe else "unsafe",
            DJANGO_SETTINGS_MODULE="tests.chaos.settings",
        )
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", run_syncdb=True, verbosity=0)
        self.direct = self.redis.client()

    def teardown(self) -> None:
        self.stop_workers()
        from django.db import connections

        connections.close_all()
        self.admin.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
        self.proxy.close()
        self.redis.stop()

    def rq(self) -> Any:
        """A client of the Redis holding RQ's queues, jobs and registries (here the run's own
        Redis; a subclass may put the queues elsewhere). ``self.direct`` stays the Redis of the
        run's own instrumentation (``chaos:started``)."""
        return self.direct

    def start_worker(self, scheduler: bool = False) -> None:
        args = joblock_worker_args(
            "chaos",
            name=f"chaos-{os.getpid()}-{len(self.workers)}",
            with_scheduler=scheduler,
            extra=["--maintenance-interval", "5"],
        )
        self.crew.start(args, env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def stop_workers(self) -> None:
        self.crew.stop()

    # -- workload ------------------------------------------------------------------------
    def resources(self, phase: str) -> tuple[list[str], list[float]]:
        """The resources of a phase and their popularity weights."""
        if phase in ("uniform", "loaded", "tasks"):
            names = [f"{phase[0]}{i}" for i in range(self.args.resources)]
            return names, [1.0] * len(names)
        hot = ["h0", "h1", "h2"]
        warm = [f"w{i}" for i in range(10)]
        # 80 % of the jobs on the three hot resources (in 5:3:2), 20 % over ten others.
        return hot + warm, [0.4, 0.24, 0.16] + [0.02] * len(warm)

    def enqueue(self, phase: str, jobs: int) -> list[tuple[str, str]]:
        from django_redis import get_redis_connection
        from rq import Retry

        # This process's pooled connections may have died with a Redis restart: start afresh.
        get_redis_connection("default").connection_pool.disconnect()

        from . import jobs as chaos_jobs
        from .models import Balance

        # (parked, direct): RQ jobs, or Django tasks in the Tasks phase (a plain @task in the
        # negative control has no lock, so no admission either).
        parked, direct = {
            (False, True): (chaos_jobs.apply, chaos_jobs.apply_direct),
            (False, False): (chaos_jobs.apply_unsafe, chaos_jobs.apply_unsafe_direct),
            (True, True): (chaos_jobs.apply_task, chaos_jobs.apply_task_direct),
            (True, False): (chaos_jobs.apply_plain_task, chaos_jobs.apply_plain_task),
        }[phase == "tasks", self.safe]
        names, weights = self.resources(phase)
        self.phase_of.update(dict.fromkeys(names, phase))
        Balance.objects.bulk_create([Balance(name=name) for name in names])
        deliveries: list[tuple[str, str]] = []  # (job id, logical id)
        retry = Retry(max=5, interval=1)
        for i in range(jobs):
            logical_id = f"{phase[0].upper()}{i}"
            resource = self.rng.choices(names, weights)[0]
            delta = self.rng.randint(1, 9)
            self.logical[logical_id] = (resource, delta)
            # Every delivery of one logical job goes through the same function (its
            # idempotency records' scope).
            job = direct if self.rng.random() < 0.15 else parked
            copies = 2 if self.rng.random() < 0.2 else 1  # duplicate delivery
            for _ in range(copies):
                if phase == "tasks":  # retry and job_timeout: the task's (jobs.py)
                    queued = job.enqueue(resource, logical_id, delta)
                else:  # A short job_timeout lets RQ's registry cleanup hand the job of a worker
                    # that died with Redis (or hangs) to another worker within a short run.
                    queued = job.enqueue_call(
                        (resource, logical_id, delta), retry=retry, job_timeout=20
                    )
                deliveries.append((queued.id, logical_id))
        self.deliveries += deliveries
        return deliveries

    # -- faults --------------------------------------------------------------------------
    def _running_horse(self) -> int | None:
        """A work horse running a job now (waits up to 10 s for one), never one already hit."""
        deadline = time.monotonic() + 10
        parents = {proc.pid for proc in self.workers}
        while time.monotonic() < deadline:
            try:
                started = self.direct.lrange("chaos:started", -30, -1)
            except Exception:
                started = []
            for raw in reversed(started):
                pid = int(raw)
                if pid in parents or pid in self.hit:
                    continue
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                self.hit.add(pid)
                return pid
            time.sleep(0.05)
        self.faults.append("no running work horse found for a fault within 10 s")
        return None

    def kill_horse(self) -> None:
        pid = self._running_horse()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # its job ended between the look and the kill
            self.faults.append(f"work horse {pid} exited before its SIGKILL")
            return
        self.faults.append(f"SIGKILL work horse {pid}")

    def kill_parent(self) -> None:
        alive = [proc for proc in self.workers[1:] if proc.poll() is None]
        if alive:
            victim = self.rng.choice(alive)
            os.kill(victim.pid, signal.SIGKILL)  # the parent only: its horse lives on
            self.faults.append(f"SIGKILL worker parent {victim.pid}")
            self.start_worker()

    def pause_horse(self) -> None:
        pid = self._running_horse()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:  # its job ended between the look and the stop
            self.faults.append(f"work horse {pid} exited before its SIGSTOP")
            return
        time.sleep(2.0 * 2)  # twice the 2 s lock TTL
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # its worker gave up on it meanwhile
            self.faults.append(f"SIGSTOP work horse {pid} for 4 s; it was killed while stopped")
            return
        self.faults.append(f"SIGSTOP work horse {pid} for 4 s (lock TTL 2 s)")

    def restart_redis(self) -> None:
        self.redis.restart()
        self.direct = self.redis.client()
        self.faults.append("Redis restarted (SIGKILL + start; append-only file kept)")

    def slow_network(self) -> None:
        self.proxy.set("delay", 0.02)
        time.sleep(3)
        self.proxy.set("blackhole")
        time.sleep(1.0)
        self.proxy.set("forward")
        self.faults.append("proxy: 3 s of +20 ms latency per packet, then a 1 s black hole")

    def schedule(self) -> list[tuple[float, Any]]:
        plan: list[tuple[float, Any]] = []
        kills, pauses = self.args.kills, self.args.pauses
        for n in range(kills):
            plan.append((3 + n * 4, self.kill_horse if n % 2 == 0 else self.kill_parent))
        for n in range(pauses):
            plan.append((5 + n * 6, self.pause_horse))
        if not self.args.no_network:
            plan.append((8, self.slow_network))
        if not self.args.no_restart:
            plan.append((14, self.restart_redis))
        return sorted(plan, key=lambda item: item[0])

    # -- run -----------------------------------------------------------------------------
    def supervise(self, done: int, elapsed: float) -> None:
        """What a process supervisor does in production: restart workers that exited, and
        restart all of them when nothing progressed for a while (RQ workers can wedge when
        their Redis restarts under them; that is RQ's business, not the lock's)."""
        for index, proc in enumerate(self.workers):
            if proc.poll() is not None and not getattr(proc, "replaced", False):
                proc.replaced = True  # type: ignore[attr-defined]
                self.start_worker(scheduler=index == 0)
                self.faults.append(f"supervisor: worker {proc.pid} exited, replaced")
        if done != getattr(self, "_last_done", -1):
            self._last_done, self._last_progress = done, elapsed
        elif elapsed - self._last_progress > 15:
            self._last_progress = elapsed
            self.maintenance()

    def maintenance(self) -> None:
        """Run RQ's own registry maintenance now. Idle RQ workers block in their dequeue call
        and only run it between jobs (every minute on django-joblock's workers), so the jobs a
        worker took with it when Redis restarted under it (left in RQ's intermediate queue or
        started registry) would wait that long to be retried. Production runs it on a timer too.

        RQ's maintenance lock (``rq:clean_registries:<queue>``, 899 s) has no owner check: a
        worker that lost Redis or was killed in the middle of a pass leaves it for 15 minutes,
        and until then RQ cleans nothing (the intermediate queue's jobs, and behind such a job
        the admission slot of its resource, wait; docs/jobs.md, "Admission"). A pass takes well
        under a second, so a lock taken over a minute ago is such a leftover: as an operator
        would, the supervisor then runs RQ's steps without it, and says so in the report."""
        from rq import Queue, Worker
        from rq.registry import clean_registries

        queue = Queue("chaos", connection=self.rq())
        worker = Worker([queue], connection=self.rq())
        left_for = self.rq().ttl(queue.registry_cleaning_key)
        if 0 < left_for < RQ_MAINTENANCE_LOCK - 60:
            clean_registries(queue)
            queue.intermediate_queue.cleanup(worker, queue)
            self.faults.append(
                f"supervisor: RQ's maintenance lock was left by a pass that died ({left_for} s "
                "to go); ran RQ's maintenance steps without it"
            )
        else:
            worker.clean_registries()
        if not self.rq().exists("rq:scheduler-lock:chaos"):
            self.start_worker(scheduler=True)
            self.faults.append("supervisor: the scheduler had died with Redis; started one")
        self.faults.append("supervisor: ran RQ registry maintenance")

    def statuses(self, deliveries: list[tuple[str, str]]) -> Counter[str]:
        pipe = self.rq().pipeline(transaction=False)
        for job_id, _logical in deliveries:
            pipe.hget(f"rq:job:{job_id}", "status")
        return Counter((raw or b"missing").decode() for raw in pipe.execute())

    def drain(self, phase: str, deliveries: list[tuple[str, str]]) -> tuple[float, Counter[str]]:
        started = time.monotonic()
        plan = self.schedule()
        last_print = 0.0
        self._last_done = -1
        while True:
            elapsed = time.monotonic() - started
            while plan and plan[0][0] <= elapsed:
                plan.pop(0)[1]()
            try:
                counts = self.statuses(deliveries)
            except Exception:
                time.sleep(0.2)
                continue
            done = counts["finished"] + counts["failed"]
            self.supervise(done, elapsed)
            if elapsed - last_print >= 5:
                last_print = elapsed
                print(
                    f"  {phase:7} {elapsed:6.1f}s  {done}/{len(deliveries)} deliveries done  "
                    + " ".join(f"{k}={v}" for k, v in sorted(counts.items())),
                    flush=True,
                )
            if done == len(deliveries) and not plan:
                return elapsed, counts
            if elapsed > self.args.bound:
                return elapsed, counts
            time.sleep(0.5)

    def phase_figures(
        self, phase: str, deliveries: list[tuple[str, str]], elapsed: float
    ) -> dict[str, Any]:
        """Drain time, requeues and wait-to-start of one phase (from the jobs' meta)."""
        from rq.job import Job

        waits: list[float] = []
        requeues = 0
        for job in Job.fetch_many([job_id for job_id, _ in deliveries], connection=self.rq()):
            state = (job.get_meta(refresh=False) if job else {}).get("joblock", {})
            requeues += int(state.get("requeues", 0))
            if state.get("outcome") in ("ran", "replayed") and "waited" in state:
                waits.append(float(state["waited"]))
        waits.sort()

        def at(q: float) -> float | None:
            return round(waits[min(len(waits) - 1, int(q * len(waits)))], 2) if waits else None

        return {
            "deliveries": len(deliveries),
            "drain_seconds": round(elapsed, 1),
            "requeues": requeues,
            "wait_to_start_p50_s": at(0.5),
            "wait_to_start_p99_s": at(0.99),
            "wait_to_start_max_s": round(waits[-1], 2) if waits else None,
        }

    def unapplied_jobs(self, applied: dict[str, int]) -> tuple[list[str], list[str]]:
        """The logical jobs never applied: (those whose every delivery failed visibly, those
        lost)."""
        failed_visibly, lost = [], []
        by_logical: dict[str, list[str]] = defaultdict(list)
        for job_id, logical_id in self.deliveries:
            by_logical[logical_id].append(job_id)
        for logical_id in self.logical:
            if applied.get(logical_id):
                continue
            reasons = [
                self.rq().hget(f"rq:job:{job_id}", "status") for job_id in by_logical[logical_id]
            ]
            if reasons and all(r == b"failed" for r in reasons):
                failed_visibly.append(logical_id)
            else:
                lost.append(logical_id)
        return failed_visibly, lost

    def ledger_damage(self) -> tuple[list[str], list[str]]:
        """From the effects, in the order applied: (the resources whose balance is not the sum
        of their deltas, the resources whose accepted fences did not increase)."""
        from .models import Balance, Effect

        sums: dict[str, int] = defaultdict(int)
        fences: dict[str, list[int]] = defaultdict(list)
        for resource, delta, fence in Effect.objects.order_by("id").values_list(
            "resource", "delta", "fence"
        ):
            sums[resource] += delta
            if fence is not None:
                fences[resource].append(fence)
        wrong_sums = [b.name for b in Balance.objects.all() if b.value != sums.get(b.name, 0)]
        unordered = [
            r for r, seq in fences.items() if any(b <= a for a, b in itertools.pairwise(seq))
        ]
        return wrong_sums, unordered

    def findings_per_phase(
        self,
        applied: dict[str, int],
        unapplied: dict[str, list[str]],
        damaged: dict[str, list[str]],
    ) -> None:
        """Add the same findings per phase to its figures (a phase's resources and logical
        jobs are its own): ``unapplied`` and ``damaged`` map a finding to its logical jobs and
        to its resources."""
        in_phase = Counter[tuple[str, str]]()
        for logical_id, (resource, _delta) in self.logical.items():
            phase = self.phase_of[resource]
            in_phase[phase, "logical_jobs"] += 1
            n = applied.get(logical_id, 0)
            in_phase[phase, "applied_once"] += n == 1
            in_phase[phase, "double_effects"] += n > 1
        for finding, ids in unapplied.items():
            for logical_id in ids:
                in_phase[self.phase_of[self.logical[logical_id][0]], finding] += 1
        for finding, resources in damaged.items():
            for resource in resources:
                in_phase[self.phase_of[resource], finding] += 1
        findings = ("logical_jobs", "applied_once", "double_effects", "lost_updates_resources")
        findings += ("stale_writes_accepted", "failed_visibly", "lost_jobs")
        for phase, figures in self.phases.items():
            figures.update({finding: in_phase[phase, finding] for finding in findings})

    def check(self, elapsed: float, counts: Counter[str]) -> dict[str, Any]:
        from .models import Effect

        applied: dict[str, int] = Counter(Effect.objects.values_list("logical_id", flat=True))
        double = sum(1 for n in applied.values() if n > 1)
        failed_visibly, lost = self.unapplied_jobs(applied)
        wrong_sums, unordered = self.ledger_damage()
        self.findings_per_phase(
            applied,
            {"failed_visibly": failed_visibly, "lost_jobs": lost},
            {"lost_updates_resources": wrong_sums, "stale_writes_accepted": unordered},
        )
        from django_redis import get_redis_connection

        from django_joblock import backend, metrics

        # This process's pooled connections died with the Redis restart: start afresh (the
        # cache's pool, and the locks' own clients, which the metrics read through).
        get_redis_connection("default").connection_pool.disconnect()
        backend.forget()
        totals = metrics.totals()
        return {
            "mode": "safe" if self.safe else "negative control (no fencing, no idempotency)",
            "workers": self.args.workers,
            "logical_jobs": len(self.logical),
            "deliveries": len(self.deliveries),
            "resources": self.args.resources,
            "phases": self.phases,
            "faults": self.faults,
            "drain_seconds": round(elapsed, 1),
            "drain_bound_seconds_per_phase": self.args.bound,
            "drained": counts["finished"] + counts["failed"] == len(self.deliveries),
            "deliveries_finished": counts["finished"],
            "deliveries_failed": counts["failed"],
            "effects_applied_once": sum(1 for n in applied.values() if n == 1),
            "double_effects": double,
            "lost_updates_resources": len(wrong_sums),
            "stale_writes_accepted": len(unordered),
            "stale_writes_rejected": totals.total("stale_fence_rejections"),
            "duplicates_blocked": totals.total("duplicates_blocked"),
            "locks_lost": totals.total("lost"),
            "requeues": totals.total("requeued"),
            "failed_visibly": len(failed_visibly),
            "lost_jobs": len(lost),
            "lost_job_ids": lost[:20],
            "undone_deliveries": self.undone(),
        }

    def run(self) -> dict[str, Any]:
        """Start the workers, drain each phase under the faults, check; tear down always."""
        try:
            self.start_worker(scheduler=True)
            for _ in range(self.args.workers - 1):
                self.start_worker()
            total, counts = 0.0, Counter[str]()
            phases = [("uniform", self.args.jobs), ("hot", self.args.hot_jobs)]
            phases += [("loaded", self.args.loaded_jobs)]
            phases += [("tasks", getattr(self.args, "tasks_jobs", 0))]  # (not in failover.py)
            for phase, jobs in phases:
                if not jobs:
                    continue
                load = BusyCores() if phase == "loaded" else contextlib.nullcontext()
                deliveries = self.enqueue(phase, jobs)
                print(
                    f"phase {phase}: {len(deliveries)} deliveries of {jobs} logical jobs over "
                    f"{len(self.resources(phase)[0])} resources; {self.args.workers} workers; "
                    f"logs in {self.crew.log_dir}",
                    flush=True,
                )
                with load:
                    elapsed, phase_counts = self.drain(phase, deliveries)
                total += elapsed
                counts += phase_counts
                self.phases[phase] = self.phase_figures(phase, deliveries, elapsed)
                if isinstance(load, BusyCores):  # the evidence that the load was real
                    self.phases[phase]["busy_processes"] = load.count
                    self.phases[phase]["busy_cpu_seconds"] = round(load.cpu, 1)
                self.phase_done(phase)
            report = self.check(total, counts)
            self.add_figures(report)
            return report
        finally:
            self.teardown()

    def phase_done(self, phase: str) -> None:
        """A phase drained (a subclass may change the faults of the next one)."""

    def add_figures(self, report: dict[str, Any]) -> None:
        """More figures for the report, read before the teardown (for subclasses)."""

    def undone(self) -> list[str]:
        """Where each delivery that never finished is stuck (for the report)."""
        found = []
        queue_ids = {raw.decode() for raw in self.rq().lrange("rq:queue:chaos", 0, -1)}
        pending = {raw.decode() for raw in self.rq().lrange("rq:queue:chaos:intermediate", 0, -1)}
        for job_id, logical_id in self.deliveries:
            status = (self.rq().hget(f"rq:job:{job_id}", "status") or b"missing").decode()
            if status in ("finished", "failed"):
                continue
            where = [
                name
                for name, ids in (("queue", queue_ids), ("intermediate", pending))
                if job_id in ids
            ]
            if self.rq().zscore("rq:scheduled:chaos", job_id) is not None:
                where.append("scheduled registry")
            started = [
                m.decode()
                for m in self.rq().zrange("rq:wip:chaos", 0, -1)
                if m.decode().startswith(job_id)
            ]
            if started:
                where.append("started registry")
            where.extend(self.parked(job_id))
            found.append(f"{logical_id} {job_id[:8]} {status} in {where or 'nowhere'}")
        return found[:20]

    def parked(self, job_id: str) -> list[str]:
        """Where a job parked by admission waits: its rate limit key and the slot's holders
        with their statuses (a holder that never ends keeps the others parked)."""
        raw_key = self.rq().hget(f"rq:job:{job_id}", "rate_limit_key")
        if raw_key is None:
            return []
        key = raw_key.decode()
        if self.rq().zscore(f"rq:rl:{key}:rate_limited", job_id) is None:
            return []
        logical_of = dict(self.deliveries)
        holders = []
        for raw_holder in self.rq().zrange(f"rq:rl:{key}:allowed", 0, -1):
            holder = raw_holder.decode()
            status = self.rq().hget(f"rq:job:{holder}", "status") or b"missing"
            holders.append(f"{logical_of.get(holder, holder)} {status.decode()}")
        return [f"parked on {key} behind {holders}"]


def finish(report: dict[str, Any], ok: bool, text: str, json_path: str | None) -> int:
    """Print the report with its verdict, write it as JSON if asked; the exit status."""
    report["verdict"] = text
    print_table(report, text)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


def verdict(report: dict[str, Any]) -> tuple[bool, str]:
    damage = (
        report["double_effects"]
        + report["lost_updates_resources"]
        + report["stale_writes_accepted"]
        + report["lost_jobs"]
    )
    if report["mode"] == "safe":
        ok = damage == 0 and report["drained"] and len(report["faults"]) >= 4
        return ok, "PASS: no damage" if ok else "FAIL: damage or not drained"
    if damage > 0:
        return True, f"VALID negative control: {damage} damage findings without the protections"
    return False, "INVALID: the negative control showed no damage; the faults did not bite"


def print_table(report: dict[str, Any], text: str) -> None:
    print(f"\nChaos report ({report['mode']})")
    width = max(len(key) for key in report)
    for key, value in report.items():
        if key == "faults":
            for fault in value:
                print(f"  {'fault':<{width}}  {fault}")
        elif key == "phases":
            for phase, figures in value.items():
                shown = ", ".join(f"{k} {v}" for k, v in figures.items())
                print(f"  {'phase ' + phase:<{width}}  {shown}")
        else:
            print(f"  {key:<{width}}  {value}")
    print(f"\n{text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", action="store_true", help="4 x 200 x 10, for CI")
    parser.add_argument(
        "--negative", action="store_true", help="negative control: fencing and idempotency off"
    )
    parser.add_argument("--workers", type=int)
    parser.add_argument("--jobs", type=int, help="logical jobs of the uniform phase")
    parser.add_argument("--hot-jobs", type=int, help="logical jobs of the hot phase (0: none)")
    parser.add_argument("--loaded-jobs", type=int, help="logical jobs of the loaded phase")
    parser.add_argument("--tasks-jobs", type=int, help="logical jobs of the tasks phase")
    parser.add_argument("--resources", type=int, help="resources of the uniform phase")
    parser.add_argument("--kills", type=int)
    parser.add_argument("--pauses", type=int)
    parser.add_argument("--bound", type=float, help="seconds the queues must drain within")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-network", action="store_true", help="skip the proxy faults")
    parser.add_argument("--no-restart", action="store_true", help="skip the Redis restart")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    names = ("workers", "jobs", "hot_jobs", "loaded_jobs", "tasks_jobs", "resources")
    names += ("kills", "pauses", "bound")
    short = dict(zip(names, (4, 200, 100, 100, 100, 10, 2, 1, 240), strict=True))
    full = dict(zip(names, (8, 2000, 1000, 1000, 1000, 50, 5, 3, 900), strict=True))
    for key, value in (short if args.short else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    chaos = Chaos(args)
    chaos.setup()
    report = chaos.run()
    return finish(report, *verdict(report), args.json)


if __name__ == "__main__":
    sys.exit(main())
