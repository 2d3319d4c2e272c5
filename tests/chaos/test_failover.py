"""The failover chaos run inside the suite: locks on a real Sentinel setup whose
primary dies holding locks its replica never heard of. ``sentinel-queues`` puts RQ's
queues on the same Sentinel group, as docs/topologies.md documents, so the failover forgets RQ
state too, and ends with a SIGTERM of the idle workers, each of which must exit 0 at once.

Each run is ``python -m tests.chaos.failover`` in a subprocess (its own Sentinel setup, queue
Redis, throwaway PostgreSQL database and real RQ workers); PostgreSQL-only, like the chaos run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_chaos import run_module

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def run_failover(tmp_path: Path, *args: str) -> dict[str, object]:
    return run_module(tmp_path, "tests.chaos.failover", *args)


@pytest.mark.parametrize(
    "args",
    [[], ["--replica-acks", "1"], ["--cluster"], ["--queues-on-sentinel"]],
    ids=["sentinel", "sentinel-replica-acks", "cluster-node-restart", "sentinel-queues"],
)
def test_a_fault_that_forgets_locks_does_no_damage(tmp_path, args):
    report = run_failover(tmp_path, *args)
    assert report["_exit"] == 0, report["_stdout"]
    assert report["double_effects"] == 0
    assert report["lost_jobs"] == 0 and report["lost_updates_resources"] == 0
    assert report["stale_writes_accepted"] == 0
    assert report["drained"] is True
    faults = " ".join(report["faults"])  # type: ignore[arg-type]
    assert ("Cluster node" if "--cluster" in args else "Sentinel failover") in faults, faults
    if "--replica-acks" not in args:
        # The fault bit: the dead primary (or restarted node) held locks nobody else had, and
        # the heartbeat's abort or the fence did the work.
        assert report["locks_forgotten_by_failover"] > 0  # type: ignore[operator]
        lost = max(report["locks_lost"], report["locks_lost_logged"])  # type: ignore[type-var]
        assert lost + report["stale_writes_rejected"] > 0  # type: ignore[operator]
    if "--cluster" in args:
        assert len(report["resources_per_node"]) == 3  # type: ignore[arg-type]
    if "--queues-on-sentinel" in args:
        # lost_jobs == 0 above is fair: every job was on the replica before the faults, so a
        # lost one would be ours (a job whose start or end the failover forgot is RQ's to
        # hand out again, and the idempotency key's to replay).
        assert report["enqueues_on_replica_before_faults"] == report["deliveries"]
        forgot = report["rq_state_forgotten_by_failover"]
        assert forgot["enqueues"] == 0, forgot  # type: ignore[index]
        assert report["last_finish_after_failover_s"] is not None, "jobs ran after the failover"
        # After the drain each idle worker exits 0 on SIGTERM within seconds (the dequeue on a
        # Sentinel connection interrupted by the signal once made it exit 1, a minute later).
        stopped = report["worker_sigterm"]
        assert stopped, "the run's workers were still running at its end"
        for worker in stopped:  # type: ignore[attr-defined]
            assert worker["rc"] == 0 and worker["seconds"] <= 10, stopped


@pytest.mark.parametrize("args", [[], ["--cluster"]], ids=["sentinel", "cluster"])
def test_negative_control_without_fencing_and_idempotency_shows_damage(tmp_path, args):
    report = run_failover(tmp_path, "--negative", *args)
    assert report["_exit"] == 0, report["_stdout"]
    assert report["verdict"].startswith("VALID")  # type: ignore[union-attr]
    assert report["double_effects"] + report["lost_updates_resources"] > 0  # type: ignore[operator]
