"""Every benchmark script runs to its tables, with tiny sizes: they import the package's
internals (the lock and acquire script of benchmarks/dashboard.py), so a change there must not
leave them broken until someone needs a figure. No figure is asserted: speed is measured by
running them (README, "Benchmarks"), never in tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from django_joblock.jobs import admission
from tests.harness import ROOT

pytestmark = pytest.mark.slow

RUNS = {
    "locks": (
        "--cycles 20 --rounds 2 --hot-procs 2 --hot-cycles 3 --hot-rounds 1 --hold-locks 200 "
        "--hold-ttl 1 --replica-rounds 1",
        "alock against redis-py's asyncio Lock",
    ),
    "jobs": ("--jobs 6 --fork-jobs 2 --rounds 1", "floor"),
    "job_instructions": ("--jobs 2 --kinds plain,lock", "M instr/job"),
    "hot_key": ("--jobs 6 --ms 5 --workers 2 --rounds 1", "vs RateLimit"),
    "idempotency": ("--ops 10 --rounds 1", "vs naive"),
    "dashboard": ("--sizes 100 --records 100", "dashboard ms"),
}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_benchmark_runs_to_its_tables(name):
    if name == "hot_key" and not admission.supported():
        pytest.skip("hot_key.py measures RQ's RateLimit, which rq 2.x does not have")
    args, expected = RUNS[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")}
    env.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    if env["DATABASE_URL"].startswith("sqlite") or not env["DATABASE_URL"]:
        env["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/postgres"
    env.pop("REDIS_URL", None)  # each starts a private redis-server
    done = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", *args.split()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert expected in output, output[-4000:]
