"""Locks through Redis Sentinel: a real primary, a replica and three sentinels.

django-redis' ``SentinelClient`` carries the locks. A failover (the primary SIGKILLed, the
replica promoted by the sentinels) is followed by the lock manager, the lean command path and
the renewal thread without a restart. A failover that forgets a lock (replication held back by
a black-holed proxy between primary and replica) makes the heartbeat declare it LOST, and the
fence refuses the stale holder's late write; the same write without the fence gets through
(the negative control). ``REPLICA_ACKS`` makes an acquire wait for the replica and refuse a
lock only the primary has.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from rq import Retry, Worker
from rq.job import JobStatus
from rq.worker import WorkerStatus

from django_joblock import LockBackendUnavailable, StaleFence, fenced_update, lock
from django_joblock.jobs import admission
from tests.harness import Proxy, wait_for
from tests.procs.redis_server import free_port
from tests.procs.topologies import SentinelGroup, sentinel_cache, sentinel_queue
from tests.sentinel_jobs import add_one, hold
from tests.testapp.models import Account
from tests.workers import Workers

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
_NAMES = itertools.count()


class Setup:
    def __init__(self, group: SentinelGroup, link: Proxy) -> None:
        self.group, self.link = group, link

    def primary(self) -> redis.Redis:
        return self.group.server(self.group.primary_port()).client()


@pytest.fixture
def sentinel(settings: Any) -> Iterator[Setup]:
    """A fresh Sentinel setup, replicating through a proxy the test can black-hole, as the
    locks' Redis (cache alias ``sentinel``)."""
    links: list[Proxy] = []

    def via(primary_port: int) -> int:
        links.append(Proxy(free_port(), primary_port))
        return links[0].listen_port

    # A service name of its own: django-redis keeps a pool per LOCATION for the process's
    # life, and one of an earlier test would ask that test's (stopped) sentinels.
    group = SentinelGroup(replicate_via=via, master_name=f"joblock{next(_NAMES)}")
    group.start()
    cache = sentinel_cache(group.addresses, group.master_name)
    settings.CACHES = {**settings.CACHES, "sentinel": cache}
    settings.JOBLOCK = {**getattr(settings, "JOBLOCK", {}), "REDIS_ALIAS": "sentinel"}
    yield Setup(group, links[0])
    group.stop()
    links[0].close()


def renewals(client: redis.Redis, resource: str) -> int:
    return int(client.hget(f"joblock:{{{resource}}}:lock", "renewals") or 0)


def test_locks_and_their_heartbeat_follow_a_failover(sentinel):
    held = lock("order:1", ttl=6)
    assert held.acquire()
    sentinel.group.wait_replicated()
    old = sentinel.group.primary_port()
    new = sentinel.group.fail_over()
    assert new != old
    # The renewal thread renews on the new primary: no restart, no lost lock.
    assert wait_for(lambda: renewals(sentinel.primary(), "order:1") > 0, timeout=15)
    assert not held.lost
    assert held.renew()
    other = lock("order:2", ttl=5)
    assert other.acquire() and other.fence > held.fence  # type: ignore[operator]
    other.release()
    held.release()
    assert not sentinel.primary().exists("joblock:{order:1}:lock")


def test_a_lock_the_failover_forgot_is_lost_and_its_late_write_refused(sentinel):
    Account.objects.create(name="acct")
    rows = Account.objects.filter(name="acct")
    sentinel.link.set("blackhole")  # the replica hears nothing from now on
    stale = lock("acct:1", ttl=6)
    assert stale.acquire()
    assert not sentinel.group.replicas[0].client().exists("joblock:{acct:1}:lock")
    sentinel.group.fail_over()
    # Negative control: the new primary really forgot the lock.
    assert not sentinel.primary().exists("joblock:{acct:1}:lock")
    fresh = lock("acct:1", ttl=6)
    assert fresh.acquire(), "the failover forgot the lock: a second holder gets in"
    assert fresh.fence > stale.fence  # type: ignore[operator]
    fenced_update(rows, fresh.fence, balance=10)
    # The heartbeat sees the key gone (or no longer its token) and declares the lock lost...
    assert wait_for(lambda: stale.lost, timeout=15)
    # ... and the database refuses the stale holder's late write.
    with pytest.raises(StaleFence):
        fenced_update(rows, stale.fence, balance=666)
    assert rows.get().balance == 10
    # Without the fence the same late write gets through: the damage the fence prevents.
    rows.update(balance=666)
    assert rows.get().balance == 666
    fresh.release()


