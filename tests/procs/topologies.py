"""Throwaway Redis Sentinel and Redis Cluster setups on loopback, for tests and benchmarks.

:class:`SentinelGroup` runs one primary, its replicas and a few sentinels monitoring it;
:class:`ClusterNodes` runs a Redis Cluster of primaries without replicas. Both are made of
:class:`~tests.procs.redis_server.RedisServer` processes (the ``redis-server`` on
``PATH``; a sentinel is ``redis-server --sentinel``), nothing saved to disk but the files a
sentinel or a cluster node keeps of its topology.

Guarantees and failure modes:

- ``start()`` returns once the setup serves: the sentinels agree on the primary and see its
  replicas, or every cluster node reports ``cluster_state:ok``; otherwise it raises
  :class:`~tests.procs.redis_server.RedisServerError` within ``timeout`` seconds
  and stops what it started.
- :meth:`SentinelGroup.fail_over` kills the primary (SIGKILL) and waits until the sentinels
  name a promoted replica that answers as a primary. Whatever the replica had not received is
  gone, as in a real failover: that is what the tests of forgotten locks rely on.
- ``replicate_via`` lets a test put something (a TCP proxy it can pause) between the primary
  and its replicas: it is called with the primary's port and returns the port the replicas
  replicate from. The sentinels then never re-point a replica at the primary directly (they
  do so, after Sentinel's ``failover-timeout``, to a replica whose master address is not the
  primary's own), so a paused proxy really holds replication back.
- :meth:`ClusterNodes.restart` kills one node and starts it again on the same port and
  directory: it keeps its slots (``nodes.conf``) and loses its keys (its script cache too).
- A cluster node's bus port is a free port of its own (``cluster-port``, Redis >= 7.0), not
  its data port + 10000 (which Redis refuses above 55535, and which may be taken).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import redis

from .redis_server import RedisServer, RedisServerError, free_port

#: The name the sentinels of a :class:`SentinelGroup` monitor the primary under.
MASTER_NAME = "joblock"


def sentinel_cache(sentinels: list[tuple[str, int]], master: str) -> dict[str, Any]:
    """A django-redis ``CACHES`` entry on the primary the ``sentinels`` name ``master``
    (django-redis' ``SentinelClient``; docs/topologies.md)."""
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://{master}/0",
        "OPTIONS": {
            "CLIENT_CLASS": "django_redis.client.SentinelClient",
            "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
            "SENTINELS": sentinels,
            "SOCKET_CONNECT_TIMEOUT": 1,
            "SOCKET_TIMEOUT": 2,
        },
    }


def sentinel_queue(
    sentinels: list[tuple[str, int]], master: str, *, failover_budget: float = 20.0
) -> dict[str, Any]:
    """A django-rq ``RQ_QUEUES`` entry on the same primary (django-rq's ``SENTINELS``).

    Its connections retry a failed command for up to about ``failover_budget`` seconds, asking
    the sentinels for the primary again each time: an RQ worker whose Redis call fails while
    a failover is under way would otherwise stop ("found an unhandled exception, quitting").
    """
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry

    cap = 1.0
    return {
        "SENTINELS": sentinels,
        "MASTER_NAME": master,
        "DB": 0,
        "SOCKET_TIMEOUT": 5,
        "CONNECTION_KWARGS": {
            "socket_connect_timeout": 1,
            "retry": Retry(ExponentialBackoff(cap=cap, base=0.05), int(failover_budget / cap)),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        },
    }


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise RedisServerError(f"{what} within {timeout:g}s")


# Sentinel's failover-timeout (ms) when the replicas replicate through a proxy (see below).
FIXED_REPLICA_AFTER_MS = 600_000


