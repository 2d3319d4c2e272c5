"""System checks. Ids are ``django_joblock.E0xx`` (errors) and ``W0xx`` (warnings); each is tested.

E001  ``JOBLOCK`` is not a dict
E002  unknown key in ``JOBLOCK`` (or in its ``REQUEUE_BACKOFF`` / ``ALERTS`` dicts)
E003  a ``JOBLOCK`` value has the wrong type or range
E004  ``HEARTBEAT_INTERVAL`` >= ``LOCK_TTL``
E005  ``REDIS_ALIAS`` is not a django-redis cache in ``CACHES``
E006  a ``@locked_job`` queue name is not in ``RQ_QUEUES`` while django-rq is installed
E007  ``REDIS_CLIENT`` cannot be imported, is not callable, or does not make a client
E008  ``REPLICA_ACKS`` is set while ``REDIS_CLIENT`` makes a Redis Cluster client
W001  ``HEARTBEAT_INTERVAL`` > ``LOCK_TTL / 2``
W002  a ``@locked_job`` with heartbeat off has a lock TTL shorter than its RQ job timeout
W003  ``IDEMPOTENCY_TTL`` shorter than ``REQUEUE_MAX_WAIT``
W004  a requeueing ``@locked_job`` waits longer (``max_wait``) than ``IDEMPOTENCY_TTL``
W005  ``IDEMPOTENCY_TTL`` shorter than ``IDEMPOTENCY_LEASE``
W006  an idempotent ``@locked_job`` without a lock has a job timeout over ``IDEMPOTENCY_LEASE``
W010  (deploy) Redis does not answer (the locks' Redis, or a requeueing job's queue Redis)
W011  (deploy) Redis ``maxmemory-policy`` can evict locks
W012  (deploy) no RQ scheduler runs for a queue whose jobs requeue with delays
W013  ``ALERTS`` ``BASELINE`` not longer than ``WINDOW`` (``contention_spike`` never fires)
W014  ``METRICS_RETENTION`` shorter than the alerts read back (``WINDOW`` + ``BASELINE``)
W015  the records' database is SQLite without ``transaction_mode: IMMEDIATE``
W016  (deploy) ``KEY_PREFIX`` on the locks' Redis belongs to another project
W017  ``REPLICA_ACK_TIMEOUT`` not shorter than ``REDIS_TIMEOUT`` while ``REPLICA_ACKS`` is set

Checks W002 and W006 use the job's decoration-time ``job_timeout`` (or its queue's default); a
per-call ``.enqueue(job_timeout=)`` is checked at enqueue time and logged with the same id."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import ERROR, CheckMessage, Error, Tags, Warning, register
from django.db import router

from . import backend, conf
from .backend import REDIS_ERRORS, close, connection, dedicated, server_infos
from .exceptions import JoblockConfigError, LockBackendUnavailable
from .jobs.decorator import registered_jobs
from .jobs.queues import get_queue
from .jobs.spec import OnConflict, job_timeout, timeout_findings
from .monitor import cleanup
from .monitor.active import has_scheduler, requeueing_queues

DJANGO_REDIS_BACKEND = "django_redis.cache.RedisCache"
TAG = "django_joblock"


def _message(problem_id: str, message: str, hint: str | None = None) -> CheckMessage:
    cls = Error if problem_id.startswith("E") else Warning
    return cls(message, hint=hint, id=f"django_joblock.{problem_id}")


def _settings_broken() -> bool:
    return any(message.level >= ERROR for message in check_settings())


@register(Tags.compatibility, TAG)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001-E004, W001, W003, W005, W013, W014, W017: the shape and consistency of ``JOBLOCK``."""
    return [_message(p.id, p.message) for p in conf.problems(getattr(settings, "JOBLOCK", None))]


