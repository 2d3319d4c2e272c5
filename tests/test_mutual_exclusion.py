"""N processes x M racy read-sleep-write increments: exact under the lock, lossy without."""

from __future__ import annotations

import pytest

from tests import racers

PROCS, ROUNDS = 4, 25


@pytest.mark.slow
def test_lock_gives_the_exact_count(rconn):
    racers.run_all(rconn, [("increment", str(ROUNDS), "lock")] * PROCS)
    assert int(rconn.get("test:counter")) == PROCS * ROUNDS


@pytest.mark.slow
def test_without_the_lock_updates_are_lost(rconn):
    """Negative control: the same workload without the lock really races."""
    racers.run_all(rconn, [("increment", str(ROUNDS), "nolock")] * PROCS)
    assert int(rconn.get("test:counter")) < PROCS * ROUNDS
