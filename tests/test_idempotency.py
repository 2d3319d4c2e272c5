"""Idempotency records on the real database (PostgreSQL with DATABASE_URL, else SQLite)."""

from __future__ import annotations

import signal
import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import (
    DatabaseError,
    IntegrityError,
    InternalError,
    connection,
    transaction,
)
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_joblock import (
    IdempotencyClaimLost,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeyMismatch,
    IdempotencyRecord,
    idempotent,
)
from django_joblock.signals import duplicate_blocked
from tests import racers
from tests.testapp.models import Account

pytestmark = pytest.mark.django_db(transaction=True)


def run_refund(key: str, effects: list[str], **kwargs) -> object:  # type: ignore[no-untyped-def]
    with idempotent(key, **kwargs) as claim:
        if claim.done:
            return claim.result
        effects.append(key)
        with transaction.atomic():
            claim.succeed({"refunded": len(effects)})
        return {"refunded": len(effects)}


def test_first_claim_runs_second_replays():
    effects: list[str] = []
    blocked = []

    def receiver(sender, key, scope, record, **kwargs):  # type: ignore[no-untyped-def]
        blocked.append(key)

    duplicate_blocked.connect(receiver)
    try:
        first = run_refund("refund:R-1", effects)
        second = run_refund("refund:R-1", effects)
    finally:
        duplicate_blocked.disconnect(receiver)
    assert effects == ["refund:R-1"], "the body must run once"
    assert first == second == {"refunded": 1}
    assert blocked == ["refund:R-1"]
    record = IdempotencyRecord.objects.get(key="refund:R-1")
    assert (record.status, record.attempts, record.result) == ("succeeded", 1, {"refunded": 1})
    assert record.finished_at is not None and record.lease_expires_at is None


def test_scopes_are_separate():
    effects: list[str] = []
    run_refund("k", effects, scope="a")
    run_refund("k", effects, scope="b")
    assert effects == ["k", "k"]


def test_16_threads_exactly_one_runs():
    outcomes: list[str] = []
    ran = []
    barrier = threading.Barrier(16)

    def worker() -> None:
        barrier.wait()
        try:
            with idempotent("refund:threads") as claim:
                if claim.done:
                    outcomes.append("replay")
                    return
                ran.append(1)
                time.sleep(0.2)
                claim.succeed({"ok": True})
                outcomes.append("ran")
        except IdempotencyInProgress:
            outcomes.append("in_progress")
        finally:
            connection.close()

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == 16
    assert ran == [1] and outcomes.count("ran") == 1
    assert set(outcomes) <= {"ran", "replay", "in_progress"}
    assert IdempotencyRecord.objects.get(key="refund:threads").status == "succeeded"


@pytest.mark.slow
def test_16_processes_exactly_one_runs(rconn):
    outputs = racers.run_all(rconn, [("claim", "refund:procs", "0.3")] * 16)
    outcomes = [out.strip() for out in outputs]
    assert outcomes.count("ran") == 1, outcomes
    assert set(outcomes) <= {"ran", "replay", "in_progress"}
    assert int(rconn.get("test:effects")) == 1


def test_rollback_of_business_write_leaves_record_not_succeeded():
    Account.objects.create(name="acct", balance=0)

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with idempotent("refund:rollback") as claim:
            with transaction.atomic():
                Account.objects.filter(name="acct").update(balance=100)
                claim.succeed({"balance": 100})
                raise Boom("payment gateway said no")
    record = IdempotencyRecord.objects.get(key="refund:rollback")
    assert record.status == "failed" and "payment gateway said no" in record.error
    assert record.result is None
    assert Account.objects.get(name="acct").balance == 0
    # The retry runs again (takes the failed record over).
    with idempotent("refund:rollback") as claim:
        assert not claim.done and claim.attempts == 2
        with transaction.atomic():
            Account.objects.filter(name="acct").update(balance=100)
            claim.succeed({"balance": 100})
    assert IdempotencyRecord.objects.get(key="refund:rollback").status == "succeeded"