def test_replica_acks_wait_for_the_replica(sentinel, settings):
    settings.JOBLOCK = {**settings.JOBLOCK, "REPLICA_ACKS": 1, "REPLICA_ACK_TIMEOUT": 0.3}
    held = lock("order:9", ttl=5)
    assert held.acquire()
    # The acquire returned after the replica had the lock.
    assert sentinel.group.replicas[0].client().exists("joblock:{order:9}:lock")
    held.release()
    kept = lock("order:11", ttl=5, heartbeat=False)
    assert kept.acquire()
    sentinel.link.set("blackhole")
    # A manual renewal the replica did not get counts for nothing (it renewed on the old
    # primary alone after a failover, extending a lock the promoted primary lets expire).
    valid_until = kept.valid_until
    with pytest.raises(LockBackendUnavailable, match=r"Renewal not counted.*REPLICA_ACKS"):
        kept.renew()
    assert kept.valid_until == valid_until
    refused = lock("order:10", ttl=5)
    started = time.monotonic()
    with pytest.raises(LockBackendUnavailable, match=r"REPLICA_ACKS.*not acquired"):
        refused.acquire()
    assert time.monotonic() - started >= 0.3
    # Given back, not left to block the resource for its TTL.
    assert not sentinel.primary().exists("joblock:{order:10}:lock")
    # Negative control: without REPLICA_ACKS the same acquire succeeds on the primary alone.
    settings.JOBLOCK = {**settings.JOBLOCK, "REPLICA_ACKS": 0}
    alone = lock("order:10", ttl=5)
    assert alone.acquire()
    alone.release()
    assert kept.renew() and kept.valid_until > valid_until
    kept.release()


@pytest.mark.parametrize("acks", [1, 0])
def test_after_a_graceful_failover_a_lock_has_one_holder_with_replica_acks(
    sentinel, settings, acks
):
    """``SENTINEL FAILOVER``: the old primary takes writes for about 10 s more, and the holder's
    connections stay on it. Its renewals there did count (the reviewer's reproduction): the
    promoted primary let the lock expire, anyone could take it there, and the holder still held
    it. With ``REPLICA_ACKS`` a renewal needs a replica, which the old primary no longer has:
    the holder declares the lock lost before it expires on the promoted primary. Without it
    (the negative control) both hold it: the fault really happened."""
    settings.JOBLOCK = {**settings.JOBLOCK, "REPLICA_ACKS": acks, "REPLICA_ACK_TIMEOUT": 0.2}
    held = lock("acct:7", ttl=3)  # renewed every second; shorter than the ~10 s demotion
    assert held.acquire()
    sentinel.group.wait_replicated()
    old = sentinel.group.primary_port()
    new = sentinel.group.fail_over(graceful=True)
    key = "joblock:{acct:7}:lock"
    # The promoted primary had the lock, then lets it expire: a newcomer there would get it.
    promoted = sentinel.group.server(new).client()
    assert wait_for(lambda: not promoted.exists(key), timeout=20)
    old_role = sentinel.group.server(old).client().info("replication")["role"]
    assert old_role == "master", "the old primary was demoted already: no window left to test"
    if acks:
        assert held.lost, "the holder still believes it holds a lock anyone can take"
        assert "renewals failing" in held.lost_reason or "deadline" in held.lost_reason
    else:
        assert held.held and not held.lost, "negative control: no second holder was possible"
    held.release()


