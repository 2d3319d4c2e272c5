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
from django_joblock.idempotency.claims import idempotent
from django_joblock.idempotency.one_commit import claim_in_transaction
from django_joblock.idempotency.store import insert_or_read
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


def test_each_guard_taken_by_another_transaction_refuses_and_nothing_runs(settings, rconn):
    """The key's guard and the resource's, held by another session: a claim (or a lock-only
    job's first statement) is refused, and nothing runs; a run without a worker waits for the
    resource's guard up to ACQUIRE_WAIT. SQLite takes neither guard (its write lock
    serialises the transactions)."""
    import threading

    from django.db import transaction

    from django_joblock import IdempotencyInProgress, ResourceInTransaction, lock
    from django_joblock.idempotency.guard import guarded, name_for

    settings.JOBLOCK = {"ACQUIRE_WAIT": 0.1}
    Account.objects.create(name="acct", balance=0)
    if connection.vendor != "postgresql":
        assert not guarded("default")
        assert admission_jobs.add_to_balance_without_key("acct", "G-0", 1, False) == 1
        return
    import psycopg

    db = connection.settings_dict
    other = psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"]
    )
    taken = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
    try:
        with other.transaction():
            other.execute(taken, ["django_joblock\x1ftests\x1fG-1"])
            with pytest.raises(IdempotencyInProgress, match="being claimed"):
                with transaction.atomic():
                    claim_in_transaction(idempotent("G-1", scope="tests"))
            other.execute(taken, [name_for(LOCK_KEY)])
            with lock("account:acct") as held, transaction.atomic():
                with pytest.raises(ResourceInTransaction, match="still inside its database"):
                    claim_in_transaction(idempotent("G-2", scope="tests"), held)
            for job in (admission_jobs.add_to_balance, admission_jobs.add_to_balance_without_key):
                with pytest.raises(ResourceInTransaction) as refused:
                    job("acct", "G-3", 1, False)
                assert refused.value.resource == "account:acct"
        assert rconn.llen("test:bodies:G-3") == 0, "a refused run runs nothing"
        # The other transaction ended: the guards are free again.
        assert admission_jobs.add_to_balance_without_key("acct", "G-3", 1, False) == 1
        assert admission_jobs.add_to_balance("acct", "G-4", 1, False) == 2
        # An inline run waits for the guard (here: until the other session commits).
        other.execute(taken, [name_for(LOCK_KEY)])
        ended = threading.Event()

        def end_the_other_transaction() -> None:
            ended.set()
            other.commit()

        settings.JOBLOCK = {"ACQUIRE_WAIT": 30}
        timer = threading.Timer(0.3, end_the_other_transaction)
        timer.start()
        assert admission_jobs.add_to_balance("acct", "G-5", 1, False) == 3
        assert ended.is_set(), "it ran only after the other transaction ended"
        timer.join()
    finally:
        other.close()


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
        "token": "o",
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
    finds the guards taken (the resource's first: it runs under the same lock) and is
    requeued at once, without a wait; on SQLite it waits for the database's write lock (the
    busy timeout bounds it)."""
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
        assert "still inside its database transaction" in state["reason"], state
    rconn.set("test:go:B-1", 1)
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert second.get_meta(refresh=True)["joblock"]["outcome"] == "replayed"
    assert _bodies(rconn, "B-1") == 1 and _ledger("B-1") == 1


def _requeued(job: Any) -> bool:
    return int(job.get_meta(refresh=True).get("joblock", {}).get("requeues", 0)) > 0


def _waiting_for_the_row() -> bool:
    """PostgreSQL: a backend's UPDATE of an account waits for another transaction's row lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query ILIKE 'UPDATE%%testapp_account%%'"
        )
        return bool(cursor.fetchone()[0])


@pytest.mark.parametrize(
    "job",
    [admission_jobs.add_to_balance, admission_jobs.add_to_balance_without_key],
    ids=["idempotency-key", "lock-only"],
)
def test_a_lost_holder_still_in_its_transaction_loses_no_update(workers, rconn, job):
    """Regression (a short chaos run: one resource's balance off by a lost update, no stale
    write accepted). The first run's lock is taken away while it is still inside its
    transaction, past its last ensure_held() (heartbeat off: it commits). The next holder of
    the resource read the balance before that commit and wrote its own sum after it: its
    fence was newer, so the write was accepted, and the first run's credit was lost. The
    next holder's transaction now does not start while the previous one's is open
    (PostgreSQL: the resource's transaction guard; SQLite: the database's write lock)."""
    Account.objects.create(name="acct", balance=0)
    workers.start(scheduler=True)
    workers.start()
    first = job.delay("acct", "T-1", 10, True)
    assert wait_for(lambda: _bodies(rconn, "T-1") == 1, 20), workers.logs()
    expire_now(rconn, LOCK_KEY)
    second = job.delay("acct", "T-2", 5, False)
    if connection.vendor == "postgresql":
        # Negative control: the second took the lock while the first's transaction was open
        # (it either waits for the first's row lock, or is refused at its start, and requeued).
        assert wait_for(lambda: _requeued(second) or _waiting_for_the_row(), 20), workers.logs()
    else:
        # Negative control: the second holds the lock, waiting for the database's write lock.
        assert wait_for(lambda: (lock_info("account:acct") or _Nobody).job_id == second.id, 20)
    rconn.set("test:go:T-1", 1)
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert Account.objects.get(name="acct").balance == 15, "the first run's credit was lost"
    if connection.vendor == "postgresql":
        state = second.get_meta(refresh=True)["joblock"]
        assert state["requeues"] >= 1 and state["outcome"] == "ran", state
