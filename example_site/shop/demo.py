"""The scenario behind ``manage.py joblock_demo``: real RQ workers, duplicates, a killed work
horse, a horse paused past its lock TTL, and a report whose invariants are checked.

Kept apart from the command so that tests and the command share one implementation.
"""

from __future__ import annotations

import itertools
import os
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, TextIO

from tests.procs import redis_server
from tests.procs.provider import FakeProvider
from tests.procs.redis_server import RedisServer, RedisServerError, answering
from tests.procs.workers import WorkerProcesses, joblock_worker_args

ROOT = Path(__file__).resolve().parent.parent.parent
PAUSE = 6.0  # seconds a work horse is stopped (its lock TTL is 2 s)


class DemoError(Exception):
    """The demo cannot run here (no Redis, ...); the message says what to do."""


@dataclass
class Report:
    lines: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def fact(self, label: str, value: object) -> None:
        self.lines.append((label, str(value)))

    def check(self, ok: bool, label: str, detail: str) -> None:
        self.lines.append((("PASS " if ok else "FAIL ") + label, detail))
        if not ok:
            self.failures.append(label)


def redis_url_or_private(out: TextIO) -> tuple[str, RedisServer | None]:
    """``REDIS_URL`` (default 127.0.0.1:6379/0) if it answers; else a private redis-server,
    returned so that the caller stops it."""
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if answering(url):
        return url, None
    if not redis_server.available():
        raise DemoError(
            f"No Redis answers at {url} and redis-server is not installed.\n"
            "Install Redis (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew "
            "install redis) or point REDIS_URL at one, then run the demo again."
        )
    private = RedisServer()
    try:
        private.start()
    except RedisServerError as exc:
        private.stop()
        raise DemoError(str(exc)) from exc
    out.write(f"No Redis at {url}: started a private redis-server on port {private.port}.\n")
    return private.url(), private