class SentinelWorkers(Workers):
    """Worker processes with ``tests.settings_sentinel``: locks and queues on ``group``."""

    def __init__(self, group: SentinelGroup, joblock: dict[str, Any] | None = None) -> None:
        super().__init__(joblock, extra_args=["--maintenance-interval", "5"])
        self.group = group

    def env(self) -> dict[str, str]:
        env = super().env()
        env["DJANGO_SETTINGS_MODULE"] = "tests.settings_sentinel"
        env["JOBLOCK_TEST_SENTINELS"] = ",".join(f"{h}:{p}" for h, p in self.group.addresses)
        env["JOBLOCK_TEST_MASTER"] = self.group.master_name
        return env


def test_workers_and_queues_follow_a_failover(sentinel, settings):
    """Real RQ workers, queues on django-rq's Sentinel settings, locks on django-redis'
    SentinelClient: the primary is killed mid-run and the same worker processes (no restart)
    finish every job, each effect applied once."""
    import django_rq

    group = sentinel.group
    settings.RQ_QUEUES = {"default": sentinel_queue(group.addresses, group.master_name)}

    accounts = ["a", "b", "c"]
    for name in accounts:
        Account.objects.create(name=name)
    queue = django_rq.get_queue("default")
    # A short job_timeout: a job whose end the failover forgot (replication is asynchronous)
    # is back in RQ's started registry with no worker on it; RQ's own registry maintenance
    # retries it once its timeout has passed (the idempotency key replays it if it had run).
    retry = Retry(max=3)
    jobs = [
        add_one.enqueue_call((accounts[n % 3], n), job_timeout=8, retry=retry) for n in range(120)
    ]
    sentinel.group.wait_replicated()  # what was enqueued is on the replica too
    crew = SentinelWorkers(sentinel.group)
    try:
        pids = {crew.start(scheduler=True).pid, crew.start().pid}
        assert wait_for(lambda: Account.objects.filter(balance__gt=0).count() == 3, timeout=30)

        def finished_count() -> int:
            return sum(job.get_status(refresh=True) == JobStatus.FINISHED for job in jobs)

        assert finished_count() < len(jobs), "the failover must come mid-run"
        old = sentinel.group.primary_port()
        assert sentinel.group.fail_over() != old
        queue.connection.connection_pool.disconnect()

        def finished() -> bool:
            return finished_count() == len(jobs)

        assert wait_for(finished, timeout=120), [
            (job.id, job.get_status(refresh=True), job.latest_result())
            for job in jobs
            if not job.is_finished
        ]
        assert {proc.pid for proc in crew.procs if proc.poll() is None} == pids  # no restart
    finally:
        crew.stop()
    assert sum(Account.objects.values_list("balance", flat=True)) == len(jobs)


@pytest.mark.parametrize("command", ["joblock_worker", "rqworker"])
def test_an_idle_worker_on_sentinel_queues_stops_on_sigterm(sentinel, settings, command):
    """SIGTERM reaches an idle worker inside its blocking dequeue. redis-py closes a plain
    connection interrupted mid-read, but not a Sentinel-managed one: the dequeue's late reply
    stayed on it and RQ's ``register_death`` read it as its own ("Wrong number of response
    items from pipeline execution", exit 1 up to a minute later). URL queues exit 0 at once."""
    import signal
    import subprocess

    from rq import Worker

    group = sentinel.group
    settings.RQ_QUEUES = {"default": sentinel_queue(group.addresses, group.master_name)}
    primary = sentinel.primary()
    crew = SentinelWorkers(group)
    crew.extra_args = []  # django-rq's rqworker has no --maintenance-interval
    try:
        proc = crew.start(command=command)
        # In its dequeue loop: registered, idle, and a moment into the blocking call.
        assert wait_for(
            lambda: [w.get_state() for w in Worker.all(connection=primary)] == ["idle"], 30
        ), crew.logs()
        time.sleep(1.0)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            code = None
        logs = crew.logs()
        assert code == 0, f"exit {code} after {time.monotonic() - started:.1f}s\n{logs}"
        assert "Wrong number of response items" not in logs, logs
        assert Worker.all(connection=primary) == [], "its death was registered"
    finally:
        crew.stop()