def test_rolled_back_succeed_without_exception_is_recorded_failed():
    with idempotent("refund:swallowed") as claim:
        try:
            with transaction.atomic():
                claim.succeed({"x": 1})
                raise ValueError("rolled back")
        except ValueError:
            pass
    record = IdempotencyRecord.objects.get(key="refund:swallowed")
    assert record.status == "failed" and "rolled back" in record.error


def test_leaving_block_without_succeed_records_success_none():
    with idempotent("receipt:1") as claim:
        assert not claim.done
    record = IdempotencyRecord.objects.get(key="receipt:1")
    assert record.status == "succeeded" and record.result is None


@pytest.mark.slow
def test_sigkilled_claimer_blocks_until_lease_expires_then_is_taken_over(rconn):
    proc = racers.start("claim_and_hang", "refund:killed", "2.0")
    try:
        line = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert line == "claimed", proc.stderr.read()  # type: ignore[union-attr]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    with pytest.raises(IdempotencyInProgress):
        with idempotent("refund:killed"):
            pytest.fail("must not run while the dead claimer's lease is live")
    record = IdempotencyRecord.objects.get(key="refund:killed")
    assert record.status == "running"
    time.sleep(max(0.0, (record.lease_expires_at - timezone.now()).total_seconds()) + 0.1)
    with idempotent("refund:killed") as claim:
        assert not claim.done and claim.attempts == 2
        claim.succeed("done")
    record.refresh_from_db()
    assert (record.status, record.attempts) == ("succeeded", 2)


def test_taken_over_claim_cannot_succeed():
    with pytest.raises(IdempotencyClaimLost, match="taken over"):
        with idempotent("refund:slow", lease=0.2) as slow:
            # The lease runs out while this claim is still working.
            lease = IdempotencyRecord.objects.get(key="refund:slow").lease_expires_at
            time.sleep(max(0.0, (lease - timezone.now()).total_seconds()) + 0.1)
            with idempotent("refund:slow") as fresh:
                assert fresh.attempts == 2
                fresh.succeed({"by": "fresh"})
            slow.succeed({"by": "slow"})
    record = IdempotencyRecord.objects.get(key="refund:slow")
    assert record.status == "succeeded" and record.result == {"by": "fresh"}


def test_fingerprint_mismatch_raises():
    with idempotent("refund:fp", fingerprint={"amount": "10.00"}) as claim:
        claim.succeed(1)
    with pytest.raises(IdempotencyKeyMismatch, match="other arguments"):
        with idempotent("refund:fp", fingerprint={"amount": "99.00"}):
            pytest.fail("must not run")
    with idempotent("refund:fp", fingerprint={"amount": "10.00"}) as claim:
        assert claim.done and claim.result == 1


def test_failure_stores_error_and_next_claim_runs_again():
    with pytest.raises(RuntimeError):
        with idempotent("receipt:fail"):
            raise RuntimeError("SMTP 451 try later")
    record = IdempotencyRecord.objects.get(key="receipt:fail")
    assert record.status == "failed" and "SMTP 451" in record.error
    with idempotent("receipt:fail") as claim:
        assert not claim.done and claim.attempts == 2
        claim.succeed("sent")
    record.refresh_from_db()
    assert record.status == "succeeded" and record.error == ""


def test_happy_path_statement_counts():
    with CaptureQueriesContext(connection) as claiming:
        spec = idempotent("count:1")
        claim = spec.__enter__()
    with CaptureQueriesContext(connection) as succeeding:
        claim.succeed({"ok": True})
    spec.__exit__(None, None, None)
    assert len(claiming.captured_queries) <= 2, claiming.captured_queries
    assert len(succeeding.captured_queries) == 1, succeeding.captured_queries


def test_bad_input():
    with pytest.raises(ValueError, match="key"):
        idempotent("")
    with pytest.raises(ValueError, match="key"):
        idempotent("x" * 256)
    with pytest.raises(ValueError, match="lease"):
        idempotent("k", lease=0)
    with pytest.raises(IdempotencyError, match="JSON"):
        with idempotent("k") as claim:
            claim.succeed(object())
    assert IdempotencyRecord.objects.get(key="k").status == "failed"


