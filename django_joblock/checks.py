"""System checks. Ids are ``django_joblock.E0xx`` (errors) and ``W0xx`` (warnings); each is tested.

=========  ==================================================================================
E001       ``JOBLOCK`` is not a dict
E002       unknown key in ``JOBLOCK`` (or in its ``REQUEUE_BACKOFF`` / ``ALERTS`` dicts)
E003       a ``JOBLOCK`` value has the wrong type or range
E004       ``HEARTBEAT_INTERVAL`` >= ``LOCK_TTL``
E005       ``REDIS_ALIAS`` is not a django-redis cache in ``CACHES``
W001       ``HEARTBEAT_INTERVAL`` > ``LOCK_TTL / 2``
W003       ``IDEMPOTENCY_TTL`` shorter than ``REQUEUE_MAX_WAIT``
W010       (deploy) Redis does not answer
W011       (deploy) Redis ``maxmemory-policy`` can evict locks
=========  ==================================================================================
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from . import conf

DJANGO_REDIS_BACKEND = "django_redis.cache.RedisCache"
TAG = "django_joblock"


def _message(problem_id: str, message: str, hint: str | None = None) -> CheckMessage:
    cls = Error if problem_id.startswith("E") else Warning
    return cls(message, hint=hint, id=f"django_joblock.{problem_id}")


@register(Tags.compatibility, TAG)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001-E004, W001, W003: the shape and consistency of ``JOBLOCK``."""
    raw = getattr(settings, "JOBLOCK", None)
    found = [_message(p.id, p.message) for p in conf.problems(raw)]
    return found


@register(Tags.caches, TAG)
def check_redis_alias(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E005: the alias must name a django-redis cache (we need its raw Redis connection)."""
    raw = getattr(settings, "JOBLOCK", None) or {}
    alias = raw.get("REDIS_ALIAS", conf.DEFAULTS["REDIS_ALIAS"]) if isinstance(raw, dict) else None
    if not isinstance(alias, str):
        return []  # reported by E001 / E003
    caches = getattr(settings, "CACHES", {}) or {}
    backend = caches.get(alias, {}).get("BACKEND")
    if backend != DJANGO_REDIS_BACKEND:
        found = "missing" if alias not in caches else f"BACKEND {backend!r}"
        return [
            _message(
                "E005",
                f"JOBLOCK['REDIS_ALIAS'] = {alias!r} must name a django-redis cache in CACHES "
                f"({found}).",
                hint=f"Add CACHES[{alias!r}] = {{'BACKEND': '{DJANGO_REDIS_BACKEND}', "
                "'LOCATION': 'redis://127.0.0.1:6379/0'}, or point REDIS_ALIAS at one.",
            )
        ]
    return []


@register(Tags.caches, TAG, deploy=True)
def check_redis_server(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W010: Redis answers; W011: its eviction policy cannot silently drop locks."""
    if check_settings() or check_redis_alias():
        return []
    from .backend import connection, renewal_client

    alias = conf.get().REDIS_ALIAS
    try:
        client = renewal_client(connection(alias), timeout=2.0)
        memory = client.info("memory")
    except Exception as exc:  # noqa: BLE001 - any failure to answer is the finding
        return [
            _message(
                "W010",
                f"Redis of cache {alias!r} does not answer: {exc}",
                hint="Locks cannot be taken; every acquire raises LockBackendUnavailable.",
            )
        ]
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    maxmemory = int(memory.get("maxmemory", 0) or 0)
    if maxmemory and policy != "noeviction":
        return [
            _message(
                "W011",
                f"Redis of cache {alias!r} has maxmemory={maxmemory} with maxmemory-policy="
                f"{policy!r}: under memory pressure it may evict a held lock and let a second "
                "holder in.",
                hint="Use a Redis with maxmemory-policy noeviction (or no maxmemory) for locks.",
            )
        ]
    return []
