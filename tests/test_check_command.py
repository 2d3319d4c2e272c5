"""Every system check id end to end, through ``manage.py check`` (and ``check --deploy``).

A finding must come out as the documented ``django_joblock.E0xx`` / ``W0xx`` message: errors
stop the command with ``SystemCheckError``, warnings are printed and the command goes on.
Nothing may crash the check framework itself.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from django_joblock import checks, locked_job
from django_joblock.jobs.decorator import registry

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.django_db


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """Only the jobs a test declares are registered while it runs."""
    before = dict(registry)
    registry.clear()
    yield
    registry.clear()
    registry.update(before)


def check(*, deploy: bool = False) -> tuple[str, str | None]:
    """Run ``manage.py check``: (everything printed, the SystemCheckError text or None)."""
    out, err = StringIO(), StringIO()
    try:
        call_command("check", deploy=deploy, stdout=out, stderr=err)
    except SystemCheckError as exc:
        return out.getvalue() + err.getvalue(), str(exc)
    return out.getvalue() + err.getvalue(), None


def assert_error(check_id: str, text: str, *, deploy: bool = False) -> None:
    printed, error = check(deploy=deploy)
    assert error is not None, f"{check_id} must stop the command; printed: {printed}"
    assert f"django_joblock.{check_id}" in error and text in error, error


def assert_warning(check_id: str, text: str, *, deploy: bool = False) -> None:
    printed, error = check(deploy=deploy)
    assert error is None, f"{check_id} is a warning and must not stop the command: {error}"
    assert f"django_joblock.{check_id}" in printed and text in printed, printed


@pytest.mark.parametrize(
    ("joblock", "check_id", "text"),
    [
        (["not", "a", "dict"], "E001", "JOBLOCK must be a dict"),
        ({"LOCK_TLL": 30}, "E002", "LOCK_TLL"),
        ({"REQUEUE_BACKOFF": {"bsae": 1}}, "E002", "bsae"),
        ({"LOCK_TTL": -1}, "E003", "LOCK_TTL"),
        ({"ON_LOCK_LOST": "explode"}, "E003", "ON_LOCK_LOST"),
        ({"LOCK_TTL": 10, "HEARTBEAT_INTERVAL": 10}, "E004", "HEARTBEAT_INTERVAL"),
        ({"REDIS_ALIAS": "locmem"}, "E005", "locmem"),
        ({"REDIS_ALIAS": "nope"}, "E005", "nope"),
        ({"REPLICA_ACKS": 1.5}, "E003", "REPLICA_ACKS"),
        ({"REPLICA_ACKS": -1}, "E003", "REPLICA_ACKS"),
        ({"REPLICA_ACK_TIMEOUT": float("nan")}, "E003", "REPLICA_ACK_TIMEOUT"),
        ({"REDIS_CLIENT": "not a path"}, "E003", "REDIS_CLIENT"),
        ({"REDIS_CLIENT": "tests.nowhere.make"}, "E007", "cannot be imported"),
        ({"REDIS_CLIENT": "tests.settings.REDIS_URL"}, "E007", "is not callable"),
        ({"REDIS_CLIENT": "builtins.dict"}, "E007", "not a redis-py client"),
        # Review bug: the message wrote the value in full, and Python refuses to write an int
        # of more than 4300 digits: check crashed with ValueError instead of E003.
        ({"LOCK_TTL": 10**5000}, "E003", "got an int of 16610 bits"),
        ({"MAX_HOLD": -(10**5000)}, "E003", "MAX_HOLD"),
        ({"WAITER_TTL": 10**5000}, "E003", "WAITER_TTL"),
        # ... and a megabyte value in full: the message shows its start.
        ({"KEY_PREFIX": "x" * 1_000_000}, "E003", "'xxxx"),
    ],
)
def test_setting_errors_stop_manage_py_check(settings, joblock, check_id, text):
    settings.JOBLOCK = joblock
    assert_error(check_id, text)
    assert len(check()[1] or "") < 2000, "the message shows a long value cut short"


@pytest.mark.parametrize(
    ("joblock", "check_id", "text"),
    [
        ({"LOCK_TTL": 10, "HEARTBEAT_INTERVAL": 6}, "W001", "more than half"),
        ({"IDEMPOTENCY_TTL": 60, "REQUEUE_MAX_WAIT": 3600}, "W003", "REQUEUE_MAX_WAIT"),
        (
            {"IDEMPOTENCY_TTL": 60, "IDEMPOTENCY_LEASE": 300, "REQUEUE_MAX_WAIT": 10},
            "W005",
            "IDEMPOTENCY_LEASE",
        ),
        ({"ALERTS": {"BASELINE": 600, "WINDOW": 3600}}, "W013", "never fires"),
        ({"ALERTS": {"BASELINE": 600, "WINDOW": 600}}, "W013", "BASELINE'] (600s)"),
        ({"ALERTS": {"WINDOW": 86400}}, "W014", "= 90060s"),
        ({"METRICS_RETENTION": 600}, "W014", "METRICS_RETENTION'] (600s)"),
        ({"REPLICA_ACKS": 1, "REPLICA_ACK_TIMEOUT": 5}, "W017", "REDIS_TIMEOUT (2s)"),
        (
            {"REPLICA_ACKS": 1, "REPLICA_ACK_TIMEOUT": 2, "REDIS_TIMEOUT": 2},
            "W017",
            "REPLICA_ACK_TIMEOUT'] (2s)",
        ),
    ],
)
def test_setting_warnings_are_printed_not_raised(settings, joblock, check_id, text):
    settings.JOBLOCK = joblock
    assert_warning(check_id, text)


def test_a_replica_ack_wait_within_the_socket_timeout_raises_no_warning(settings):
    settings.JOBLOCK = {"REPLICA_ACKS": 1, "REPLICA_ACK_TIMEOUT": 1, "REDIS_TIMEOUT": 2}
    printed, error = check()
    assert error is None and "W017" not in printed, printed
    settings.JOBLOCK = {"REPLICA_ACK_TIMEOUT": 5}  # without REPLICA_ACKS nothing waits
    printed, error = check()
    assert error is None and "W017" not in printed, printed


def test_alert_periods_that_fit_raise_no_warning(settings):
    settings.JOBLOCK = {"ALERTS": {"BASELINE": 3600, "WINDOW": 300}, "METRICS_RETENTION": 3960}
    printed, error = check()
    assert error is None and "W013" not in printed and "W014" not in printed, printed


def test_unknown_queue_of_a_decorated_job_is_e006(scratch_registry):
    @locked_job("low", lock="x:{a}")
    def job_on_low(a: int) -> None: ...

    printed, error = check()
    assert error is not None and "django_joblock.E006" in error, printed
    assert "'low'" in error and "default" in error and "other" in error, error


def test_w002_heartbeat_off_ttl_shorter_than_job_timeout(scratch_registry):
    @locked_job("default", lock="x:{a}", ttl=30, heartbeat=False, job_timeout=600)
    def slow(a: int) -> None: ...

    assert_warning("W002", "slow")


def test_w004_requeue_window_longer_than_records_live(scratch_registry, settings):
    settings.JOBLOCK = {"IDEMPOTENCY_TTL": 3600, "REQUEUE_MAX_WAIT": 60}

    @locked_job("default", lock="x:{a}", idempotency_key="k:{a}", max_wait=7200)
    def late(a: int) -> None: ...

    assert_warning("W004", "late")


def test_w006_idempotency_only_job_may_outlive_its_lease(scratch_registry):
    @locked_job("default", idempotency_key="k:{a}", job_timeout=600)
    def long_claim(a: int) -> None: ...

    assert_warning("W006", "long_claim")
    registry.clear()

    @locked_job("default", idempotency_key="k:{a}", job_timeout=60)
    def short_claim(a: int) -> None: ...

    printed, error = check()
    assert error is None and "W006" not in printed, "negative control: 60 s < 300 s lease"


def test_w010_redis_unreachable_on_deploy(settings):
    settings.JOBLOCK = {"REDIS_ALIAS": "down"}
    printed, _ = check()
    assert "W010" not in printed, "W010 is a deploy-only check"
    assert_warning("W010", "does not answer", deploy=True)


@pytest.mark.slow
def test_w011_eviction_policy_on_deploy(server, rconn):
    rconn.config_set("maxmemory", 512 * 1024 * 1024)
    rconn.config_set("maxmemory-policy", "allkeys-lru")
    try:
        assert_warning("W011", "allkeys-lru", deploy=True)
    finally:
        rconn.config_set("maxmemory-policy", "noeviction")
    printed, _ = check(deploy=True)
    assert "W011" not in printed, "negative control: noeviction is fine"


def test_w012_no_scheduler_on_deploy(scratch_registry, rconn):
    @locked_job("default", lock="x:{a}")
    def requeues(a: int) -> None: ...

    assert_warning("W012", "'default'", deploy=True)


def test_clean_settings_give_no_joblock_finding(scratch_registry):
    printed, error = check(deploy=True)
    assert error is None and "django_joblock." not in printed, printed


@pytest.mark.slow
def test_a_warning_does_not_break_joblock_commands():
    """A real ``manage.py`` process runs the checks before the command, as users do."""
    env = dict(
        os.environ,
        DJANGO_SETTINGS_MODULE="tests.settings",
        JOBLOCK_TEST_SETTINGS=json.dumps({"LOCK_TTL": 10, "HEARTBEAT_INTERVAL": 6}),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "django", "joblock_locks"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "django_joblock.W001" in proc.stderr and "No active locks." in proc.stdout


def test_w010_for_a_queue_redis_that_does_not_answer(scratch_registry, settings):
    from tests import harness

    settings.RQ_QUEUES = {"default": {"URL": harness.dead_url()}}

    @locked_job("default", lock="x:{a}")
    def requeues(a: int) -> None: ...

    assert_warning("W010", "Redis of RQ queue 'default' does not answer", deploy=True)


def test_command_arguments_are_checked():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--limit must be 1 to 1000000, got 0"):
        call_command("joblock_locks", "--limit", "0")
    with pytest.raises(CommandError, match="Invalid family"):
        call_command("joblock_locks", "--family", "<b>")
    with pytest.raises(CommandError, match="--max-jobs must be >= 1"):
        call_command("joblock_worker", "default", "--max-jobs", "0")


def _warning_jobs() -> None:
    @locked_job("default", lock="x:{a}", ttl=30, heartbeat=False, job_timeout=600)
    def slow(a: int) -> None: ...  # W002

    @locked_job("default", lock="x:{a}", idempotency_key="k:{a}", max_wait=7200)
    def late(a: int) -> None: ...  # W004 (and W012: it requeues, and no scheduler runs)

    @locked_job("default", idempotency_key="k:{a}", job_timeout=600)
    def long_claim(a: int) -> None: ...  # W006


def _job_on_unknown_queue() -> None:
    @locked_job("low", lock="x:{a}")
    def job_on_low(a: int) -> None: ...  # E006


# Settings (and jobs) under which ``check --deploy`` must report each id; errors stop the
# later checks, so each error has a run of its own.
TAGGED_RUNS: list[tuple[object, Any, set[str]]] = [
    (["not", "a", "dict"], None, {"E001"}),
    ({"LOCK_TLL": 30}, None, {"E002"}),
    ({"LOCK_TTL": -1}, None, {"E003"}),
    ({"LOCK_TTL": 10, "HEARTBEAT_INTERVAL": 10}, None, {"E004"}),
    ({"REDIS_ALIAS": "locmem"}, None, {"E005"}),
    ({}, _job_on_unknown_queue, {"E006"}),
    ({"REDIS_CLIENT": "builtins.dict"}, None, {"E007"}),
    ({"REDIS_ALIAS": "down"}, None, {"W010"}),
    (
        {
            "LOCK_TTL": 10,
            "HEARTBEAT_INTERVAL": 6,  # W001
            "IDEMPOTENCY_TTL": 60,  # W003 (< REQUEUE_MAX_WAIT), W005 (< IDEMPOTENCY_LEASE)
            "IDEMPOTENCY_LEASE": 300,
            "REQUEUE_MAX_WAIT": 3600,
            "ALERTS": {"BASELINE": 600, "WINDOW": 900},  # W013; W014 (> METRICS_RETENTION)
            "METRICS_RETENTION": 900,
            "REPLICA_ACKS": 1,  # W017 (with REPLICA_ACK_TIMEOUT >= REDIS_TIMEOUT)
            "REPLICA_ACK_TIMEOUT": 5,
        },
        _warning_jobs,  # W002, W004, W006, W012; W011 from the server's eviction policy
        {"W001", "W002", "W003", "W004", "W005", "W006", "W011", "W012", "W013", "W014", "W017"},
    ),
]


@pytest.mark.slow
def test_all_checks_registered_under_the_app_tag(scratch_registry, settings, server, rconn):
    """``manage.py check --tag django_joblock --deploy`` reports every id the checks module
    documents: a check registered without the app's tag (or not at all) would be missing."""
    documented = set(re.findall(r"^([EW]\d{3})\s", checks.__doc__ or "", re.M))
    reported: set[str] = set()
    rconn.config_set("maxmemory", 512 * 1024 * 1024)
    for joblock, declare, expected in TAGGED_RUNS:
        settings.JOBLOCK = joblock
        registry.clear()
        if declare is not None:
            declare()
        policy = "allkeys-lru" if "W011" in expected else "noeviction"
        rconn.config_set("maxmemory-policy", policy)
        out = StringIO()
        try:
            call_command("check", tags=[checks.TAG], deploy=True, stdout=out, stderr=out)
        except SystemCheckError as exc:
            out.write(str(exc))
        finally:
            rconn.config_set("maxmemory-policy", "noeviction")
        found = set(re.findall(r"django_joblock\.([EW]\d{3})", out.getvalue()))
        assert found == expected, (joblock, out.getvalue())
        reported |= found
    # E008 needs a Redis Cluster client: tests/test_cluster.py makes it fire through
    # manage.py check (test_replica_acks_on_cluster_is_e008_and_refused); W015 needs other
    # DATABASES (test_w015_for_sqlite_with_deferred_transactions, with the app's tag too);
    # W016 another project's claim (test_w016_for_a_key_prefix_another_project_claimed).
    missing = documented - reported
    assert missing == {"E008", "W015", "W016"}, f"documented, never reported: {missing}"


