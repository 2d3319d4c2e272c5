"""Failover chaos run (issue 16): the chaos workload with its locks on Redis Sentinel or Cluster.

    python -m tests.chaos.failover                     # forgets locks: replication held back
    python -m tests.chaos.failover --replica-acks 1    # the same with JOBLOCK["REPLICA_ACKS"]
    python -m tests.chaos.failover --negative          # no fence, no idempotency: must show damage
    python -m tests.chaos.failover --cluster           # locks on a 3-primary Redis Cluster

The locks live on a Sentinel setup (1 primary, 1 replica, 3 sentinels, see
:class:`tests.procs.topologies.SentinelGroup`) whose replica replicates through a
TCP proxy; RQ's queues live on a Redis of their own (append-only, as RQ needs: an asynchronous
failover of the queues would lose RQ's own state, which is not the locks' business). While the
queues drain, besides SIGKILLs of horses and worker parents and a SIGSTOP of a horse, the
proxy is black-holed (the replica stops hearing the primary's writes), locks are taken on the
primary alone for a while, and the primary is SIGKILLed: the sentinels promote the replica,
which has never heard of those locks. Their holders' heartbeats find the locks gone and abort;
the fence refuses the late writes; a second holder gets in meanwhile.

With ``--cluster`` the locks live on a 3-primary Redis Cluster
(:class:`~tests.procs.topologies.ClusterNodes`, through ``JOBLOCK["REDIS_CLIENT"]``),
the resources spread over the three nodes, and the fault is a restart of the node that holds
the most locks at that moment: it keeps its slots and forgets its keys.

The checker of :mod:`tests.chaos.run` then applies: 0 double effects, 0 lost jobs, 0 stale
writes accepted, and ``locks_lost`` + ``stale_writes_rejected`` > 0 (the abort and the fence
did the work).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from tests.chaos.run import Chaos, finish, verdict  # noqa: E402
from tests.harness import Proxy  # noqa: E402
from tests.procs.redis_server import free_port  # noqa: E402
from tests.procs.topologies import ClusterNodes, SentinelGroup  # noqa: E402

HELD_BACK = 1.5  # seconds of locks the replica never hears of before the primary dies


class FailoverChaos(Chaos):
    def setup(self) -> None:
        self.forgotten = 0
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
        super().setup()

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
        report["topology"] = (
            "Cluster: 3 primaries (locks); Redis (queues)"
            if args.cluster
            else "Sentinel: 1 primary + 1 replica + 3 sentinels (locks); Redis (queues)"
        )
        report["replica_acks"] = args.replica_acks
        # Locks on the dead primary that the promoted replica lacked (with REPLICA_ACKS:
        # acquires still in their WAIT, then refused and given back), or on the restarted
        # cluster node.
        report["locks_forgotten_by_failover"] = self.forgotten
        if args.cluster:
            report["resources_per_node"] = self.spread()
        report["acquires_refused_or_failed"] = metrics.totals().total("acquire_errors")

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

    def held_locks(self, port: int) -> set[str]:
        """The resources whose lock the Redis on ``port`` holds now."""
        keys = self.lock_keys()
        with self.group.server(port).client() as client:
            pipe = client.pipeline(transaction=False)
            for _name, key in keys:
                pipe.exists(key)
            found = pipe.execute()
        return {name for (name, _key), hit in zip(keys, found, strict=True) if hit}

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
        plan.append((4.0, self.restart_node if self.args.cluster else self.fail_over))
        return sorted(plan, key=lambda item: item[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--negative", action="store_true", help="fencing and idempotency off")
    parser.add_argument("--replica-acks", type=int, default=0, help="JOBLOCK['REPLICA_ACKS']")
    parser.add_argument("--cluster", action="store_true", help="locks on a 3-primary Cluster")
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
    args.no_network = args.no_restart = True  # this run's fault is the failover
    chaos = FailoverChaos(args)
    chaos.setup()
    report = chaos.run()
    ok, text = verdict(report)
    if (
        ok
        and report["mode"] == "safe"
        and not args.replica_acks
        and report["locks_lost"] + report["stale_writes_rejected"] == 0
    ):
        ok, text = False, "INVALID: no lock was lost or write refused: the failover forgot nothing"
    return finish(report, ok, text, args.json)


if __name__ == "__main__":
    sys.exit(main())
