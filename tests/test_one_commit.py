"""One commit per job (§4.9), through real RQ worker processes: under a held lock the claim,
the effect and the success record commit in one transaction, and the record's unique key
stays the arbiter when the lock is lost."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from rq.job import JobStatus

from django_joblock import IdempotencyRecord, lock_info
from django_joblock.idempotency import idempotent
from django_joblock.idempotency_store import insert_or_read
from django_joblock.one_commit import claim_in_transaction
from tests import admission_jobs
from tests.harness import expire_now, wait_for
from tests.testapp.models import Account
from tests.workers import Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {JobStatus.FINISHED, JobStatus.FAILED}
LOCK_KEY = "joblock:{account:acct}:lock"


@pytest.fixture
def workers(settings) -> Iterator[Workers]:  # type: ignore[no-untyped-def]
    settings.JOBLOCK = {"REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 2}}
    crew = Workers(settings.JOBLOCK)
    yield crew
    crew.stop()


def _bodies(rconn: Any, credit_id: str) -> int:
    return int(rconn.llen(f"test:bodies:{credit_id}"))


def _ledger(credit_id: str) -> int:
    return Account.objects.filter(name__startswith=f"ledger:{credit_id}:").count()


def test_the_claim_commits_with_the_effect_not_before(workers, rconn):
    workers.start()
    job = admission_jobs.credit_slowly.delay("acct", "O-1", 5)
    assert wait_for(lambda: _bodies(rconn, "O-1") == 1, 20), workers.logs()
    # The body runs: neither its effect nor its claim is visible outside its transaction (with
    # a separate claim commit, the record would already be here, "running").
    assert not IdempotencyRecord.objects.filter(key="credit:O-1").exists()
    assert _ledger("O-1") == 0
    rconn.set("test:go:O-1", 1)
    assert wait_status(job, DONE, 30) is JobStatus.FINISHED, workers.logs()
    record = IdempotencyRecord.objects.get(key="credit:O-1")
    assert (record.status, record.attempts, record.result) == ("succeeded", 1, {"credited": 5})
    assert _ledger("O-1") == 1


def test_a_lost_lock_lets_no_second_commit_of_the_same_key_through(workers, rconn):
    workers.start(scheduler=True)
    workers.start()
    first = admission_jobs.credit_and_wait.delay("acct", "L-1", 10)
    assert wait_for(lambda: _bodies(rconn, "L-1") == 1, 20), workers.logs()
    # The lock is forgotten under the running job (a failover, an eviction); with heartbeat
    # off it does not notice, and goes on to commit.
    expire_now(rconn, LOCK_KEY)
    second = admission_jobs.credit_and_wait.delay("acct", "L-1", 10)  # a duplicate delivery
    assert wait_for(lambda: (lock_info("account:acct") or _Nobody).job_id == second.id, 20), (
        "negative control: the duplicate took the lock while the first still runs"
    )
    rconn.set("test:go:L-1", 1)
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert _bodies(rconn, "L-1") == 1, "the duplicate waited on the record and never ran"
    assert _ledger("L-1") == 1, "one commit of the key"
    assert second.get_meta(refresh=True)["joblock"]["outcome"] == "replayed"
    record = IdempotencyRecord.objects.get(key="credit:L-1")
    assert (record.status, record.attempts) == ("succeeded", 1)


def test_negative_control_without_the_record_both_runs_commit(workers, rconn):
    workers.start(scheduler=True)
    workers.start()
    first = admission_jobs.credit_and_wait_without_record.delay("acct", "N-1", 10)
    assert wait_for(lambda: _bodies(rconn, "N-1") == 1, 20), workers.logs()
    expire_now(rconn, LOCK_KEY)
    second = admission_jobs.credit_and_wait_without_record.delay("acct", "N-1", 10)
    assert wait_for(lambda: (lock_info("account:acct") or _Nobody).job_id == second.id, 20)
    rconn.set("test:go:N-1", 1)
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert _ledger("N-1") == 2, "without the unique record both runs commit their effect"


class _Nobody:
    job_id = ""


def test_a_replay_is_one_statement_on_postgresql(rconn):
    from django.test.utils import CaptureQueriesContext

    from django_joblock.models import IdempotencyRecord as Model

    values = _values("R-1")
    with CaptureQueriesContext(connection) as first:
        found, inserted, row = insert_or_read(Model, "default", values)
    assert found == "inserted" and inserted is not None and row is None
    Model.objects.filter(pk=inserted).update(status="succeeded", result={"ok": 1})
    with CaptureQueriesContext(connection) as again:
        found, inserted_again, row = insert_or_read(Model, "default", values)
    assert found == "existing" and inserted_again is None
    assert row is not None and row["result"] == {"ok": 1}
    expected = 1 if connection.vendor == "postgresql" else 2
    assert len(first.captured_queries) == 1
    assert len(again.captured_queries) == expected, again.captured_queries
    # Inside a job's transaction (guarded): a replay is one read on PostgreSQL.
    from django.db import transaction

    with transaction.atomic(), CaptureQueriesContext(connection) as guarded:
        found, _id, row = insert_or_read(Model, "default", values, guard=True)
    assert found == "existing" and row is not None and row["result"] == {"ok": 1}
    statements = [q["sql"] for q in guarded.captured_queries if q["sql"] != "BEGIN"]
    assert len(statements) == expected, statements


def test_claim_in_transaction_refuses_to_run_outside_one():
    from django_joblock import IdempotencyError

    with pytest.raises(IdempotencyError, match=r"inside transaction\.atomic"):
        claim_in_transaction(idempotent("k"))


def _values(key: str) -> dict[str, Any]:
    from datetime import timedelta

    from django.utils import timezone

    now = timezone.now()
    return {
        "scope": "tests",
        "key": key,
        "fingerprint": "",
        "status": "running",
        "result": None,
        "error": "",
        "owner": "o",
        "fence": None,
        "lock_resource": "",
        "rq_job_id": "",
        "attempts": 1,
        "lease_expires_at": now + timedelta(seconds=60),
        "created_at": now,
        "updated_at": now,
        "finished_at": None,
        "expires_at": now + timedelta(days=1),
    }


def test_a_duplicate_does_not_wait_long_on_a_key_being_claimed(workers, rconn):
    """A run whose lock was lost and that stays in its transaction: on PostgreSQL the duplicate
    finds the key's guard taken and is "in progress" at once (requeued, no wait); on SQLite it
    waits for the database's write lock (the busy timeout bounds it)."""
    workers.start(scheduler=True)
    workers.start()
    first = admission_jobs.credit_and_wait.delay("acct", "B-1", 10)
    assert wait_for(lambda: _bodies(rconn, "B-1") == 1, 20), workers.logs()
    expire_now(rconn, LOCK_KEY)
    second = admission_jobs.credit_and_wait.delay("acct", "B-1", 10)
    if connection.vendor == "postgresql":
        assert wait_status(second, {JobStatus.SCHEDULED}, 10), workers.logs()
        state = second.get_meta(refresh=True)["joblock"]
        assert state["outcome"] == "requeued", state
        assert "being claimed by another transaction" in state["reason"], state
    rconn.set("test:go:B-1", 1)
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert second.get_meta(refresh=True)["joblock"]["outcome"] == "replayed"
    assert _bodies(rconn, "B-1") == 1 and _ledger("B-1") == 1
