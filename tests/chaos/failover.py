"""Failover chaos run: the chaos workload with its locks on Redis Sentinel or Cluster.

    python -m tests.chaos.failover                     # forgets locks: replication held back
    python -m tests.chaos.failover --replica-acks 1    # the same with JOBLOCK["REPLICA_ACKS"]
    python -m tests.chaos.failover --negative          # no fence, no idempotency: must show damage
    python -m tests.chaos.failover --cluster           # locks on a 3-primary Redis Cluster
    python -m tests.chaos.failover --queues-on-sentinel  # queues on the Sentinel group too

The locks live on a Sentinel setup (1 primary, 1 replica, 3 sentinels, see
:class:`tests.procs.topologies.SentinelGroup`) whose replica replicates through a TCP proxy; by
default RQ's queues live on a Redis of their own (append-only, as RQ needs: an asynchronous
failover of the queues would lose RQ's own state, which is not the locks' business). While the
queues drain, besides SIGKILLs of horses and worker parents and a SIGSTOP of a horse, the proxy
is black-holed (the replica stops hearing the primary's writes), locks are taken on the primary
alone for a while, and the primary is SIGKILLed: the sentinels promote the replica, which has
never heard of those locks. Their holders' heartbeats find the locks gone and abort; the fence
refuses the late writes; a second holder gets in meanwhile.

With ``--queues-on-sentinel`` (``tests/chaos/test_failover.py``, case ``sentinel-queues``)
RQ's queues live on the same Sentinel group, with the settings of docs/topologies.md:
the documented configuration. The failover then forgets RQ's state as well: a job's start or
end (its end: RQ's bookkeeping and its admission slot's release), counted per delivery at the
kill (``rq_state_forgotten_by_failover``). Every job is enqueued, and found on the replica,
before the faults start: an enqueue only the dead primary had would be lost by Redis, not by
us, and ``lost_jobs == 0`` stays the requirement. A job whose end was forgotten is back in RQ's
started registry and handed out again once RQ's 60 s of heartbeat slack and a maintenance pass
are over; the report says how long after the promotion the last job finished and the longest
time no job finished. After the drain every idle worker is sent SIGTERM and must exit 0 within
``SIGTERM_BOUND`` seconds (``worker_sigterm``: each one's exit status and seconds).

With ``--cluster`` the locks live on a 3-primary Redis Cluster
(:class:`~tests.procs.topologies.ClusterNodes`, through ``JOBLOCK["REDIS_CLIENT"]``),
the resources spread over the three nodes, and the fault is a restart of the node that holds
the most locks at that moment: it keeps its slots and forgets its keys.

The checker of :mod:`tests.chaos.run` then applies: 0 double effects, 0 lost jobs, 0 stale
writes accepted, and locks lost (``locks_lost`` from the metrics, or ``locks_lost_logged`` from
the workers' logs) + ``stale_writes_rejected`` > 0 (the abort and the fence did the work).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import signal
import sys
import time
from collections import Counter
from datetime import UTC
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from tests.chaos.run import Chaos, finish, verdict  # noqa: E402
from tests.harness import Proxy  # noqa: E402
from tests.procs.redis_server import free_port  # noqa: E402
from tests.procs.topologies import ClusterNodes, SentinelGroup  # noqa: E402

HELD_BACK = 1.5  # seconds of locks the replica never hears of before the primary dies
# The primary dies within this many seconds of a lock only it has: its job's work (2.5 s) then
# outlasts the lock's 2 s TTL past the kill.
YOUNG = 0.25
# --queues-on-sentinel: seconds each idle worker may take to exit 0 on SIGTERM after the drain
# , and how long the run waits for them before it calls them stuck.
SIGTERM_BOUND = 10.0
SIGTERM_WAIT = 20.0
ENDED = ("finished", "failed")


class FailoverChaos(Chaos):
    def setup(self) -> None:
        self.forgotten = 0
        # --queues-on-sentinel: what RQ state the failover forgot (counted at the kill), when
        # the promotion was done (wall clock, as RQ's ended_at), the workers' SIGTERM exits.
        self.rq_forgotten: dict[str, Any] = {}
        self.failover_at: float | None = None
        self.enqueues_on_replica = 0
        self.sigterm: list[dict[str, Any]] = []
        # Jobs long enough that holders are mid-job when the fault comes.
        os.environ["CHAOS_WORK"] = str(self.args.work)
        if self.args.cluster:
            self.cluster = ClusterNodes(3)
            self.cluster.start()
            os.environ["JOBLOCK_TEST_CLUSTER_NODES"] = ",".join(
                f"{h}:{p}" for h, p in self.cluster.startup_nodes
            )
        else:
            links: list[Proxy] = []

            def via(primary_port: int) -> int:
                links.append(Proxy(free_port(), primary_port))
                return links[0].listen_port

            self.group = SentinelGroup(replicate_via=via, master_name="chaos")
            self.group.start()
            self.link = links[0]
            os.environ.update(
                CHAOS_SENTINELS=",".join(f"{h}:{p}" for h, p in self.group.addresses),
                CHAOS_MASTER=self.group.master_name,
                CHAOS_REPLICA_ACKS=str(self.args.replica_acks),
            )
            if self.args.queues_on_sentinel:
                os.environ["CHAOS_QUEUES_ON_SENTINEL"] = "1"  # tests/chaos/settings.py
        super().setup()
        if self.args.queues_on_sentinel:
            import django_rq

            # The runner reads RQ's state through the documented settings too: a client that
            # asks the sentinels for the primary again when a call fails (and retries it).
            self.queues = django_rq.get_connection("chaos")

    def rq(self) -> Any:
        return self.queues if self.args.queues_on_sentinel else self.direct

    def enqueue(self, phase: str, jobs: int) -> list[tuple[str, str]]:
        deliveries = super().enqueue(phase, jobs)
        if self.args.queues_on_sentinel:
            self.check_enqueues_replicated(deliveries)
        return deliveries

    def check_enqueues_replicated(self, deliveries: list[tuple[str, str]]) -> None:
        """Every delivery's job is on the replica before any fault: a ``.delay()`` that only
        the old primary acknowledged would be lost by Redis's asynchronous replication, not by
        us, and the checker's ``lost_jobs == 0`` must stay a fair requirement. The phase's
        jobs are all enqueued before its drain (and its faults) start, so this holds them."""
        self.group.wait_replicated(timeout=10)
        ids = [job_id for job_id, _logical in deliveries]
        for replica in self.group.replicas:
            with replica.client() as client:
                pipe = client.pipeline(transaction=False)
                for job_id in ids:
                    pipe.exists(f"rq:job:{job_id}")
                missing = len(ids) - sum(pipe.execute())
            if missing:
                raise RuntimeError(f"{missing} enqueued jobs are not on replica {replica.port}")
        self.enqueues_on_replica += len(ids)

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self.args.cluster:
                self.cluster.stop()
            else:
                self.group.stop()
                self.link.close()

    def phase_done(self, phase: str) -> None:
        if phase == "uniform":  # the failover comes in the first phase only (one replica)
            self.schedule = lambda: []  # type: ignore[method-assign]

    def add_figures(self, report: dict[str, Any]) -> None:
        from django_joblock import metrics

        args = self.args
        sentinel = "Sentinel: 1 primary + 1 replica + 3 sentinels"
        report["topology"] = (
            "Cluster: 3 primaries (locks); Redis (queues)"
            if args.cluster
            else f"{sentinel} (locks and queues)"
            if args.queues_on_sentinel
            else f"{sentinel} (locks); Redis (queues)"
        )
        report["replica_acks"] = args.replica_acks
        # Locks on the dead primary that the promoted replica lacked (with REPLICA_ACKS:
        # acquires still in their WAIT, then refused and given back), or on the restarted
        # cluster node.
        report["locks_forgotten_by_failover"] = self.forgotten
        # The holders' own word: a horse that aborts while the locks' Redis is still failing
        # over cannot flush its count, and exits (locks_lost, read from the metrics, misses it).
        report["locks_lost_logged"] = sum(
            path.read_text(errors="replace").count("lock lost: ") for path in self.crew.log_paths
        )
        if args.cluster:
            report["resources_per_node"] = self.spread()
        report["acquires_refused_or_failed"] = metrics.totals().total("acquire_errors")
        if args.queues_on_sentinel:
            report["enqueues_on_replica_before_faults"] = self.enqueues_on_replica
            events = self.sentinel_events()
            # One planned failover; another one would be the sentinels' own doing (evidence).
            report["sentinel_failovers"] = sum("+switch-master" in e for e in events)
            report["sentinel_events"] = events
            report["rq_state_forgotten_by_failover"] = self.rq_forgotten
            report.update(self.stall_figures())
            # Last: the drain is over and every worker idle in its dequeue.
            self.sigterm = self.sigterm_idle_workers()
            report["worker_sigterm"] = self.sigterm

    def stall_figures(self) -> dict[str, Any]:
        """When the jobs finished after the failover (RQ's ``ended_at`` of each delivery, the
        last end of a delivery that ran twice): how long after the promotion the last one
        finished, the longest time no delivery finished, and when the jobs whose end the
        failover forgot finished again (RQ's abandoned-job handling: ~60 s past their last
        heartbeat plus a maintenance pass; parked jobs of their resources wait behind them)."""
        from rq.job import Job

        if self.failover_at is None:
            return {"stall_figures": "no failover happened"}
        ends: dict[str, float] = {}
        for job in Job.fetch_many([job_id for job_id, _ in self.deliveries], connection=self.rq()):
            if job is not None and job.ended_at is not None:
                at = job.ended_at
                at = at if at.tzinfo else at.replace(tzinfo=UTC)  # RQ stores UTC
                ends[job.id] = at.timestamp()
        after = sorted(t - self.failover_at for t in ends.values() if t > self.failover_at)
        gaps = [b - a for a, b in itertools.pairwise([0.0, *after])]
        again = [
            ends[job_id] - self.failover_at
            for job_id in self.rq_forgotten.get("ends_ids", [])
            if job_id in ends
        ]
        return {
            "deliveries_finished_after_failover": len(after),
            "last_finish_after_failover_s": round(after[-1], 1) if after else None,
            "longest_stall_after_failover_s": round(max(gaps), 1) if gaps else None,
            "forgotten_ends_finished_again_after_s": round(max(again), 1) if again else None,
        }

    def sigterm_idle_workers(self) -> list[dict[str, Any]]:
        """SIGTERM every live worker once all are idle; each one's exit status and seconds to
        exit (None, None: still running after SIGTERM_WAIT s; the teardown SIGKILLs it)."""
        from rq import Worker

        live = [proc for proc in self.workers if proc.poll() is None]
        pids = {proc.pid for proc in live}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                found = [w for w in Worker.all(connection=self.rq()) if w.pid in pids]
                if len(found) == len(live) and all(w.get_state() == "idle" for w in found):
                    break
            except redis.RedisError:  # the primary busy or failing over: look again
                pass
            time.sleep(0.2)
        time.sleep(1.0)  # a moment into their blocking dequeue, where SIGTERM used to hurt
        started = time.monotonic()
        for proc in live:
            proc.send_signal(signal.SIGTERM)
        exits: dict[int, float] = {}
        while len(exits) < len(live) and time.monotonic() - started < SIGTERM_WAIT:
            for proc in live:
                if proc.pid not in exits and proc.poll() is not None:
                    exits[proc.pid] = time.monotonic() - started
            time.sleep(0.05)
        found = []
        for proc in live:
            entry: dict[str, Any] = {
                "pid": proc.pid,
                "rc": proc.poll(),
                "seconds": round(exits[proc.pid], 2) if proc.pid in exits else None,
            }
            if entry["rc"] != 0:
                index = self.workers.index(proc)
                entry["log"] = self.crew.log_paths[index].read_text(errors="replace")[-1500:]
            found.append(entry)
        return found

    def spread(self) -> dict[str, int]:
        """How many of the run's resources each cluster node serves."""
        found: dict[str, int] = {}
        for _name, key in self.lock_keys():
            port = str(self.cluster.node_of(key).port)
            found[port] = found.get(port, 0) + 1
        return found

    def lock_keys(self) -> list[tuple[str, str]]:
        """(resource, lock key) of every resource this run's jobs use."""
        names = sorted({resource for resource, _delta in self.logical.values()})
        return [(name, f"joblock:{{acct:{name}}}:lock") for name in names]

    def restart_node(self) -> None:
        """Restart the cluster node holding the most locks now (once it holds some)."""
        started = time.monotonic()
        while True:
            held: dict[int, set[str]] = {}
            for node in self.cluster.nodes:
                with node.client() as client:
                    for name, key in self.lock_keys():
                        if self.cluster.node_of(key) is node and client.exists(key):
                            held.setdefault(node.port, set()).add(name)
            if held or time.monotonic() - started > 10:
                break
            time.sleep(0.05)
        port = max(held, key=lambda p: len(held[p])) if held else self.cluster.nodes[0].port
        node = next(n for n in self.cluster.nodes if n.port == port)
        self.forgotten += len(held.get(port, ()))
        self.cluster.restart(node)
        self.faults.append(
            f"Cluster node {port} SIGKILLed holding {len(held.get(port, ()))} locks and "
            "restarted (same slots, no keys)"
        )

    def held_locks(self, port: int) -> dict[str, tuple[str, float]]:
        """The locks the Redis on ``port`` holds now: resource -> (token, age in s by that
        server's clock)."""
        keys = self.lock_keys()
        with self.group.server(port).client() as client:
            pipe = client.pipeline(transaction=False)
            pipe.time()
            for _name, key in keys:
                pipe.hmget(key, "token", "acquired_ms")
            (seconds, micros), *found = pipe.execute()
        now_ms = seconds * 1000 + micros // 1000
        return {
            name: (token, (now_ms - int(acquired_ms)) / 1000)
            for (name, _key), (token, acquired_ms) in zip(keys, found, strict=True)
            if token is not None
        }

    def fail_over(self) -> None:
        self.link.set("blackhole")
        started = time.monotonic()
        old = self.group.primary_port()
        replica = next(s.port for s in self.group.replicas if s.port != old)
        # Kill the primary once it holds locks the replica never heard of (after at least
        # HELD_BACK seconds, at most 10 s: with REPLICA_ACKS there may be none), one of them
        # taken within YOUNG s: its holder is then still at work when its validity deadline
        # passes, so the fault must show as a lost lock or a refused write. (A holder whose
        # job ends first, its release failing through the failover, shows neither.)
        while True:
            held, known = self.held_locks(old), self.held_locks(replica)
            forgotten = {
                name
                for name, (token, _age) in held.items()
                if name not in known or known[name][0] != token
            }
            young = any(held[name][1] <= YOUNG for name in forgotten)
            elapsed = time.monotonic() - started
            if (young and elapsed >= HELD_BACK) or elapsed > 10:
                break
            time.sleep(0.05)
        self.forgotten += len(forgotten)
        youngest = min((held[name][1] for name in forgotten), default=math.nan)
        if self.args.queues_on_sentinel:
            self.rq_forgotten = self.rq_state_forgotten(old, replica)
        new = self.group.fail_over()
        self.failover_at = time.time()
        # The dead primary comes back as the new primary's replica, as an operator (or a
        # process supervisor) brings it back: without a replica REPLICA_ACKS refuses every lock.
        self.link.upstream_port = new
        self.link.set("forward")
        dead = self.group.server(old)
        dead.extra_args = ["--replicaof", "127.0.0.1", str(self.link.listen_port)]
        if self.args.queues_on_sentinel:
            # It comes back empty, and Sentinel may promote a replica that has not synced yet:
            # one more failover then (the promoted primary unanswering for a second, on a busy
            # machine) would hand the sentinels an empty data set, every job gone with it.
            # Not promotable until it has synced, as an operator brings a node back.
            dead.extra_args += ["--replica-priority", "0"]
        dead.start()
        if self.args.queues_on_sentinel:
            self.promotable_when_synced(dead)
        self.faults.append(
            f"Sentinel failover: replication held back {HELD_BACK:g} s, primary {old} "
            f"SIGKILLed holding {len(forgotten)} locks the replica never had (the youngest "
            f"taken {youngest:.2f} s before), replica {new} promoted"
        )

    def promotable_when_synced(self, server: Any, timeout: float = 30.0) -> None:
        """Give ``server`` (a replica) Redis's default replica priority once it has synced."""
        deadline = time.monotonic() + timeout
        with server.client(socket_timeout=1) as client:
            while time.monotonic() < deadline:
                if client.info("replication").get("master_link_status") == "up":
                    client.config_set("replica-priority", 100)
                    return
                time.sleep(0.05)
        self.faults.append(f"the restarted Redis {server.port} did not sync within {timeout:g} s")

    def sentinel_events(self) -> list[str]:
        """The failovers (``+switch-master``) and down flags the first sentinel logged."""
        text = self.group.sentinels[0].log_path.read_text(errors="replace")
        keep = ("+switch-master", "+sdown master", "+odown", "-sdown master")
        return [line.strip()[-120:] for line in text.splitlines() if any(k in line for k in keep)]

    def rq_state_forgotten(self, old: int, replica: int) -> dict[str, Any]:
        """What of RQ's state the primary about to die has and the replica lacks, per delivery:
        an enqueue (its job is missing: 0 by :meth:`check_enqueues_replicated`), a start (started
        there, still waiting here) or an end (finished or failed there, not here). Counted with
        the primary's client writes paused (``CLIENT PAUSE WRITE``, replication held back by the
        proxy): the figures are those of the kill a few milliseconds later."""
        ids = [job_id for job_id, _logical in self.deliveries]

        def statuses(port: int) -> list[str | None]:
            with self.group.server(port).client() as client:
                pipe = client.pipeline(transaction=False)
                for job_id in ids:
                    pipe.hget(f"rq:job:{job_id}", "status")
                return [raw.decode() if raw else None for raw in pipe.execute()]

        with self.group.server(old).client() as client:
            client.execute_command("CLIENT", "PAUSE", 5000, "WRITE")
        enqueues, starts, ends, ends_left = [], [], [], Counter[str]()
        for job_id, there, here in zip(ids, statuses(old), statuses(replica), strict=True):
            if there is None:
                continue
            if here is None:
                enqueues.append(job_id)
            elif there in ENDED and here not in ENDED:
                ends.append(job_id)
                ends_left[here] += 1
            elif there == "started" and here not in ("started", *ENDED):
                starts.append(job_id)
        return {
            "enqueues": len(enqueues),
            "starts": len(starts),
            "ends": len(ends),
            "ends_left_on_replica_as": dict(ends_left),  # "started": RQ's 60 s slack applies
            "ends_ids": ends,
        }

    def schedule(self) -> list[tuple[float, Any]]:
        plan = super().schedule()  # kills and pauses (the network and restart faults are off)
        plan.append((4.0, self.restart_node if self.args.cluster else self.fail_over))
        return sorted(plan, key=lambda item: item[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--negative", action="store_true", help="fencing and idempotency off")
    parser.add_argument("--replica-acks", type=int, default=0, help="JOBLOCK['REPLICA_ACKS']")
    parser.add_argument("--cluster", action="store_true", help="locks on a 3-primary Cluster")
    parser.add_argument(
        "--queues-on-sentinel",
        action="store_true",
        help="RQ's queues on the locks' Sentinel group (docs/topologies.md), not their own Redis",
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=48, help="logical jobs (uniform phase)")
    parser.add_argument("--hot-jobs", type=int, default=0, help="logical jobs (hot phase)")
    parser.add_argument("--loaded-jobs", type=int, default=0, help="logical jobs (loaded phase)")
    # Longer than a failover (~2.5 s): holders are mid-job before, during and after it.
    parser.add_argument("--work", type=float, default=2.5, help="seconds of work per job")
    parser.add_argument("--resources", type=int, default=10)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--pauses", type=int, default=1)
    parser.add_argument("--bound", type=float, default=240)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    if args.queues_on_sentinel and args.cluster:
        parser.error("--queues-on-sentinel needs the Sentinel group (not --cluster)")
    args.no_network = args.no_restart = True  # this run's fault is the failover
    chaos = FailoverChaos(args)
    chaos.setup()
    report = chaos.run()
    ok, text = verdict(report)
    if (
        ok
        and report["mode"] == "safe"
        and not args.replica_acks
        and max(report["locks_lost"], report["locks_lost_logged"]) + report["stale_writes_rejected"]
        == 0
    ):
        ok, text = False, "INVALID: no lock was lost or write refused: the failover forgot nothing"
    if ok and args.queues_on_sentinel and report["mode"] == "safe":
        # The enqueues were all on the replica before the faults (else the run raised): a
        # failover forgetting one would make lost_jobs unfair, so it is reported, never excused.
        slow = [w for w in chaos.sigterm if w["rc"] != 0 or w["seconds"] > SIGTERM_BOUND]
        if not chaos.sigterm or slow:
            bound = f"rc 0 within {SIGTERM_BOUND:g} s"
            ok, text = False, f"FAIL: idle workers not stopped by SIGTERM ({bound}): {slow}"
    return finish(report, ok, text, args.json)


if __name__ == "__main__":
    sys.exit(main())