class SentinelGroup:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels (quorum: a majority).

    ``down_after``: seconds of silence before a sentinel calls the primary down (Sentinel's
    ``down-after-milliseconds``; a failover takes about this plus an election).
    """

    def __init__(
        self,
        *,
        replicas: int = 1,
        sentinels: int = 3,
        down_after: float = 1.0,
        master_name: str = MASTER_NAME,
        replicate_via: Callable[[int], int] | None = None,
    ) -> None:
        if replicas < 1 or sentinels < 1:
            raise ValueError("a SentinelGroup needs at least one replica and one sentinel")
        self.master_name = master_name
        self.down_after = down_after
        # A replica's first sync starts at once (Redis 7 waits 5 s for more replicas to join).
        self.eager = ["--repl-diskless-sync-delay", "0"]
        self.primary = RedisServer(extra_args=self.eager)
        self.replicas = [RedisServer() for _ in range(replicas)]
        self.replicate_via = replicate_via
        quorum = sentinels // 2 + 1
        ms = max(100, int(down_after * 1000))
        # Sentinel "fixes" a replica whose master address is not the primary's own once
        # failover-timeout has passed since its configuration changed (+fix-slave-config):
        # it would re-point a replica that replicates through the caller's proxy straight at
        # the primary, and a paused proxy would then hold nothing back. With a proxy, the
        # timeout outlasts any test run; a failover never waits for it.
        failover_ms = FIXED_REPLICA_AFTER_MS if replicate_via else max(2000, ms * 4)
        self.sentinels = [
            RedisServer(
                extra_args=["--sentinel"],
                config=(
                    f"sentinel monitor {master_name} 127.0.0.1 {self.primary.port} {quorum}\n"
                    f"sentinel down-after-milliseconds {master_name} {ms}\n"
                    f"sentinel failover-timeout {master_name} {failover_ms}\n"
                    f"sentinel parallel-syncs {master_name} 1\n"
                ),
            )
            for _ in range(sentinels)
        ]

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The sentinels' ``(host, port)`` pairs, as django-redis' and django-rq's
        ``SENTINELS`` settings take them."""
        return [("127.0.0.1", s.port) for s in self.sentinels]

    def start(self, timeout: float = 60.0) -> None:
        """Start every process; return once the sentinels see the primary and its replicas
        (they learn of replicas from the primary's INFO every 10 s: on a busy machine, once
        30 s were not enough)."""
        try:
            self.primary.start()
            upstream = self.replicate_via(self.primary.port) if self.replicate_via else None
            for replica in self.replicas:
                replica.extra_args = [
                    *self.eager,
                    "--replicaof",
                    "127.0.0.1",
                    str(upstream or self.primary.port),
                    "--repl-ping-replica-period",
                    "1",
                ]
                replica.start()
            _wait(self._replicas_in_sync, timeout, "the replicas did not sync")
            for sentinel in self.sentinels:
                sentinel.start()
            self.last_seen: list[tuple[Any, Any, Any]] = []
            try:
                _wait(self._sentinels_ready, timeout, "the sentinels did not see the setup")
            except RedisServerError as exc:
                seen = f"(replicas, other sentinels, flags) seen: {self.last_seen}"
                raise RedisServerError(f"{exc}; {seen}") from exc
        except BaseException:
            self.stop()
            raise

    def primary_port(self) -> int:
        """The port the sentinels name as the primary now."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            with sentinel.client(socket_timeout=1) as client:
                host_port = client.sentinel_get_master_addr_by_name(self.master_name)
            if host_port:
                return int(host_port[1])
        raise RedisServerError("no sentinel names a primary")

    def server(self, port: int) -> RedisServer:
        """The data server (primary or replica) listening on ``port``."""
        for server in (self.primary, *self.replicas):
            if server.port == port:
                return server
        raise KeyError(port)

    def wait_replicated(self, timeout: float = 5.0) -> None:
        """Block until every replica has every write the primary acknowledged (``WAIT``)."""
        with self.server(self.primary_port()).client() as client:
            acked = client.execute_command("WAIT", len(self.replicas), int(timeout * 1000))
        if int(acked) < len(self.replicas):
            raise RedisServerError(f"only {acked} of {len(self.replicas)} replicas caught up")

    def fail_over(self, timeout: float = 60.0, *, graceful: bool = False) -> int:
        """SIGKILL the current primary (with ``graceful``: ask a sentinel for a ``SENTINEL
        FAILOVER``) and wait for the sentinels' promotion (up to ``timeout`` s: a minute, for
        a machine running three suites at once); returns the new primary's port. A
        killed server stays down; a gracefully demoted one takes writes until the sentinels
        reconfigure it as a replica (about 10 s later)."""
        old = self.primary_port()
        if graceful:
            self.sentinels[0].client().execute_command("SENTINEL", "FAILOVER", self.master_name)
        else:
            self.server(old).kill()

        def promoted() -> bool:
            port = self.primary_port()
            if port == old:
                return False
            with self.server(port).client(socket_timeout=1) as client:
                if client.info("replication")["role"] != "master":
                    return False
            # What a client does: it must find the new primary whichever sentinel it asks
            # (one that still flags the old primary down answers "no master").
            return all(self._discovers(sentinel, port) for sentinel in self.sentinels)

        _wait(promoted, timeout, f"no replica was promoted after primary {old} died")
        return self.primary_port()

    def _discovers(self, sentinel: RedisServer, port: int) -> bool:
        """True when redis-py's Sentinel client, asking only ``sentinel``, finds the primary
        on ``port``."""
        from redis.sentinel import Sentinel

        asker = Sentinel([("127.0.0.1", sentinel.port)], socket_timeout=1)  # type: ignore[no-untyped-call]
        try:
            found = asker.discover_master(self.master_name)  # type: ignore[no-untyped-call]
            return bool(found[1] == port)
        except redis.RedisError:
            return False
        finally:
            for client in asker.sentinels:
                client.close()

    def stop(self) -> None:
        """Stop every process and remove their directories."""
        for server in (*self.sentinels, *self.replicas, self.primary):
            server.stop()

    def _replicas_in_sync(self) -> bool:
        for replica in self.replicas:
            with replica.client(socket_timeout=1) as client:
                if client.info("replication").get("master_link_status") != "up":
                    return False
        return True

    def _sentinels_ready(self) -> bool:
        seen = []
        for sentinel in self.sentinels:
            with sentinel.client(socket_timeout=1) as client:
                master = client.sentinel_master(self.master_name)
            seen.append((master["num-slaves"], master["num-other-sentinels"], master["flags"]))
        # What each sentinel saw last (replicas, other sentinels, flags): for the timeout's message.
        self.last_seen = seen
        return all(
            int(replicas) >= len(self.replicas) and int(others) >= len(self.sentinels) - 1
            for replicas, others, _ in seen
        )


class ClusterNodes:
    """A Redis Cluster of ``primaries`` primaries (no replicas), slots split evenly.

    ``node_timeout``: seconds before the cluster calls an unreachable node failing
    (``cluster-node-timeout``).
    """

    def __init__(self, primaries: int = 3, *, node_timeout: float = 2.0) -> None:
        if primaries < 3:
            raise ValueError("Redis Cluster needs at least 3 primaries")
        args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        args += ["--cluster-node-timeout", str(int(node_timeout * 1000))]
        # The cluster bus port is given (``cluster-port``, Redis >= 7): by default it is the
        # data port + 10000, which refuses data ports above 55535 and may be taken.
        self.nodes = [
            RedisServer(extra_args=[*args, "--cluster-port", str(free_port())])
            for _ in range(primaries)
        ]

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every node."""
        return [("127.0.0.1", node.port) for node in self.nodes]

    def client(self, **kwargs: Any) -> redis.RedisCluster:
        """A new ``RedisCluster`` client on these nodes (5 s socket timeout unless given)."""
        from redis.cluster import ClusterNode

        kwargs.setdefault("socket_timeout", 5)
        nodes = [ClusterNode(host, port) for host, port in self.startup_nodes]  # type: ignore[no-untyped-call]
        return redis.RedisCluster(startup_nodes=nodes, **kwargs)

    def start(self, timeout: float = 30.0) -> None:
        """Start the nodes, join them and split the slots; return once the cluster is ok."""
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisServerError("redis-cli is not on PATH (it creates the cluster)")
        try:
            for node in self.nodes:
                node.start()
            done = subprocess.run(
                [
                    cli,
                    "--cluster",
                    "create",
                    *(f"{h}:{p}" for h, p in self.startup_nodes),
                    *("--cluster-replicas", "0", "--cluster-yes"),
                ],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if done.returncode:
                raise RedisServerError(f"redis-cli --cluster create failed:\n{done.stdout}")
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Block until every running node reports ``cluster_state:ok``."""

        def ok() -> bool:
            for node in self.nodes:
                with node.client(socket_timeout=1) as client:
                    if client.execute_command("CLUSTER", "INFO").find(b"cluster_state:ok") < 0:
                        return False
            return True

        _wait(ok, timeout, "the cluster did not reach cluster_state:ok")

    def node_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot."""
        with self.nodes[0].client() as client:
            slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
            for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(node for node in self.nodes if node.port == port)
        raise KeyError(key)

    def restart(self, node: RedisServer, timeout: float = 30.0) -> None:
        """SIGKILL ``node`` and start it again (same slots, no keys); wait for the cluster."""
        node.restart()
        self.wait_ok(timeout)

    def stop(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            node.stop()
