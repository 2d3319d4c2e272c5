"""Logs a person can read: with the documented LOGGING, a real worker's log shows one
line per job outcome, with resource, key, job id and the holder of a busy resource; and
idempotency keys fall into bounded metrics families."""

from __future__ import annotations

import os
import re
import socket
from collections import Counter
from pathlib import Path

import pytest
from rq.job import JobStatus

from django_joblock import lock, metrics
from django_joblock.idempotency.inputs import key_family
from tests import admission_jobs, settings_logging
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}
LINE = re.compile(r"django_joblock: job (\S+) (\w+): (\S+) (.*)$")


class LoggingWorkers(Workers):
    def env(self) -> dict[str, str]:
        env = super().env()
        env["DJANGO_SETTINGS_MODULE"] = "tests.settings_logging"
        return env

    def lines(self) -> list[tuple[str, str, str, str]]:
        found = []
        for path in self.log_paths:
            for line in path.read_text().splitlines():
                match = LINE.search(line)
                if match:
                    found.append(match.groups())  # type: ignore[arg-type]
        return found


def test_the_documented_logging_snippet_is_the_one_tested():
    docs = (Path(__file__).resolve().parent.parent / "docs" / "observability.md").read_text()
    block = docs.split("```python\nLOGGING = ", 1)[1].split("```", 1)[0]
    assert eval(block) == settings_logging.LOGGING  # our own docs


@pytest.mark.slow
def test_the_worker_log_shows_one_line_per_job_outcome(settings, rconn):
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 1}}
    crew = LoggingWorkers(settings.JOBLOCK)
    try:
        crew.start(scheduler=True)
        ran = admission_jobs.logged.delay(1, "a")
        assert wait_status(ran, DONE, 30) is JobStatus.FINISHED, crew.logs()
        replayed = admission_jobs.logged.delay(1, "a")
        failed = admission_jobs.logged_failure.delay(3)
        with lock("hot:2", ttl=10):
            skipped = admission_jobs.logged_skip.delay(2)
            gave_up = admission_jobs.logged_requeue.delay(2)
            for job in (replayed, failed, skipped, gave_up):
                assert wait_status(job, DONE, 30) in DONE, crew.logs()
        lines = crew.lines()
    finally:
        crew.stop()
    by_job: dict[str, list[tuple[str, str, str]]] = {}
    for job_id, outcome, func, rest in lines:
        by_job.setdefault(job_id, []).append((outcome, func, rest))
    holder = f"holder={socket.gethostname()}:{os.getpid()} owner="
    assert [o for o, _f, _r in by_job[ran.id]] == ["ran"]
    assert "resource=hot:1 key=log:a" in by_job[ran.id][0][2]
    assert [o for o, _f, _r in by_job[replayed.id]] == ["replayed"]
    assert [o for o, _f, _r in by_job[failed.id]] == ["failed"]
    assert "reason: ValueError: the body failed" in by_job[failed.id][0][2]
    assert [o for o, _f, _r in by_job[skipped.id]] == ["skipped"]
    assert holder in by_job[skipped.id][0][2], by_job[skipped.id]
    outcomes = Counter(o for o, _f, _r in by_job[gave_up.id])
    requeues = gave_up.get_meta(refresh=True)["joblock"]["requeues"]
    # One line per run: each requeue, then the give-up.
    assert outcomes == Counter({"requeued": requeues, "gave_up": 1}), by_job[gave_up.id]
    requeued = next(rest for o, _f, rest in by_job[gave_up.id] if o == "requeued")
    assert holder in requeued and re.search(r"in \d+s \(requeue 1\)", requeued), requeued


def test_keys_without_a_colon_share_one_metrics_family(rconn):
    assert key_family("refund:R-1") == "refund"
    assert key_family("invoice-42") == "other"
    assert key_family("weird prefix:1") == "other"
    assert key_family("a|b:1") == "other", "never the metrics field separator"
    from django_joblock import idempotent
    from django_joblock.metrics import flush_now

    for key in ("invoice-42", "invoice-43", "refund:R-1"):
        with idempotent(key) as claim:
            claim.succeed(1)
        with idempotent(key) as claim:
            assert claim.done  # a replay: counted as a duplicate blocked
    flush_now()
    totals = metrics.totals()
    families = {fam for fam, _func in totals.counters["duplicates_blocked"]}
    assert families == {"other", "refund"}, families
    assert totals.total("duplicates_blocked", "other") == 2
