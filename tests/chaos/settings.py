"""Settings of the chaos workers (and of the runner): PostgreSQL and Redis from the environment."""

from __future__ import annotations

import os

import dj_database_url

SECRET_KEY = "chaos-only"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_rq",
    "django_joblock",
    "tests.chaos",
]
DATABASES = {"default": dj_database_url.parse(os.environ["CHAOS_DB_URL"])}
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": os.environ["CHAOS_REDIS_URL"],
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
    }
}
# The queue on the cache's connection (django-tasks-rq, for the Tasks phase, needs django-rq).
RQ_QUEUES = {"chaos": {"USE_REDIS_CACHE": "default"}}
# The Tasks phase (tests/chaos/jobs.py): Django tasks on RQ through django-joblock's backend.
TASKS = {"default": {"BACKEND": "django_joblock.jobs.rq_tasks.RQBackend", "QUEUES": ["chaos"]}}
SAFE = os.environ.get("CHAOS_MODE", "safe") == "safe"
JOBLOCK = {
    "REQUEUE_BACKOFF": {"base": 1, "factor": 2, "max": 4},
    "REQUEUE_MAX_WAIT": 900,
    "IDEMPOTENCY_TTL": 3600,
    # The negative control lets a paused holder resume and write (no abort, no fence).
    "ON_LOCK_LOST": "abort" if SAFE else "flag",
}
# The failover run (tests/chaos/failover.py): locks on Redis Sentinel, queues on the Redis
# above through django-rq (or, with --queues-on-sentinel, on the same Sentinel group).
if os.environ.get("CHAOS_SENTINELS"):
    from tests.procs.topologies import sentinel_cache

    SENTINELS = [
        (host, int(port))
        for host, port in (item.rsplit(":", 1) for item in os.environ["CHAOS_SENTINELS"].split(","))
    ]
    RQ_QUEUES = {"chaos": {"URL": os.environ["CHAOS_REDIS_URL"]}}
    CACHES["locks"] = sentinel_cache(SENTINELS, os.environ["CHAOS_MASTER"])
    # --queues-on-sentinel: the queues on the same Sentinel group as the locks, with the
    # settings of docs/topologies.md ("Redis Sentinel") copied as they are documented.
    if os.environ.get("CHAOS_QUEUES_ON_SENTINEL"):
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError
        from redis.retry import Retry

        RQ_QUEUES = {
            "chaos": {
                "SENTINELS": SENTINELS,
                "MASTER_NAME": os.environ["CHAOS_MASTER"],
                "DB": 0,
                "SOCKET_TIMEOUT": 5,
                "CONNECTION_KWARGS": {
                    "socket_connect_timeout": 1,
                    "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 20),
                    "retry_on_error": [RedisConnectionError, RedisTimeoutError],
                },
            }
        }
    JOBLOCK["REDIS_ALIAS"] = "locks"
    JOBLOCK["REPLICA_ACKS"] = int(os.environ.get("CHAOS_REPLICA_ACKS", "0"))
    JOBLOCK["REPLICA_ACK_TIMEOUT"] = 0.2
# The same run with the locks on Redis Cluster (tests/cluster_client.py reads the nodes from
# JOBLOCK_TEST_CLUSTER_NODES).
if os.environ.get("JOBLOCK_TEST_CLUSTER_NODES"):
    RQ_QUEUES = {"chaos": {"URL": os.environ["CHAOS_REDIS_URL"]}}
    JOBLOCK["REDIS_CLIENT"] = "tests.cluster_client.make"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {"version": 1, "disable_existing_loggers": False}
