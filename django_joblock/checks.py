"""System checks. Ids are ``django_joblock.E0xx`` (errors) and ``W0xx`` (warnings); each is tested.

=========  ==================================================================================
E001       ``JOBLOCK`` is not a dict
E002       unknown key in ``JOBLOCK`` (or in its ``REQUEUE_BACKOFF`` / ``ALERTS`` dicts)
E003       a ``JOBLOCK`` value has the wrong type or range
E004       ``HEARTBEAT_INTERVAL`` >= ``LOCK_TTL``
E005       ``REDIS_ALIAS`` is not a django-redis cache in ``CACHES``
W001       ``HEARTBEAT_INTERVAL`` > ``LOCK_TTL / 2``
W002       a ``@locked_job`` with heartbeat off has a lock TTL shorter than its RQ job timeout
W003       ``IDEMPOTENCY_TTL`` shorter than ``REQUEUE_MAX_WAIT``
W004       a requeueing ``@locked_job`` waits longer (``max_wait``) than ``IDEMPOTENCY_TTL``
W010       (deploy) Redis does not answer
W011       (deploy) Redis ``maxmemory-policy`` can evict locks
W012       (deploy) no RQ scheduler runs for a queue whose jobs requeue with delays
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


def _job_specs() -> list[Any]:
    """Every ``@locked_job``, after importing the ``jobs`` / ``tasks`` modules of the apps."""
    from django.utils.module_loading import autodiscover_modules

    from .jobs import registry

    autodiscover_modules("jobs", "tasks")
    return sorted(registry.values(), key=lambda spec: spec.name)


@register(Tags.compatibility, TAG)
def check_jobs(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W002: TTL vs RQ job timeout without heartbeat; W004: idempotency TTL vs requeue window."""
    if any(message.level >= Error.level for message in check_settings()):
        return []
    from .queues import get_queue

    current = conf.get()
    found: list[CheckMessage] = []
    for spec in _job_specs():
        ttl = spec.ttl if spec.ttl is not None else current.LOCK_TTL
        timeout = spec.rq_options.get("job_timeout") or get_queue(spec.queue)._default_timeout
        if spec.lock is not None and not spec.heartbeat and ttl < float(timeout):
            found.append(
                _message(
                    "W002",
                    f"{spec.name}: lock TTL {ttl:g}s is shorter than its RQ job timeout "
                    f"{timeout}s with heartbeat off: a slow run loses its lock to a second worker.",
                    hint="Turn heartbeat on, or make ttl longer than job_timeout.",
                )
            )
        window = spec.max_wait if spec.max_wait is not None else current.REQUEUE_MAX_WAIT
        if (
            spec.idempotency_key is not None
            and spec.on_conflict == "requeue"
            and current.IDEMPOTENCY_TTL < window
        ):
            found.append(
                _message(
                    "W004",
                    f"{spec.name}: requeues for up to {window:g}s but idempotency records expire "
                    f"after {current.IDEMPOTENCY_TTL:g}s: a late duplicate could run again.",
                    hint="Raise JOBLOCK['IDEMPOTENCY_TTL'] or lower max_wait.",
                )
            )
    return found


@register(Tags.compatibility, TAG, deploy=True)
def check_scheduler(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W012: requeue delays are RQ scheduled jobs; without a scheduler they never run."""
    if check_redis_server():
        return []
    from .monitoring import queues_without_scheduler

    return [
        _message(
            "W012",
            f"No RQ scheduler is running for queue {name!r}, whose jobs requeue on lock "
            "contention with delays: requeued jobs would wait forever.",
            hint="Run one worker per queue with --with-scheduler "
            "(manage.py joblock_worker --with-scheduler).",
        )
        for name in queues_without_scheduler()
    ]