class Demo:
    def __init__(self, out: TextIO, *, short: bool, redis_url: str) -> None:
        self.out = out
        self.short = short
        self.redis_url = redis_url
        self.crew = WorkerProcesses(cwd=ROOT, log_dir=tempfile.mkdtemp(prefix="joblock-demo-"))
        self.provider = FakeProvider()  # the mail provider: records every real send
        # the workers (they inherit it) and this process's outbox sweep deliver to it
        os.environ["JOBLOCK_DEMO_PROVIDER"] = self.provider.url
        self.jobs: list[Any] = []
        self.tasks: list[Any] = []  # TaskResults of the Django task (shop/tasks.py)
        self.expected_refunds: dict[str, tuple[int, Decimal]] = {}
        self.faults: list[str] = []

    # -- setup ---------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def reset(self) -> None:
        from django_redis import get_redis_connection

        from django_joblock.models import IdempotencyRecord, OutboxMessage

        from .jobs import ALL
        from .models import Order, Receipt, Refund, Tenant
        from .tasks import ALL as TASKS

        Receipt.objects.all().delete()
        Refund.objects.all().delete()
        Order.objects.all().delete()
        Tenant.objects.all().delete()
        scopes = [job.spec.name for job in [*ALL, *TASKS]]
        IdempotencyRecord.objects.filter(scope__in=scopes).delete()
        OutboxMessage.objects.filter(key__startswith="receipt:").delete()
        client = get_redis_connection("default")
        for key in client.smembers("demo:keys"):
            client.delete(key)
        client.delete("demo:keys", "demo:started")
        # The demo owns its queue: a scheduler lock left by an earlier run that was killed would
        # keep this run's scheduler out for a minute.
        client.delete("rq:scheduler-lock:demo")

    def seed(self) -> tuple[list[int], list[int]]:
        from .models import Order, Tenant

        tenants = [Tenant.objects.create(name=f"tenant-{i}") for i in range(3)]
        orders = [
            Order.objects.create(tenant=tenants[i % 3], amount=Decimal("100.00"))
            for i in range(6 if self.short else 12)
        ]
        return [t.pk for t in tenants], [o.pk for o in orders]

    def start_workers(self, count: int) -> None:
        env = dict(os.environ, REDIS_URL=self.redis_url, PYTHONUNBUFFERED="1")
        for index in range(count):
            args = joblock_worker_args(
                "demo",
                manage_py=ROOT / "manage.py",
                name=f"demo-{os.getpid()}-{index}",
                with_scheduler=index == 0,
            )
            self.crew.start(args, env=env)

    def stop_workers(self) -> None:
        # SIGTERM first: a warm shutdown lets the scheduler give its lock back, so the next
        # demo run gets a scheduler at once. Then make sure nothing is left behind.
        self.crew.stop(grace=10)

    def enqueue(self, tenants: list[int], orders: list[int]) -> None:
        from rq import Retry

        from .jobs import rebuild_tenant_cache, refund_order, send_receipt

        retry = Retry(max=3, interval=1)
        for order in orders:
            for n in range(2):
                refund_id = f"R-{order}-{n}"
                amount = "10.00" if n == 0 else "2.50"
                self.expected_refunds[refund_id] = (order, Decimal(amount))
                copies = 3 if (order + n) % 3 == 0 else 2  # duplicate deliveries
                for _ in range(copies):
                    self.jobs.append(
                        refund_order.enqueue_call((order, refund_id, amount), retry=retry)
                    )
            for _ in range(2):
                self.jobs.append(send_receipt.enqueue_call((order,), retry=retry))
        for tenant in tenants:
            for _ in range(3):
                self.jobs.append(rebuild_tenant_cache.enqueue_call((tenant,), retry=retry))
        self.enqueue_task(orders[0])

    def enqueue_task(self, order: int) -> None:
        """A goodwill refund as a Django task, enqueued twice: it must apply once."""
        from .tasks import goodwill_refund

        refund_id = f"G-{order}"
        self.expected_refunds[refund_id] = (order, Decimal("5.00"))
        for _ in range(2):
            self.tasks.append(goodwill_refund.enqueue(order, refund_id, "5.00"))

    # -- faults --------------------------------------------------------------------------
    def _running_refund(self, exclude: set[int]) -> tuple[int, int] | None:
        """(horse pid, order id) of a refund running right now, if any."""
        from django_redis import get_redis_connection

        client = get_redis_connection("default")
        worker_pids = {proc.pid for proc in self.crew.procs}
        for raw in reversed(client.lrange("demo:started", -20, -1)):
            pid_s, name, _at = raw.decode().split("|")
            pid = int(pid_s)
            if name.startswith("refund") and pid not in worker_pids | exclude:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                return pid, int(name.split()[1].split("-")[1])
        return None

    def kill_one(self) -> int | None:
        found = self._running_refund(set())
        if found is None:
            return None
        os.kill(found[0], signal.SIGKILL)
        self.faults.append(
            f"SIGKILL work horse {found[0]} in the middle of a refund of order "
            f"{found[1]} (RQ retries it)"
        )
        return found[0]

    def pause_one(self, exclude: set[int]) -> int | None:
        from .jobs import refund_order

        found = self._running_refund(exclude)
        if found is None:
            return None
        pid, order = found
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        if not _is_stopped(pid):  # it had just ended (a zombie ignores SIGSTOP): next second
            exclude.add(pid)
            return None
        # Another refund of the same order, enqueued now. Admission parks it behind the paused
        # job, which keeps the order's slot: it runs once the paused job, resumed, has been
        # aborted (its lock expired meanwhile). A holder outside admission would take the
        # expired lock instead and the fence would refuse the paused one's late write: the
        # chaos suite (docs/chaos.md) shows that case.
        refund_id = f"R-{order}-late"
        self.expected_refunds[refund_id] = (order, Decimal("1.00"))
        self.jobs.append(refund_order.enqueue_call((order, refund_id, "1.00"), at_front=True))
        time.sleep(PAUSE)  # well past the 2 s lock TTL
        os.kill(pid, signal.SIGCONT)
        self.faults.append(
            f"SIGSTOP work horse {pid} for {time.monotonic() - stopped:.0f} s (lock TTL 2 s) "
            "during a "
            f"refund of order {order}; its lock expired, so on SIGCONT it is aborted with LockLost"
        )
        return pid

    # -- run -----------------------------------------------------------------------------
    def statuses(self, ids: list[str] | None = None) -> Counter[str]:
        """RQ statuses of the jobs (default) or of the RQ jobs with these ids (the tasks')."""
        from rq.job import Job

        from django_joblock.jobs.queues import get_queue

        from .jobs import QUEUE

        connection = get_queue(QUEUE).connection
        ids = [job.id for job in self.jobs] if ids is None else ids
        found = Job.fetch_many(ids, connection=connection)
        return Counter(job.get_status(refresh=False).value if job else "missing" for job in found)

    def tasks_done(self) -> int:
        counts = self.statuses([result.id for result in self.tasks])
        return counts["finished"] + counts["failed"] + counts["missing"]

    def wait(self, limit: float) -> Counter[str]:
        started = time.monotonic()
        killed = paused = None
        ended: set[int] = set()
        while True:
            counts = self.statuses()
            done = counts["finished"] + counts["failed"] + counts["missing"]
            tasks = self.tasks_done()
            elapsed = time.monotonic() - started
            self.say(
                f"  {elapsed:5.1f}s  jobs {done}/{len(self.jobs)} done  "
                + "  ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                + f"  tasks {tasks}/{len(self.tasks)} done"
            )
            if tasks < len(self.tasks):
                done = -1  # not done until the tasks are
            if killed is None and elapsed > 2:
                killed = self.kill_one()
                ended.update([killed] if killed else [])
            if killed is not None and paused is None and elapsed > 4:
                paused = self.pause_one(ended)
            if done == len(self.jobs) and killed is not None and paused is not None:
                return counts
            if done == len(self.jobs) and elapsed > 20:
                return counts
            if elapsed > limit:
                return counts
            time.sleep(1.0)

    def report(self, counts: Counter[str], metrics_before: Any, elapsed: float) -> Report:
        from django.db.models import Count, Sum

        from django_joblock import metrics
        from django_joblock.metrics import flush_now

        from .models import Order, Receipt, Refund

        flush_now()
        after = metrics.totals()
        report = Report()
        metas = [job.get_meta(refresh=True).get("joblock", {}) for job in self.jobs]
        outcomes = Counter(meta.get("outcome", "ran") for meta in metas)
        report.fact("jobs enqueued (incl. duplicate deliveries)", len(self.jobs))
        report.fact("jobs finished / failed", f"{counts['finished']} / {counts['failed']}")
        report.fact("job bodies run to completion", outcomes["ran"])
        report.fact("duplicates blocked (replayed results)", outcomes["replayed"])
        report.fact("requeues for lock contention", sum(m.get("requeues", 0) for m in metas))
        waits = sorted(float(m["waited"]) for m in metas if "waited" in m)
        if waits:
            p50 = waits[len(waits) // 2]
            p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
            report.fact("wait from enqueue to start p50 / p99", f"{p50:.1f}s / {p99:.1f}s")
        admitted = sum(1 for m in metas if m.get("admission") == "rate_limit")
        report.fact("locked jobs started one at a time per order/tenant (admission)", admitted)

        def delta(metric: str) -> int:
            return after.total(metric) - metrics_before.total(metric)

        report.fact("busy acquires (contention)", delta("contended"))
        report.fact("stale writes fenced (StaleFence)", delta("stale_fence_rejections"))
        report.fact("locks lost while held", delta("lost"))
        for fault in self.faults:
            report.fact("fault injected", fault)
        refunds = Counter(Refund.objects.values_list("refund_id", flat=True))
        missing = set(self.expected_refunds) - set(refunds)
        report.check(
            not missing
            and all(n == 1 for n in refunds.values())
            and set(refunds) == set(self.expected_refunds),
            "every refund applied exactly once",
            f"{len(refunds)} of {len(self.expected_refunds)} refunds; missing "
            f"{sorted(missing) or 'none'}",
        )
        sums = {
            row["order"]: row
            for row in Refund.objects.values("order").annotate(total=Sum("amount"), n=Count("id"))
        }
        wrong = [
            o.pk
            for o in Order.objects.all()
            if o.refunded != sums.get(o.pk, {}).get("total", Decimal("0"))
            or o.refund_count != sums.get(o.pk, {}).get("n", 0)
        ]
        report.check(
            not wrong,
            "order balances equal the sum of their refunds",
            f"mismatched orders: {wrong or 'none'}",
        )
        from django_redis import get_redis_connection

        from django_joblock import outbox

        client = get_redis_connection("default")
        swept = outbox.deliver_due()  # what a worker that died after its commit left pending
        emails, calls = self.provider.sends, len(self.provider.calls)
        receipts = Receipt.objects.count()
        orders = Order.objects.count()
        report.check(
            receipts == orders == emails and swept.pending == 0,
            "one receipt e-mail per order",
            f"{receipts} receipts, {emails} e-mails sent ({calls} provider calls), {orders} orders",
        )
        overlaps = self.overlaps(client)
        report.check(
            not overlaps,
            "overlaps of committed critical sections",
            f"{len(overlaps)}" + (f": {overlaps[:3]}" if overlaps else ""),
        )
        report.check(
            counts["finished"] == len(self.jobs),
            "no job lost or left failed",
            f"{counts['finished']} of {len(self.jobs)} finished",
        )
        report.check(*self.task_check())
        report.check(
            len(self.faults) == 2,
            "faults really injected",
            f"{len(self.faults)} of 2 (a killed horse, a paused horse)",
        )
        report.fact("wall time", f"{elapsed:.0f}s")
        return report

    def task_check(self) -> tuple[bool, str, str]:
        """The Django task enqueued twice: both results successful with the same return
        value, one run and one replay (the outcome in RQ's job meta, as for the jobs)."""
        from django_joblock.jobs.queues import get_queue
        from django_joblock.jobs.rq_tasks import Job

        from .jobs import QUEUE

        connection = get_queue(QUEUE).connection
        statuses, values, outcomes = [], [], []
        for result in self.tasks:
            result.refresh()
            statuses.append(str(result.status))
            values.append(result.return_value if str(result.status) == "SUCCESSFUL" else None)
            meta = Job.fetch(result.id, connection=connection).get_meta(refresh=True)
            outcomes.append(meta.get("joblock", {}).get("outcome", "?"))
        ok = (
            statuses == ["SUCCESSFUL"] * len(self.tasks)
            and sorted(outcomes) == ["ran", "replayed"]
            and values[0] is not None
            and values.count(values[0]) == len(values)
        )
        detail = (
            f"{len(self.tasks)} enqueues: {', '.join(statuses)}; {' + '.join(sorted(outcomes))}"
        )
        return ok, "a Django task (@locked_task) enqueued twice applied once", detail

    def overlaps(self, client: Any) -> list[str]:
        from .models import Order, Tenant

        found = []
        resources = [f"order:{pk}" for pk in Order.objects.values_list("pk", flat=True)]
        resources += [f"tenant:{pk}" for pk in Tenant.objects.values_list("pk", flat=True)]
        for resource in resources:
            spans = sorted(
                tuple(map(float, raw.decode().split(":")))
                for raw in client.lrange(f"demo:intervals:{resource}", 0, -1)
            )
            for (_s1, e1), (s2, _e2) in itertools.pairwise(spans):
                if s2 < e1:
                    found.append(resource)
        return found

    def run(self) -> Report:
        from django_joblock import metrics

        from .jobs import QUEUE

        self.reset()
        tenants, orders = self.seed()
        before = metrics.totals()
        self.say(
            f"Seeded {len(tenants)} tenants and {len(orders)} orders. Starting 4 RQ "
            f"workers on queue {QUEUE!r} (logs in {self.crew.log_dir})."
        )
        self.start_workers(4)
        started = time.monotonic()
        try:
            self.enqueue(tenants, orders)
            self.say(
                f"Enqueued {len(self.jobs)} jobs: 2 refunds per order, each delivered 2-3 "
                "times with different job ids; 2 receipt jobs per order; 3 cache "
                "rebuilds per tenant."
            )
            counts = self.wait(limit=100 if self.short else 150)
        finally:
            self.stop_workers()
        try:
            return self.report(counts, before, time.monotonic() - started)
        finally:
            self.provider.close()


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal now (Linux ``/proc``; elsewhere assumed)."""
    deadline = time.monotonic() + 1.0
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return not os.path.isdir("/proc/self")  # ended, or no /proc to ask
        if state in "tT" or time.monotonic() > deadline:
            return state in "tT"
        time.sleep(0.01)  # SIGSTOP is delivered asynchronously