def test_w015_for_sqlite_with_deferred_transactions(settings):
    """Django's default SQLite transactions: 10 of 12 lock-only jobs on 12 different resources
    failed with "database is locked". IMMEDIATE (and a timeout) lets them queue instead."""
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "OPTIONS": {}}  # Django's defaults
    default = {**settings.DATABASES["default"], **sqlite}
    settings.DATABASES = {**settings.DATABASES, "default": default}
    assert_warning("W015", "deferred transactions")
    tagged = StringIO()
    call_command("check", tags=[checks.TAG], stdout=tagged, stderr=tagged)
    assert "django_joblock.W015" in tagged.getvalue()
    settings.DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 20}
    printed, error = check()
    assert error is None and "W015" not in printed, printed


def test_w016_for_a_key_prefix_another_project_claimed(rconn):
    """Two projects on one Redis with the default KEY_PREFIX saw each other's locks, and a
    purge removed the other's keys, without a word. ``migrate`` claims the prefix; the check
    only reads the claim."""
    from django_joblock.monitor import cleanup

    rconn.set("joblock:project", "0123456789ab")  # another project's SECRET_KEY hash
    assert_warning("W016", "belongs to another project (0123456789ab", deploy=True)
    tagged = StringIO()
    call_command("check", tags=[checks.TAG], deploy=True, stdout=tagged, stderr=tagged)
    assert "django_joblock.W016" in tagged.getvalue()
    rconn.delete("joblock:project")
    printed, _error = check(deploy=True)
    assert "django_joblock.W016" not in printed, "negative control: unclaimed"
    assert not rconn.exists("joblock:project"), "the check writes nothing"
    call_command("migrate", verbosity=0)
    assert rconn.get("joblock:project").decode() == cleanup.project_id(), "claimed by migrate"
    printed, _error = check(deploy=True)
    assert "django_joblock.W016" not in printed, "this project's own claim"


CALLS: list[str] = []


def counting_client() -> Any:
    """A ``REDIS_CLIENT`` factory that counts its calls (the test Redis)."""
    import redis

    from tests import harness

    CALLS.append("made")
    return redis.Redis.from_url(harness.redis_url())


def test_check_deploy_makes_the_client_once_and_writes_nothing(settings, rconn):
    """One ``check --deploy --tag django_joblock`` called the REDIS_CLIENT factory 4 times and
    left ``joblock:project`` in Redis; now once, and no key."""
    settings.JOBLOCK = {"REDIS_CLIENT": "tests.test_check_command.counting_client"}
    CALLS.clear()
    out = StringIO()
    call_command("check", tags=[checks.TAG], deploy=True, stdout=out, stderr=out)
    assert "W010" not in out.getvalue(), "negative control: the client answered"
    assert CALLS == ["made"]
    assert rconn.dbsize() == 0, rconn.keys()
