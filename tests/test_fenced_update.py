"""fenced_update: the database rejects a superseded holder's write (PostgreSQL and SQLite). (The
fences themselves, strictly increasing per resource, are tests/test_fence_counter.py.)"""

from __future__ import annotations

import pytest

from django_joblock import StaleFence, fenced_update, lock
from tests.harness import wait_expired
from tests.testapp.models import Account

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
