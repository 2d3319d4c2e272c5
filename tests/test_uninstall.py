"""Uninstall: ``joblock_purge --redis`` removes every key django-joblock wrote, and only those."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from django_joblock import lock, metrics
from django_joblock.monitor import cleanup
from django_joblock.monitor.control import force_release
from tests.harness import wait_for

pytestmark = pytest.mark.django_db


PREFIX = "uninstall"


def _ours(rconn) -> set[str]:  # type: ignore[no-untyped-def]
    return {key.decode() for key in rconn.scan_iter(match=f"{PREFIX}:*")}


def test_purge_redis_removes_every_key_of_the_app_and_nothing_else(rconn, capsys, settings):
    # A KEY_PREFIX of its own: what an earlier test's thread still writes under the default
    # one (CI saw an index entry of family "res" appear after the purge) is not this test's.
    settings.JOBLOCK = {**settings.JOBLOCK, "KEY_PREFIX": PREFIX}
    rconn.set(f"{PREFIX}x:not-ours", 1)  # same start, another namespace
    rconn.set("cache:page", 1)
    with lock("order:1", ttl=30):
        pass  # leaves the fence counter
    held = lock("order:2", ttl=30)
    assert held.acquire()
    assert wait_for(lambda: rconn.zcard(f"{PREFIX}:active:order"), 3), "indexed after 0.5 s"
    force_release("order:2", reason="uninstall test", actor="test")  # leaves an operator note
    other = lock("tenant:7", ttl=30)
    assert other.acquire()
    assert wait_for(lambda: rconn.zcard(f"{PREFIX}:active:tenant"), 3)
    metrics.count("duplicates_blocked", "refund", "x")
    metrics.flush_now()
    before = _ours(rconn)
    assert {
        f"{PREFIX}:{{order:1}}:fence",
        f"{PREFIX}:families",
        f"{PREFIX}:{{metrics}}:total",
    } <= before
    assert any(key.endswith(":lock") for key in before)

    with pytest.raises(CommandError, match=r"1 lock\(s\) are held right now"):
        call_command("joblock_purge", "--redis")
    assert _ours(rconn) == before, "refused: nothing removed"

    call_command("joblock_purge", "--redis", "--dry-run")
    assert "would be removed" in capsys.readouterr().out
    assert _ours(rconn) == before

    assert other.release()
    assert cleanup.held_locks() == 0  # the index and families set go with the last lock
    left = _ours(rconn)
    assert f"{PREFIX}:{{metrics}}:total" in left and f"{PREFIX}:{{order:1}}:fence" in left
    call_command("joblock_purge", "--redis")
    out = capsys.readouterr().out
    assert f"Removed {len(left)} key(s)" in out and "fence" in out and "metrics" in out
    assert _ours(rconn) == set()
    assert rconn.exists(f"{PREFIX}x:not-ours") and rconn.exists("cache:page")


def test_force_only_goes_with_redis():
    with pytest.raises(CommandError, match="--force only goes with --redis"):
        call_command("joblock_purge", "--force")


@pytest.mark.slow
def test_a_project_keeps_fencedmodel_after_removing_the_app(tmp_path):
    """docs/upgrading.md's uninstall keeps ``FencedModel`` in the user's models: every
    ``manage.py`` command crashed ("IdempotencyRecord doesn't declare an explicit app_label")."""
    import subprocess
    import sys

    from tests.harness import ROOT

    (tmp_path / "shop").mkdir()
    (tmp_path / "shop" / "__init__.py").write_text("")
    (tmp_path / "shop" / "models.py").write_text(
        "from django.db import models\n"
        "from django_joblock import FencedModel, fenced_update  # noqa: F401\n\n\n"
        "class Order(FencedModel):\n"
        "    total = models.IntegerField(default=0)\n"
    )
    (tmp_path / "uninstalled.py").write_text(
        "SECRET_KEY = 'x'\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django.contrib.auth', 'shop']\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', 'NAME': ':memory:'}}\n"
        "DEFAULT_AUTO_FIELD = 'django.db.models.BigAutoField'\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "django", "check"],
        env={**env, "DJANGO_SETTINGS_MODULE": "uninstalled"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no issues" in done.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "django", "shell", "-c",
         "from shop.models import Order; print([f.name for f in Order._meta.fields])"],
        env={**env, "DJANGO_SETTINGS_MODULE": "uninstalled"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert "lock_fence" in shown.stdout, shown.stderr[-2000:]


def test_purge_refuses_the_keys_of_another_project(rconn):
    """Two projects sharing Redis and the default prefix: one's uninstall removed the other's
    keys. Refused unless --force; --dry-run still shows them."""
    rconn.set("joblock:project", "0123456789ab")  # another project claimed the prefix
    rconn.set("joblock:{order:1}:fence", 5)
    with pytest.raises(CommandError, match=r"another project \(0123456789ab"):
        call_command("joblock_purge", "--redis")
    assert rconn.exists("joblock:{order:1}:fence"), "nothing removed"
    call_command("joblock_purge", "--redis", "--dry-run")
    call_command("joblock_purge", "--redis", "--force")
    assert not rconn.exists("joblock:{order:1}:fence", "joblock:project")