@register(Tags.caches, TAG)
def check_redis_alias(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E005: the alias must name a django-redis cache (we need its raw Redis connection)."""
    raw = getattr(settings, "JOBLOCK", None) or {}
    alias = raw.get("REDIS_ALIAS", conf.DEFAULTS["REDIS_ALIAS"]) if isinstance(raw, dict) else None
    if not isinstance(alias, str):
        return []  # reported by E001 / E003
    caches = getattr(settings, "CACHES", {}) or {}
    engine = caches.get(alias, {}).get("BACKEND")
    if engine == DJANGO_REDIS_BACKEND:
        return []
    found = "missing" if alias not in caches else f"BACKEND {engine!r}"
    message = f"JOBLOCK['REDIS_ALIAS'] = {alias!r} is not a django-redis cache ({found})."
    hint = f"Make CACHES[{alias!r}] a {DJANGO_REDIS_BACKEND!r} cache, or change REDIS_ALIAS."
    return [_message("E005", message, hint)]


@register(Tags.caches, TAG)
def check_redis_client(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E007: ``REDIS_CLIENT`` names a factory that makes a redis-py client (it is called); E008:
    ``REPLICA_ACKS`` with a Cluster client. A factory that cannot reach Redis is W010's."""
    path = None if _settings_broken() else conf.get().REDIS_CLIENT
    if path is None:
        return []
    try:
        client = backend.connection(conf.get().REDIS_ALIAS)  # made once per process
    except LockBackendUnavailable:
        return []
    except JoblockConfigError as exc:
        hint = "Name a function returning a redis-py client; see docs/topologies.md."
        return [_message("E007", str(exc), hint)]
    if not (backend.is_cluster(client) and conf.get().REPLICA_ACKS):
        return []
    message = "JOBLOCK['REPLICA_ACKS'] is set, but REDIS_CLIENT makes a Redis Cluster client."
    return [_message("E008", message, "Set REPLICA_ACKS to 0; see docs/topologies.md.")]


@register(Tags.caches, TAG, deploy=True)
def check_redis_server(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W010: Redis answers; W011: its eviction policy cannot silently drop locks; W016: its
    ``KEY_PREFIX`` is not another project's (claimed by ``migrate``). Reads only."""
    if _settings_broken() or check_redis_alias() or check_redis_client():
        return []
    alias = conf.get().REDIS_ALIAS
    try:
        client = dedicated(connection(alias), 2.0)
        try:
            memories = server_infos(client, "memory")
            other = cleanup.other_project(client, claim=False)
        finally:
            close(client)
    except Exception as exc:  # noqa: BLE001 - any failure to answer is the finding
        message = f"Redis of cache {alias!r} does not answer: {exc}"
        return [_message("W010", message, "Check that Redis runs at the configured address.")]
    found = []
    if other:
        prefix = conf.get().KEY_PREFIX
        message = (
            f"KEY_PREFIX {prefix!r} on the Redis of cache {alias!r} belongs to another "
            f"project ({other}; its SECRET_KEY differs): each sees the other's locks, and a "
            "purge removes the other's keys."
        )
        hint = (
            "Give each project its own JOBLOCK['KEY_PREFIX'] (or Redis database); after "
            f"rotating SECRET_KEY, delete the key {prefix}:project."
        )
        found.append(_message("W016", message, hint))
    for server, memory in memories.items():
        policy = str(memory.get("maxmemory_policy", "noeviction"))
        maxmemory = int(memory.get("maxmemory", 0) or 0)
        if maxmemory and policy != "noeviction":
            which = f" ({server})" if len(memories) > 1 else ""
            message = (
                f"Redis of cache {alias!r}{which} has maxmemory-policy={policy!r}: "
                "it may evict a held lock."
            )
            found.append(_message("W011", message, "Use maxmemory-policy noeviction."))
    return found


@register(Tags.compatibility, TAG)
def check_jobs(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E006: queue names; W002 / W006: timeouts; W004: idempotency TTL vs requeue window."""
    if _settings_broken() or check_redis_alias():
        return []
    keep = conf.get().IDEMPOTENCY_TTL
    found: list[CheckMessage] = []
    for spec in registered_jobs():
        try:
            queue = get_queue(spec.queue)
        except (JoblockConfigError, ValueError) as exc:
            found.append(_message("E006", f"{spec.name}: {exc}", "Add the queue to RQ_QUEUES."))
            continue
        timeout = job_timeout(spec.rq_options.get("job_timeout"), queue)
        found += [_message(f.id, f.message, hint=f.hint) for f in timeout_findings(spec, timeout)]
        window = spec.max_wait if spec.max_wait is not None else conf.get().REQUEUE_MAX_WAIT
        requeues = spec.idempotency_key is not None and spec.on_conflict is OnConflict.REQUEUE
        if requeues and keep < window:
            message = f"{spec.name}: requeues for up to {window:g}s > IDEMPOTENCY_TTL {keep:g}s."
            hint = "Raise JOBLOCK['IDEMPOTENCY_TTL'] or lower max_wait."
            found.append(_message("W004", message, hint))
    return found


@register(Tags.compatibility, TAG)
def check_sqlite(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W015: on SQLite, Django's default (deferred) transactions make concurrent jobs fail with
    "database is locked" (a read upgraded to a write cannot wait for the write lock)."""
    from .models import IdempotencyRecord

    alias = router.db_for_write(IdempotencyRecord)
    database = settings.DATABASES.get(alias) or {}
    immediate = str((database.get("OPTIONS") or {}).get("transaction_mode", "")).upper()
    if not str(database.get("ENGINE", "")).endswith("sqlite3") or immediate == "IMMEDIATE":
        return []
    message = (
        f"DATABASES[{alias!r}] is SQLite with deferred transactions: jobs running at once "
        "fail with 'database is locked' (10 of 12 in a test, on 12 different resources)."
    )
    hint = "Set OPTIONS = {'transaction_mode': 'IMMEDIATE', 'timeout': 20} (Django >= 5.1)."
    return [_message("W015", message, hint)]


@register(Tags.compatibility, TAG, deploy=True)
def check_scheduler(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W012: requeue delays are RQ scheduled jobs; without a scheduler they never run. Each
    queue is asked on its own short-timeout connection; one that does not answer is W010."""
    if _settings_broken() or check_redis_alias() or any(m.level >= ERROR for m in check_jobs()):
        return []
    if any(message.id == "django_joblock.W010" for message in check_redis_server()):
        return []
    found: list[CheckMessage] = []
    for name, queue in requeueing_queues().items():
        try:
            client = dedicated(queue.connection, 2.0)
            try:
                served = has_scheduler(queue, client)
            finally:
                close(client)
        except REDIS_ERRORS as exc:
            message = f"Redis of RQ queue {name!r} does not answer: {exc}"
            found.append(_message("W010", message, "Check that Redis runs at the queue's address."))
            continue
        if not served:
            message = f"No RQ scheduler runs for queue {name!r}: its requeued jobs never run."
            found.append(_message("W012", message, "Run a worker with --with-scheduler."))
    return found