def _slot_state(job: Any) -> str:
    """What RQ's Redis says of ``job``'s admission slot and queue (for a failure's message)."""
    from rq.rate_limit import RateLimitRegistry

    registry = RateLimitRegistry.from_job(job)
    connection = job.connection
    allowed = {i: connection.hget(f"rq:job:{i}", "status") for i in registry.get_allowed_job_ids()}
    result = job.latest_result()
    ended = f"{result.type.name}: {result.exc_string}" if result is not None else "no result"
    return (
        f"{job.id}: status {job.get_status(refresh=True)} ({ended}); "
        f"slot holders (status) {allowed}; "
        f"parked {registry.get_rate_limited_job_ids()}; concurrency {registry.concurrency}; "
        f"queue {connection.lrange('rq:queue:default', 0, -1)}; "
        f"intermediate {connection.lrange('rq:queue:default:intermediate', 0, -1)}"
    )


@pytest.mark.skipif(not admission.supported(), reason="rq 2.x parks no job behind a slot")
def test_a_job_whose_end_a_failover_forgot_does_not_stall_its_resource(sentinel, settings):
    """A job ends on the queues' primary and the failover forgets it (replication held back):
    on the promoted replica it is still started, holding its resource's admission slot, with a
    job parked behind it. Its lock (on another Redis here) was released, so no expired lock
    frees the slot, and RQ hands the job out again only ~60 s past its last heartbeat (hot
    resources stalled a minute). Its idle worker settles it within seconds."""
    import django_rq

    group = sentinel.group
    settings.RQ_QUEUES = {"default": sentinel_queue(group.addresses, group.master_name)}
    settings.JOBLOCK = {**settings.JOBLOCK, "REDIS_ALIAS": "default"}
    Account.objects.create(name="hot")
    queue = django_rq.get_queue("default")
    crew = SentinelWorkers(group, {"REDIS_ALIAS": "default"})
    try:
        crew.start()
        first = hold.enqueue_call(("hot", 1, 3.0), retry=Retry(max=2))
        started = lambda: first.get_status(refresh=True) == JobStatus.STARTED  # noqa: E731
        assert wait_for(started, 30), crew.logs()
        parked = add_one.enqueue_call(("hot", 2))
        assert parked.get_status(refresh=True) == JobStatus.RATE_LIMITED
        group.wait_replicated()
        sentinel.link.set("blackhole")  # both jobs' ends reach the primary alone
        ran = lambda: parked.get_status(refresh=True) == JobStatus.FINISHED  # noqa: E731
        assert wait_for(ran, 30), crew.logs()
        # The worker is done with the parked job only once idle again: RQ's parent checks the
        # job's status after its horse exits. A failover before that (CI saw it) sends the
        # check to the promoted primary, where the job is still parked, and RQ fails it there.
        idle = lambda: all(  # noqa: E731
            worker.get_state() == WorkerStatus.IDLE for worker in Worker.all(queue=queue)
        )
        assert wait_for(idle, 30), crew.logs()
        group.fail_over()
        queue.connection.connection_pool.disconnect()
        # The fault really happened: the promoted primary knows neither end.
        assert first.get_status(refresh=True) == JobStatus.STARTED
        assert parked.get_status(refresh=True) == JobStatus.RATE_LIMITED
        failed_over = time.monotonic()
        # Without the settling it stays parked for 60 s or more; the worker's reconnect to
        # the promoted primary backs off (1, 2, 4... s) while the sentinels elect it.
        assert wait_for(ran, 45), (
            f"still parked after 45 s\n{_slot_state(parked)}\n{crew.logs(20000)}"
        )
        waited = time.monotonic() - failed_over
        done = lambda: first.get_status(refresh=True) == JobStatus.FINISHED  # noqa: E731
        assert wait_for(done, 30), "settled as abandoned, retried and replayed"
        assert "Redis forgot how job" in crew.logs()
    finally:
        crew.stop()
    print(f"the parked job ran {waited:.1f} s after the failover")
    assert Account.objects.get(name="hot").balance == 1, "each run's effect applied once"
