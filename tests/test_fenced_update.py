"""fenced_update: the database rejects a superseded holder's write (PostgreSQL and SQLite). (The
fences themselves, strictly increasing per resource, are tests/test_fence_counter.py.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.core.exceptions import FieldError
from django.db import connection, transaction

from django_joblock import StaleFence, fenced_update, lock
from tests.harness import wait_expired, wait_for
from tests.testapp.models import Account, FencedChild, Ledger, Owner

pytestmark = pytest.mark.django_db


def test_first_write_sets_the_fence():
    Account.objects.create(name="a")
    assert fenced_update(Account.objects.filter(name="a"), 10, balance=5) == 1
    row = Account.objects.get(name="a")
    assert (row.balance, row.lock_fence) == (5, 10)


def test_higher_fence_wins_and_lower_is_rejected():
    Account.objects.create(name="a")
    qs = Account.objects.filter(name="a")
    fenced_update(qs, 20, balance=1)
    with pytest.raises(StaleFence) as info:
        fenced_update(qs, 19, balance=99)
    assert (info.value.fence, info.value.current) == (19, 20)
    assert Account.objects.get(name="a").balance == 1
    assert fenced_update(qs, 21, balance=2) == 1
    assert Account.objects.get(name="a").balance == 2


def test_a_holder_writes_its_rows_again_under_its_own_fence():
    Account.objects.create(name="a")
    qs = Account.objects.filter(name="a")
    assert fenced_update(qs, 20, balance=1) == 1
    assert fenced_update(qs, 20, balance=2) == 1, "the same holding: its second write goes in"
    assert Account.objects.get(name="a").balance == 2
    fenced_update(qs, 21, balance=3)
    with pytest.raises(StaleFence):  # negative control: the older holding is refused now
        fenced_update(qs, 20, balance=4)


def test_empty_queryset_is_reported():
    with pytest.raises(StaleFence, match="no row matched"):
        fenced_update(Account.objects.filter(name="missing"), 5, balance=1)


@pytest.mark.parametrize("fence", [None, 0, -1, "5", True])
def test_bad_fence(fence):
    with pytest.raises(ValueError, match="fence"):
        fenced_update(Account.objects.all(), fence, balance=1)


def test_lock_fence_cannot_be_passed_as_a_value():
    with pytest.raises(ValueError, match="lock_fence"):
        fenced_update(Account.objects.all(), 5, lock_fence=1)


def test_expired_holder_write_is_rejected_after_new_holder_wrote(rconn):
    Account.objects.create(name="acct")
    qs = Account.objects.filter(name="acct")
    old = lock("account:acct", ttl=0.2, heartbeat=False)
    assert old.acquire()
    wait_expired(rconn, old.key, old.ttl)  # the old holder "pauses" past its TTL
    with lock("account:acct", ttl=5) as new:
        fenced_update(qs, new.fence, balance=100)
    with pytest.raises(StaleFence):
        fenced_update(qs, old.fence, balance=-1)
    assert Account.objects.get(name="acct").balance == 100


def test_without_fencing_the_stale_write_lands(rconn):
    """Negative control: a plain update from the expired holder overwrites the new holder's."""
    Account.objects.create(name="acct")
    qs = Account.objects.filter(name="acct")
    old = lock("account:acct", ttl=0.2, heartbeat=False)
    assert old.acquire()
    wait_expired(rconn, old.key, old.ttl)
    with lock("account:acct", ttl=5):
        qs.update(balance=100)
    qs.update(balance=-1)
    assert Account.objects.get(name="acct").balance == -1


@pytest.fixture(params=[True, False], ids=["self-select", "mysql-style"])
def self_select(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways of naming the rows to update: a subquery on the updated table, and (as on
    MySQL, which refuses that subquery: ``update_can_self_select``) their keys read first. Set on
    the backend's features class, so that every thread's connection sees it."""
    if not request.param:
        monkeypatch.setattr(type(connection.features), "update_can_self_select", False)
    return bool(request.param)


def test_a_queryset_that_joins_is_fenced(self_select):
    owner = Owner.objects.create(name="x")
    row = Ledger.objects.create(owner=owner)
    qs = Ledger.objects.filter(owner__name="x")
    assert fenced_update(qs, 20, balance=1) == 1
    with pytest.raises(StaleFence) as info:
        fenced_update(qs, 19, balance=99)
    assert (info.value.fence, info.value.current) == (19, 20)
    assert fenced_update(qs, 20, balance=2) == 1, "the same holding writes again"
    row.refresh_from_db()
    assert (row.balance, row.lock_fence) == (2, 20)
    with pytest.raises(StaleFence, match="no row matched"):
        fenced_update(Ledger.objects.filter(owner__name="nobody"), 30, balance=3)


def _waits_for_a_row_lock() -> bool:
    """Is a session of this test database blocked by another's lock (PostgreSQL)?"""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND cardinality(pg_blocking_pids(pid)) > 0"
        )
        return bool(cursor.fetchone()[0])


def _write_waiting_for_another(first_write: Callable[[], int], waiting: Callable[[], int]) -> Any:
    """``first_write`` runs in a transaction kept open; meanwhile ``waiting`` runs in another
    thread (so on another connection) and must wait for that transaction's row lock; once it is
    seen waiting, the first transaction commits. What ``waiting`` returned or raised
    (``StaleFence``)."""
    wrote, commit = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                first_write()
                wrote.set()
                commit.wait(10)
        finally:
            connection.close()

    def second() -> None:
        try:
            outcome["waiting"] = waiting()
        except StaleFence as exc:
            outcome["waiting"] = exc
        finally:
            connection.close()

    first_thread, second_thread = threading.Thread(target=first), threading.Thread(target=second)
    first_thread.start()
    try:
        assert wrote.wait(10), "the first transaction wrote"
        second_thread.start()
        assert wait_for(_waits_for_a_row_lock, 10), "the second write waits for the row lock"
    finally:
        commit.set()
        first_thread.join(10)
        if second_thread.ident is not None:  # started
            second_thread.join(10)
    return outcome["waiting"]


