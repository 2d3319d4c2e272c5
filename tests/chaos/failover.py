"""Failover chaos run (issue 16): the chaos workload with its locks on Redis Sentinel.

    python -m tests.chaos.failover                     # forgets locks: replication held back
    python -m tests.chaos.failover --replica-acks 1    # the same with JOBLOCK["REPLICA_ACKS"]
    python -m tests.chaos.failover --negative          # no fence, no idempotency: must show damage

The locks live on a Sentinel setup (1 primary, 1 replica, 3 sentinels, see
:class:`django_joblock.testing.topologies.SentinelGroup`) whose replica replicates through a
TCP proxy; RQ's queues live on a Redis of their own (append-only, as RQ needs: an asynchronous
failover of the queues would lose RQ's own state, which is not the locks' business). While the
queues drain, besides SIGKILLs of horses and worker parents and a SIGSTOP of a horse, the
proxy is black-holed (the replica stops hearing the primary's writes), locks are taken on the
primary alone for a while, and the primary is SIGKILLed: the sentinels promote the replica,
which has never heard of those locks. Their holders' heartbeats find the locks gone and abort;
the fence refuses the late writes; a second holder gets in meanwhile. The checker of
:mod:`tests.chaos.run` then applies: 0 double effects, 0 lost jobs, 0 stale writes accepted,
and ``locks_lost`` + ``stale_writes_rejected`` > 0 (the abort and the fence did the work).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from django_joblock.testing.redis_server import free_port  # noqa: E402
from django_joblock.testing.topologies import SentinelGroup  # noqa: E402
from tests.chaos.run import Chaos, print_table, verdict  # noqa: E402
from tests.harness import Proxy  # noqa: E402

HELD_BACK = 1.5  # seconds of locks the replica never hears of before the primary dies


class FailoverChaos(Chaos):
    def setup(self) -> None:
        links: list[Proxy] = []

        def via(primary_port: int) -> int:
            links.append(Proxy(free_port(), primary_port))
            return links[0].listen_port

        self.forgotten = 0
        self.acquire_errors = 0
        self.group = SentinelGroup(replicate_via=via, master_name="chaos")
        self.group.start()
        self.link = links[0]
        os.environ.update(
            CHAOS_SENTINELS=",".join(f"{h}:{p}" for h, p in self.group.addresses),
            CHAOS_MASTER=self.group.master_name,
            CHAOS_REPLICA_ACKS=str(self.args.replica_acks),
            # Jobs long enough that holders are mid-job when the primary dies.
            CHAOS_WORK=str(self.args.work),
        )
        super().setup()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.group.stop()
            self.link.close()

    def held_locks(self, port: int) -> set[str]:
        """The resources whose lock the Redis on ``port`` holds now."""
        names = [name for phase in ("uniform", "hot") for name in self.resources(phase)[0]]
        with self.group.server(port).client() as client:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(f"joblock:{{acct:{name}}}:lock")
            return {name for name, found in zip(names, pipe.execute(), strict=True) if found}

    def fail_over(self) -> None:
        self.link.set("blackhole")
        started = time.monotonic()
        old = self.group.primary_port()
        replica = next(s.port for s in self.group.replicas if s.port != old)
        # Kill the primary once it holds locks the replica never heard of (after at least
        # HELD_BACK seconds, at most 10 s: with REPLICA_ACKS there may be none).
        while True:
            forgotten = self.held_locks(old) - self.held_locks(replica)
            elapsed = time.monotonic() - started
            if (forgotten and elapsed >= HELD_BACK) or elapsed > 10:
                break
            time.sleep(0.05)
        self.forgotten += len(forgotten)
        new = self.group.fail_over()
        # The dead primary comes back as the new primary's replica, as an operator (or a
        # process supervisor) brings it back: without a replica REPLICA_ACKS refuses every lock.
        self.link.upstream_port = new
        self.link.set("forward")
        dead = self.group.server(old)
        dead.extra_args = ["--replicaof", "127.0.0.1", str(self.link.listen_port)]
        dead.start()
        self.faults.append(
            f"Sentinel failover: replication held back {HELD_BACK:g} s, primary {old} "
            f"SIGKILLed holding {len(forgotten)} locks the replica never had, replica {new} "
            "promoted"
        )

    def schedule(self) -> list[tuple[float, Any]]:
        plan = super().schedule()  # kills and pauses (the network and restart faults are off)
        plan.append((4.0, self.fail_over))
        return sorted(plan, key=lambda item: item[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--negative", action="store_true", help="fencing and idempotency off")
    parser.add_argument("--replica-acks", type=int, default=0, help="JOBLOCK['REPLICA_ACKS']")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=48, help="logical jobs (uniform phase)")
    parser.add_argument("--hot-jobs", type=int, default=0, help="logical jobs (hot phase)")
    # Longer than a failover (~2.5 s): holders are mid-job before, during and after it.
    parser.add_argument("--work", type=float, default=2.5, help="seconds of work per job")
    parser.add_argument("--resources", type=int, default=10)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--pauses", type=int, default=1)
    parser.add_argument("--bound", type=float, default=240)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    args.no_network = args.no_restart = True  # this run's fault is the failover
    chaos = FailoverChaos(args)
    chaos.setup()
    try:
        chaos.start_worker(scheduler=True)
        for _ in range(args.workers - 1):
            chaos.start_worker()
        total, counts = 0.0, Counter[str]()
        # The failover comes in the first phase only (a Sentinel setup has one replica).
        for phase, jobs in (("uniform", args.jobs), ("hot", args.hot_jobs)):
            if not jobs:
                continue
            deliveries = chaos.enqueue(phase, jobs)
            print(f"phase {phase}: {len(deliveries)} deliveries", flush=True)
            elapsed, phase_counts = chaos.drain(phase, deliveries)
            total += elapsed
            counts += phase_counts
            chaos.phases[phase] = chaos.phase_figures(phase, deliveries, elapsed)
            if phase == "uniform":
                chaos.schedule = lambda: []  # type: ignore[method-assign]
        report = chaos.check(total, counts)
        from django_joblock import metrics

        chaos.acquire_errors = metrics.totals().total("acquire_errors")
    finally:
        chaos.teardown()
    report["topology"] = "Sentinel: 1 primary + 1 replica + 3 sentinels (locks); Redis (queues)"
    report["replica_acks"] = args.replica_acks
    # Locks on the dead primary that the promoted replica lacked (with REPLICA_ACKS: acquires
    # still in their WAIT, then refused and given back).
    report["locks_forgotten_by_failover"] = chaos.forgotten
    report["acquires_refused_or_failed"] = chaos.acquire_errors
    ok, text = verdict(report)
    if (
        ok
        and report["mode"] == "safe"
        and not args.replica_acks
        and report["locks_lost"] + report["stale_writes_rejected"] == 0
    ):
        ok, text = False, "INVALID: no lock was lost or write refused: the failover forgot nothing"
    report["verdict"] = text
    print_table(report, text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