def test_purge_deletes_only_expired_in_batches():
    now = timezone.now()
    for i in range(25):
        with idempotent(f"old:{i}") as claim:
            claim.succeed(i)
    IdempotencyRecord.objects.filter(key__startswith="old:").update(
        expires_at=now - timezone.timedelta(seconds=1)
    )
    for i in range(5):
        with idempotent(f"live:{i}") as claim:
            claim.succeed(i)
    out = StringIO()
    call_command("joblock_purge", "--dry-run", stdout=out)
    assert "25 expired" in out.getvalue()
    assert IdempotencyRecord.objects.count() == 30
    out = StringIO()
    call_command("joblock_purge", "--batch-size", "10", stdout=out)
    assert "Deleted 25" in out.getvalue() and "3 batch(es)" in out.getvalue()
    assert sorted(IdempotencyRecord.objects.values_list("key", flat=True)) == [
        f"live:{i}" for i in range(5)
    ]


def test_purge_rejects_bad_batch_size():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="batch-size"):
        call_command("joblock_purge", "--batch-size", "0")


def test_admin_is_read_only_and_filterable(admin_client):
    with idempotent("admin:1", scope="refunds") as claim:
        claim.succeed({"amount": "10.00"})
    url = "/admin/django_joblock/idempotencyrecord/"
    page = admin_client.get(url + "?status__exact=succeeded&q=admin")
    assert page.status_code == 200 and b"admin:1" in page.content
    assert admin_client.get(url + "add/").status_code == 403
    record = IdempotencyRecord.objects.get(key="admin:1")
    detail = admin_client.get(f"{url}{record.pk}/change/")
    assert detail.status_code == 200 and b"&quot;amount&quot;: &quot;10.00&quot;" in detail.content
    assert admin_client.post(f"{url}{record.pk}/delete/").status_code == 403


def test_async_with_idempotent_runs_the_block_once_and_replays_the_result():
    import asyncio

    runs: list[str] = []

    async def send_receipt(tag: str) -> object:
        async with idempotent("areceipt:1") as claim:
            if claim.done:
                return claim.result
            runs.append(tag)
            await asyncio.sleep(0.05)
            await claim.asucceed({"sent_by": tag})
            return claim.result

    async def scenario() -> list[object]:
        first = await send_receipt("first")
        again = await send_receipt("again")  # a replay
        return [first, again]

    assert asyncio.run(scenario()) == [{"sent_by": "first"}, {"sent_by": "first"}]
    assert runs == ["first"]

    async def concurrent() -> list[object]:
        async def claim_running(key: str) -> str:
            try:
                async with idempotent(key):
                    await asyncio.sleep(0.3)
                    return "ran"
            except IdempotencyInProgress:
                return "in progress"

        return await asyncio.gather(*(claim_running("areceipt:2") for _ in range(2)))

    assert sorted(asyncio.run(concurrent())) == ["in progress", "ran"]


def test_an_async_block_that_raises_records_the_failure_and_a_retry_runs_again():
    import asyncio

    async def failing() -> None:
        async with idempotent("areceipt:3"):
            raise RuntimeError("the mail server said no")

    with pytest.raises(RuntimeError):
        asyncio.run(failing())
    record = IdempotencyRecord.objects.get(key="areceipt:3")
    assert record.status == "failed" and "mail server" in record.error

    async def retry() -> bool:
        async with idempotent("areceipt:3") as claim:
            return claim.done

    assert asyncio.run(retry()) is False, "a failure is not replayed: the retry runs"


