"""The failover chaos run inside the suite (issue 16): locks on a real Sentinel setup whose
primary dies holding locks its replica never heard of.

Each run is ``python -m tests.chaos.failover`` in a subprocess (its own Sentinel setup, queue
Redis, throwaway PostgreSQL database and real RQ workers); PostgreSQL-only, like the chaos run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_chaos import run_module

pytestmark = pytest.mark.chaos


def run_failover(tmp_path: Path, *args: str) -> dict[str, object]:
    return run_module(tmp_path, "tests.chaos.failover", *args)


@pytest.mark.parametrize(
    "args",
    [[], ["--replica-acks", "1"], ["--cluster"]],
    ids=["sentinel", "sentinel-replica-acks", "cluster-node-restart"],
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
        assert report["locks_lost"] + report["stale_writes_rejected"] > 0  # type: ignore[operator]
    if "--cluster" in args:
        assert len(report["resources_per_node"]) == 3  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [[], ["--cluster"]], ids=["sentinel", "cluster"])
def test_negative_control_without_fencing_and_idempotency_shows_damage(tmp_path, args):
    report = run_failover(tmp_path, "--negative", *args)
    assert report["_exit"] == 0, report["_stdout"]
    assert report["verdict"].startswith("VALID")  # type: ignore[union-attr]
    assert report["double_effects"] + report["lost_updates_resources"] > 0  # type: ignore[operator]
