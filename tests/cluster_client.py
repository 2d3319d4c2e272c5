"""The ``JOBLOCK["REDIS_CLIENT"]`` factory of the Redis Cluster tests (tests/test_cluster.py).

The cluster's nodes come from :data:`NODES` (set by the test fixture in this process) or from
the ``JOBLOCK_TEST_CLUSTER_NODES`` environment variable (``host:port,host:port,...``: what
worker processes started by a test get).
"""

from __future__ import annotations

import os

import redis
from redis.cluster import ClusterNode

ENV = "JOBLOCK_TEST_CLUSTER_NODES"
NODES: list[tuple[str, int]] = []


def nodes() -> list[tuple[str, int]]:
    if NODES:
        return list(NODES)
    raw = os.environ.get(ENV, "")
    if not raw:
        raise RuntimeError(f"no cluster: set tests.cluster_client.NODES or {ENV}")
    return [(host, int(port)) for host, port in (item.rsplit(":", 1) for item in raw.split(","))]


def make() -> redis.RedisCluster:
    """A ``RedisCluster`` on the test cluster, as a deployment's factory would make one."""
    startup = [ClusterNode(host, port) for host, port in nodes()]  # type: ignore[no-untyped-call]
    return redis.RedisCluster(startup_nodes=startup, socket_timeout=5, socket_connect_timeout=2)


def make_unreachable() -> redis.RedisCluster:
    """A ``RedisCluster`` on a port nothing listens on (making it raises a connection error)."""
    from tests import harness

    port = int(harness.dead_url().rsplit(":", 1)[1].split("/")[0])
    startup = [ClusterNode("127.0.0.1", port)]  # type: ignore[no-untyped-call]
    return redis.RedisCluster(startup_nodes=startup, socket_connect_timeout=1)
