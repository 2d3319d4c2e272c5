"""One test per system check id, plus the runtime errors for bad settings."""

from __future__ import annotations

import pytest
from django.core import checks
from django.test import override_settings

from django_joblock import JoblockConfigError, conf
from django_joblock.checks import check_redis_alias, check_redis_server, check_settings


def ids(messages) -> list[str]:  # type: ignore[no-untyped-def]
    return [m.id for m in messages]


def test_default_settings_are_clean():
    assert check_settings() == []
    assert check_redis_alias() == []


@override_settings(JOBLOCK=["not", "a", "dict"])
def test_e001_joblock_not_a_dict():
    assert ids(check_settings()) == ["django_joblock.E001"]
    with pytest.raises(JoblockConfigError, match="E001"):
        conf.get()


@override_settings(JOBLOCK={"LOCK_TLL": 30})
def test_e002_unknown_key():
    messages = check_settings()
    assert ids(messages) == ["django_joblock.E002"]
    assert "LOCK_TLL" in messages[0].msg
    with pytest.raises(JoblockConfigError, match="LOCK_TLL"):
        conf.get()


@override_settings(JOBLOCK={"REQUEUE_BACKOFF": {"bsae": 1}})
def test_e002_unknown_nested_key():
    assert ids(check_settings()) == ["django_joblock.E002"]


@pytest.mark.parametrize("value", [0, -1, "30", None, True])
def test_e003_bad_ttl(value):
    with override_settings(JOBLOCK={"LOCK_TTL": value}):
        messages = check_settings()
        assert ids(messages) == ["django_joblock.E003"]
        assert "LOCK_TTL" in messages[0].msg
        with pytest.raises(JoblockConfigError, match="LOCK_TTL"):
            conf.get()


@override_settings(JOBLOCK={"ON_LOCK_LOST": "explode"})
def test_e003_bad_choice():
    assert ids(check_settings()) == ["django_joblock.E003"]


@override_settings(JOBLOCK={"LOCK_TTL": 10, "HEARTBEAT_INTERVAL": 10})
def test_e004_heartbeat_not_shorter_than_ttl():
    messages = check_settings()
    assert ids(messages) == ["django_joblock.E004"]
    with pytest.raises(JoblockConfigError, match="HEARTBEAT_INTERVAL"):
        conf.get()


@override_settings(JOBLOCK={"REDIS_ALIAS": "locmem"})
def test_e005_alias_not_django_redis():
    messages = check_redis_alias()
    assert ids(messages) == ["django_joblock.E005"]
    assert "locmem" in messages[0].msg


@override_settings(JOBLOCK={"REDIS_ALIAS": "nope"})
def test_e005_alias_missing():
    assert ids(check_redis_alias()) == ["django_joblock.E005"]


@override_settings(JOBLOCK={"LOCK_TTL": 10, "HEARTBEAT_INTERVAL": 6})
def test_w001_heartbeat_more_than_half_ttl():
    assert ids(check_settings()) == ["django_joblock.W001"]
    assert conf.get().HEARTBEAT_INTERVAL == 6  # a warning does not stop the app


@override_settings(
    JOBLOCK={"IDEMPOTENCY_TTL": 60, "IDEMPOTENCY_LEASE": 30, "REQUEUE_MAX_WAIT": 3600}
)
def test_w003_idempotency_ttl_shorter_than_requeue_window():
    assert ids(check_settings()) == ["django_joblock.W003"]


@override_settings(JOBLOCK={"REDIS_ALIAS": "down"})
def test_w010_redis_unreachable_on_deploy():
    assert ids(check_redis_server()) == ["django_joblock.W010"]


def test_w010_quiet_when_redis_answers():
    assert check_redis_server() == []


@pytest.mark.slow
def test_w011_eviction_policy(server, rconn):
    rconn.config_set("maxmemory", 512 * 1024 * 1024)
    rconn.config_set("maxmemory-policy", "allkeys-lru")
    try:
        messages = check_redis_server()
    finally:
        rconn.config_set("maxmemory-policy", "noeviction")
    assert ids(messages) == ["django_joblock.W011"]
    assert "allkeys-lru" in messages[0].msg
    assert check_redis_server() == [], "negative control: noeviction is fine"


@pytest.mark.django_db
def test_deploy_checks_run_only_with_deploy():
    deploy_ids = {m.id for m in checks.run_checks(include_deployment_checks=True)}
    plain_ids = {m.id for m in checks.run_checks()}
    assert "django_joblock.W010" not in plain_ids
    assert "django_joblock.W010" not in deploy_ids  # Redis is up in the test settings


def test_check_ids_are_unique_and_documented():
    import re

    from django_joblock import checks as module

    documented = re.findall(r"^([EW]\d{3})\s", module.__doc__ or "", re.M)
    assert len(documented) == len(set(documented))
    produced = {
        "E001",
        "E002",
        "E003",
        "E004",
        "E005",
        "E006",
        "W001",
        "W002",
        "W003",
        "W004",
        "W005",
        "W006",
        "W010",
        "W011",
        "W012",
    }
    assert produced <= set(documented)
