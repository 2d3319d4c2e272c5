"""Bad input gets a clear exception naming it, and nothing is written to Redis."""

from __future__ import annotations

import pytest

from django_joblock import InvalidResource, JoblockConfigError, LockError, lock
from django_joblock.locks.keys import family, validate_resource


@pytest.mark.parametrize(
    ("resource", "fragment"),
    [
        ("", "empty"),
        ("x" * 201, "201 characters"),
        ("order 1", "' '"),
        ("order:{1}", "'{}'"),
        ("ordér:1", "'é'"),
        ("order:1\n", "'\\n'"),
    ],
)
def test_invalid_resources_are_rejected_by_name(resource, fragment, rconn):
    with pytest.raises(InvalidResource) as info:
        lock(resource)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert rconn.dbsize() == 0


def test_non_string_resource():
    with pytest.raises(InvalidResource, match="must be a str"):
        lock(123)  # type: ignore[arg-type]


def test_valid_resource_characters_and_family():
    assert validate_resource("tenant:45:billing-sync@eu/1.2_x") == "tenant:45:billing-sync@eu/1.2_x"
    assert family("tenant:45:billing-sync") == "tenant"
    assert family("nightly") == "other"  # no ':' : ids must not become families
    assert validate_resource("x" * 200)


@pytest.mark.parametrize("ttl", [0, -5, "30", None.__class__])
def test_bad_ttl(ttl):
    with pytest.raises(ValueError, match="ttl"):
        lock("order:1", ttl=ttl)


def test_bad_wait_and_max_hold():
    with pytest.raises(ValueError, match="wait"):
        lock("order:1", wait=-1)
    with pytest.raises(ValueError, match="max_hold"):
        lock("order:1", max_hold=0)
    held = lock("order:1")
    with pytest.raises(ValueError, match="wait"):
        held.acquire(wait=-0.5)


def test_unknown_setting_key_fails_loudly(settings):
    settings.JOBLOCK = {"LOCK_TTL": 30, "HEARTBEAT": 10}
    with pytest.raises(JoblockConfigError, match="HEARTBEAT"):
        lock("order:1")


def test_heartbeat_setting_not_shorter_than_ttl_fails_loudly(settings):
    settings.JOBLOCK = {"LOCK_TTL": 5, "HEARTBEAT_INTERVAL": 5}
    with pytest.raises(JoblockConfigError, match="E004"):
        lock("order:1")


def test_unknown_cache_alias(rconn):
    with pytest.raises(JoblockConfigError, match="nope"):
        lock("order:1", cache="nope").acquire()


def test_non_django_redis_alias():
    with pytest.raises(JoblockConfigError, match="django-redis"):
        lock("order:1", cache="locmem").acquire()


def test_acquiring_twice_is_an_error(rconn):
    held = lock("order:1", ttl=5)
    assert held.acquire()
    with pytest.raises(LockError, match="already holds"):
        held.acquire()
    held.release()


@pytest.mark.django_db
@pytest.mark.parametrize("lease", [float("nan"), float("inf"), 1e300, 0, -1, "300", True])
def test_idempotent_lease_must_be_finite_and_in_range(lease):
    from django_joblock import IdempotencyRecord, idempotent

    with pytest.raises(ValueError, match=r"idempotent\(\): lease"):
        idempotent("receipt:1", lease=lease)
    assert not IdempotencyRecord.objects.exists()
