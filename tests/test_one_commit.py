"""One commit per job, through real RQ worker processes: under a held lock the claim,
the effect and the success record commit in one transaction, and the record's unique key
stays the arbiter when the lock is lost."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from rq.job import JobStatus

from django_joblock import IdempotencyRecord, lock_info
from django_joblock.idempotency.claims import idempotent
from django_joblock.idempotency.one_commit import claim_in_transaction, record_failure
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
    # A first claim in a job's transaction: on PostgreSQL, one read (the record is inserted at
    # the end, with the result), never a second read of the missing row.
    with transaction.atomic(), CaptureQueriesContext(connection) as first_claim:
        found, _id, row = insert_or_read(Model, "default", _values("R-2"), guard=True)
    statements = [q["sql"] for q in first_claim.captured_queries if q["sql"] != "BEGIN"]
    if connection.vendor == "postgresql":
        assert (found, row, len(statements)) == ("absent", None, 1), statements
    else:
        assert found == "inserted" and len(statements) == 1, statements


def test_each_guard_taken_by_another_transaction_refuses_and_nothing_runs(settings, rconn):
    """The key's guard and the resource's, held by another session: a claim (or a lock-only
    job's first statement) is refused, and nothing runs; a run without a worker waits for the
    resource's guard up to ACQUIRE_WAIT. SQLite takes neither guard (its write lock
    serialises the transactions)."""
    import threading

    from django.db import transaction

    from django_joblock import IdempotencyInProgress, ResourceInTransaction, lock
    from django_joblock.idempotency.resource_guard import guarded, name_for

    settings.JOBLOCK = {"ACQUIRE_WAIT": 0.1}
    Account.objects.create(name="acct", balance=0)
    if connection.vendor != "postgresql":
        assert not guarded("default")
        assert admission_jobs.add_to_balance_without_key("acct", "G-0", 1, False) == 1
        return

    other = _other_session()
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


def _other_session() -> Any:
    """A second PostgreSQL session on the test database (psycopg, outside Django)."""
    import psycopg

    db = connection.settings_dict
    return psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"]
    )


def _backend_alive(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        return bool(cursor.fetchone()[0])


def test_a_previous_holder_idle_in_its_transaction_past_half_the_ttl_is_ended(rconn):
    """The resource's guard is held by a session idle in its transaction (a stopped holder that
    lost its lock): once it has been idle for more than half the lock's TTL, the next holder ends
    it with pg_terminate_backend (its write rolls back) and takes the guard. Negative control:
    while it has been idle for less, the next holder waits, and is refused at the end of its
    wait; the session lives on."""
    from django.db import transaction

    from django_joblock import ResourceInTransaction, lock
    from django_joblock.idempotency.resource_guard import guarded, name_for, take

    if connection.vendor != "postgresql":
        assert not guarded("default")  # SQLite: its write lock serialises transactions
        return
    import psycopg

    other = _other_session()
    pid = other.info.backend_pid
    try:
        other.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [name_for(LOCK_KEY)])
        other.execute("INSERT INTO testapp_account (name, balance) VALUES ('stale', 1)")
        with lock("account:acct", ttl=4) as held, transaction.atomic():
            with pytest.raises(ResourceInTransaction, match="still inside its database"):
                take("default", held, wait=0.3)  # idle for less than 2 s
            assert _backend_alive(pid), "negative control: a young transaction is waited for"
            take("default", held, wait=10)
        assert not _backend_alive(pid), "its session was ended"
        with pytest.raises(psycopg.OperationalError):
            other.execute("SELECT 1")
        assert not Account.objects.filter(name="stale").exists(), "its write rolled back"
    finally:
        other.close()


def test_a_previous_holder_that_cannot_be_ended_is_waited_for_and_said_once(rconn, caplog):
    """Without the right to signal the stale holder's backend (here the waiting run's role is not
    a superuser and the holder's is), the refusal is logged once, the run's transaction goes
    on, and it is refused at the end of its wait; the holder's session lives on."""
    from django.db import transaction

    from django_joblock import ResourceInTransaction, lock
    from django_joblock.idempotency.resource_guard import guarded, name_for, take

    if connection.vendor != "postgresql":
        assert not guarded("default")
        return

    with connection.cursor() as cursor:
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        assert cursor.fetchone()[0], "the test database's role is a superuser (it holds)"
        cursor.execute(
            # Suites running side by side may create it at the same moment: one of them wins.
            "DO $$ BEGIN CREATE ROLE joblock_limited NOLOGIN IN ROLE pg_read_all_stats; "
            "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
        )
    other = _other_session()
    pid = other.info.backend_pid
    try:
        other.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [name_for(LOCK_KEY)])
        with lock("account:acct", ttl=2) as held, transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL ROLE joblock_limited")
            time.sleep(1.2)  # idle past half the TTL
            with caplog.at_level("WARNING", logger="django_joblock"):
                with pytest.raises(ResourceInTransaction):
                    take("default", held, wait=2)
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")  # the run's transaction is still usable
        assert _backend_alive(pid), "a session it may not signal is left alone"
        refusals = [r for r in caplog.records if "cannot be ended" in r.getMessage()]
        assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
    finally:
        other.close()