_RACE = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="a write waiting for another transaction's row lock needs PostgreSQL (SQLite "
    "serialises writers); test_a_queryset_that_joins_is_fenced covers both",
)


@_RACE
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("with_pk", [False, True], ids=["join", "pk-and-join"])
def test_a_stale_write_through_a_join_is_refused_once_the_newer_holder_commits(
    self_select, with_pk
):
    """PostgreSQL re-checks a waiting UPDATE's conditions on the row the newer holder committed,
    but only those on the updated row itself: the fence must be one of them, not inside a
    subquery of the join (before the fix the stale write landed over the newer one)."""
    row = Ledger.objects.create(owner=Owner.objects.create(name="x"), lock_fence=4)
    stale_qs = Ledger.objects.filter(owner__name="x")
    if with_pk:
        stale_qs = stale_qs.filter(pk=row.pk)
    result = _write_waiting_for_another(
        lambda: fenced_update(Ledger.objects.filter(pk=row.pk), 6, balance=600),
        lambda: fenced_update(stale_qs, 5, balance=500),
    )
    assert isinstance(result, StaleFence), f"the stale write was applied: {result!r}"
    assert (result.fence, result.current) == (5, 6)
    row.refresh_from_db()
    assert (row.balance, row.lock_fence) == (600, 6), "the newer holder's write stands"


@_RACE
@pytest.mark.django_db(transaction=True)
def test_a_stale_write_to_an_inherited_fence_is_refused_once_the_newer_holder_commits(
    self_select,
):
    """Multi-table inheritance, lock_fence on the parent's table: Django's own update() selects
    the ids first and then updates by id alone (before the fix the stale write landed)."""
    child = FencedChild.objects.create(name="c", lock_fence=4)
    qs = FencedChild.objects.filter(pk=child.pk)
    result = _write_waiting_for_another(
        lambda: fenced_update(qs, 6, name="newer"), lambda: fenced_update(qs, 5, name="stale")
    )
    assert isinstance(result, StaleFence), f"the stale write was applied: {result!r}"
    child.refresh_from_db()
    assert (child.name, child.lock_fence) == ("newer", 6)


@_RACE
@pytest.mark.django_db(transaction=True)
def test_a_single_tables_conditions_are_all_checked_on_the_row_written():
    """Without a join every condition of the queryset stays on the updated row, re-checked once
    a concurrent writer commits (a compare-and-set): a row renamed meanwhile is not written."""
    row = Account.objects.create(name="a", balance=1)
    result = _write_waiting_for_another(
        lambda: Account.objects.filter(pk=row.pk).update(name="b"),
        lambda: fenced_update(Account.objects.filter(name="a"), 5, balance=500),
    )
    assert isinstance(result, StaleFence), f"the renamed row was written: {result!r}"
    row.refresh_from_db()
    assert (row.name, row.balance, row.lock_fence) == ("b", 1, None)


def test_multi_table_inheritance_fences_the_parents_table(self_select):
    child = FencedChild.objects.create(name="c")
    qs = FencedChild.objects.filter(name="c")
    assert fenced_update(qs, 20) == 1
    assert fenced_update(qs, 20, name="c") == 1
    with pytest.raises(StaleFence) as info:
        fenced_update(qs, 19, name="stale")
    assert info.value.current == 20
    child.refresh_from_db()
    assert (child.name, child.lock_fence) == ("c", 20)


def test_multi_table_inheritance_refuses_values_of_another_table():
    """lock_fence is on the parent's table, balance on the child's: one UPDATE cannot fence
    balance, so nothing is written (before the fix it was written unguarded)."""
    child = FencedChild.objects.create(name="c", lock_fence=30)
    with pytest.raises(ValueError, match=r"testapp\.FencedChild .* testapp\.FencedParent") as info:
        fenced_update(FencedChild.objects.filter(pk=child.pk), 31, name="d", balance=5)
    assert "balance is a column of another table" in str(info.value)
    assert "transaction.atomic()" in str(info.value), "it says what to do instead"
    child.refresh_from_db()
    assert (child.name, child.balance, child.lock_fence) == ("c", 0, 30), "nothing written"


def test_the_documented_way_for_another_tables_values_is_fenced():
    """What the ValueError says to do: fenced_update() on the fence's table in a transaction,
    then a plain update() of the child's values; a stale holder is refused before writing."""
    child = FencedChild.objects.create(name="c")
    qs = FencedChild.objects.filter(pk=child.pk)
    with transaction.atomic():
        fenced_update(qs, 20)
        qs.update(balance=5)
    with pytest.raises(StaleFence), transaction.atomic():
        fenced_update(qs, 19)
        qs.update(balance=-1)  # not reached
    child.refresh_from_db()
    assert (child.balance, child.lock_fence) == (5, 20)


def test_what_update_refuses_is_refused():
    Account.objects.create(name="a")
    with pytest.raises(TypeError, match="slice"):
        fenced_update(Account.objects.all()[:1], 5, balance=1)
    with pytest.raises(FieldError, match="lock_fence"):
        fenced_update(Owner.objects.all(), 5, name="y")  # no lock_fence column
    assert Account.objects.get(name="a").lock_fence is None