# An exception's text is whatever its raiser chose (a provider's body, a file name decoded with
# surrogateescape): writing it raw raised DataError (PostgreSQL, NUL) or UnicodeEncodeError (a
# lone surrogate, every backend) from the block's end, replacing the block's own exception and
# leaving the record "running" until its lease ran out (review).
@pytest.mark.parametrize(
    ("text", "stored"), [("a\x00b", "a\\x00b"), ("file \udcff.txt", "file \\udcff.txt")]
)
def test_a_failure_whose_text_the_database_cannot_store_is_recorded_escaped(text, stored):
    with pytest.raises(RuntimeError) as raised:
        with idempotent("text:1"):
            raise RuntimeError(text)
    assert raised.value.args == (text,), "the block's own exception comes out"
    record = IdempotencyRecord.objects.get(key="text:1")
    assert (record.status, record.error) == ("failed", f"RuntimeError: {stored}")
    with idempotent("text:1") as claim:
        assert not claim.done and claim.attempts == 2, "a retry runs at once"


def _duplicate_account() -> None:
    Account.objects.create(name="taken")


def _bad_raw_sql() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table")


# Django runs no query in a transaction an error broke until its atomic block ends (an
# IntegrityError under ATOMIC_REQUESTS), nor does PostgreSQL after raw SQL failed: recording
# the failure there raised TransactionManagementError (or InternalError) from the block's end,
# in place of the block's own exception (review). The enclosing transaction rolls back, the
# claim with it.
@pytest.mark.parametrize("breaks", [_duplicate_account, _bad_raw_sql])
def test_the_blocks_exception_comes_out_of_a_transaction_it_broke(breaks):
    Account.objects.create(name="taken")
    with pytest.raises(DatabaseError) as raised, transaction.atomic():
        with idempotent("broken:1"):
            breaks()
    assert not isinstance(raised.value, (TransactionManagementError, InternalError))
    assert breaks is _bad_raw_sql or isinstance(raised.value, IntegrityError)
    assert not IdempotencyRecord.objects.filter(key="broken:1").exists(), "rolled back"
    with idempotent("broken:1") as claim:
        assert not claim.done and claim.attempts == 1, "the next claim runs"


# PostgreSQL's jsonb keeps a number as numeric and writes it back without an exponent: a float
# of 1e16 or more was replayed as an int (1e+20 as 100000000000000000000), and 1.5e+300 as an
# int that is not even equal to the float, where SQLite replayed the float (review).
@pytest.mark.parametrize("big", [1e16, -1e20, 1.5e300, 1.7976931348623157e308])
def test_a_big_float_result_replays_as_the_same_float_on_every_backend(big):
    result = {"amount": big, "parts": [big, 2**70, "1e+20"]}
    with idempotent("float:1") as claim:
        claim.succeed(result)
    with idempotent("float:1") as claim:
        assert claim.done and claim.result == result
        assert type(claim.result["amount"]) is float and type(claim.result["parts"][1]) is int
    assert IdempotencyRecord.objects.get(key="float:1").result == result


def test_an_async_claim_cancelled_while_it_waits_for_the_database_is_not_left_running():
    """Review bug: ``async with idempotent(...)`` cancelled (``asyncio.timeout``, a client
    gone) while its claim waited for the database let the claim go on in its thread: the
    record was inserted ``running`` with a live lease that nothing ended, and every retry got
    IdempotencyInProgress for the whole lease (300 s)."""
    import asyncio

    class Rollback(Exception):
        pass

    entered = threading.Event()

    def other_claimer() -> None:  # holds the key's insert open, uncommitted, then rolls back
        try:
            with transaction.atomic(), idempotent("acancel:1", lease=600):
                entered.set()
                time.sleep(1.0)
                raise Rollback
        except Rollback:
            pass
        finally:
            connection.close()

    blocker = threading.Thread(target=other_claimer)
    blocker.start()
    assert entered.wait(10)

    async def cancelled_claim() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3), idempotent("acancel:1", lease=600):
                pytest.fail("the block must not run")

    try:
        asyncio.run(cancelled_claim())
    finally:
        blocker.join()

    async def retry() -> str:
        async with idempotent("acancel:1", lease=600) as claim:
            return "replayed" if claim.done else "ran"

    assert asyncio.run(retry()) == "ran", "a retry runs at once"