def test_claim_in_transaction_refuses_to_run_outside_one():
    from django_joblock import IdempotencyError

    with pytest.raises(IdempotencyError, match=r"inside transaction\.atomic"):
        claim_in_transaction(idempotent("k"))


# A job's error text is whatever it raised: written raw, a NUL was a DataError on PostgreSQL
# (logged, no failed record) and a lone surrogate a UnicodeEncodeError out of record_failure()
# on every backend (review).
@pytest.mark.parametrize(
    ("error", "stored"),
    [("RuntimeError: a\x00b", "RuntimeError: a\\x00b"), ("OSError: \udcff", "OSError: \\udcff")],
)
def test_a_failure_whose_text_the_database_cannot_store_is_recorded_escaped(error, stored):
    record_failure(idempotent("odd:1", scope="tests"), error)
    record = IdempotencyRecord.objects.get(scope="tests", key="odd:1")
    assert (record.status, record.error) == ("failed", stored)


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


@pytest.mark.slow
def test_a_duplicate_waits_for_the_first_runs_transaction_then_replays(workers, rconn):
    """A run whose lock was lost stays in its transaction (for a few seconds, less than half
    its lock's TTL: it is slow, not stopped). The duplicate takes the lock and, on PostgreSQL,
    waits for the resource's guard in place, without a requeue (jobs parked behind it keep
    their order), then replays the first run's result once that committed; on SQLite it
    waits for the database's write lock (the busy timeout bounds it)."""
    workers.start(scheduler=True)
    workers.start()
    first = admission_jobs.credit_and_wait.delay("acct", "B-1", 10)
    assert wait_for(lambda: _bodies(rconn, "B-1") == 1, 20), workers.logs()
    expire_now(rconn, LOCK_KEY)
    second = admission_jobs.credit_and_wait.delay("acct", "B-1", 10)
    # Negative control: the duplicate has the lock while the first's transaction is open.
    assert wait_for(lambda: (lock_info("account:acct") or _Nobody).job_id == second.id, 20)
    assert first.get_status(refresh=True) == JobStatus.STARTED
    rconn.set("test:go:B-1", 1)
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    state = second.get_meta(refresh=True)["joblock"]
    assert state["outcome"] == "replayed", state
    if connection.vendor == "postgresql":
        assert state.get("requeues", 0) == 0, state
    assert _bodies(rconn, "B-1") == 1 and _ledger("B-1") == 1


@pytest.mark.slow
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
    # Negative control: the second took the lock while the first's transaction was open
    # (PostgreSQL: it waits for the resource's guard; SQLite: for the database's write lock).
    assert wait_for(lambda: (lock_info("account:acct") or _Nobody).job_id == second.id, 20)
    assert _bodies(rconn, "T-2") == 0, "it read nothing before the first commits"
    rconn.set("test:go:T-1", 1)
    assert wait_status(first, DONE, 30) is JobStatus.FINISHED, workers.logs()
    assert wait_status(second, DONE, 40) is JobStatus.FINISHED, workers.logs()
    assert Account.objects.get(name="acct").balance == 15, "the first run's credit was lost"
    if connection.vendor == "postgresql":
        state = second.get_meta(refresh=True)["joblock"]
        assert state.get("requeues", 0) == 0 and state["outcome"] == "ran", state


@pytest.mark.slow
@pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="SQLite's write lock keeps any other writer out until the job's commit",
)
def test_a_run_that_finds_its_key_recorded_at_its_end_goes_again_and_replays(workers, rconn):
    """Its claim read found no record; another run recorded the key before this one's commit
    (a run whose commit that read just missed, or an unguarded ``idempotent()`` block). The
    unique key refuses the second record: this run's effect is rolled back, and it goes
    again as busy and replays the recorded result (it failed with ``IdempotencyClaimLost``)."""
    workers.start(scheduler=True)
    workers.start()
    job = admission_jobs.credit_slowly.delay("acct", "C-9", 5)
    assert wait_for(lambda: _bodies(rconn, "C-9") == 1, 20), workers.logs()
    now = timezone.now()
    IdempotencyRecord.objects.create(
        scope="tests.admission_jobs.credit_slowly",
        key="credit:C-9",
        status="succeeded",
        result={"credited": 7},
        created_at=now,
        updated_at=now,
        expires_at=now + timedelta(days=1),
    )
    rconn.set("test:go:C-9", 1)
    assert wait_status(job, DONE, 40) is JobStatus.FINISHED, workers.logs()
    state = job.get_meta(refresh=True)["joblock"]
    assert state["outcome"] == "replayed" and state["requeues"] == 1, state
    assert job.return_value() == {"credited": 7}
    assert _ledger("C-9") == 0, "the run's own effect was rolled back"
    assert _bodies(rconn, "C-9") == 1, "the replay ran nothing"
