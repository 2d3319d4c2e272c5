"""Real services for the tests: the ports of the throwaway redis-server the tests may kill,
restart and reconfigure (:class:`~tests.procs.redis_server.RedisServer`), a TCP proxy
that can delay or black-hole traffic to it, and the environment of child processes.

Ports are chosen once by the pytest process and handed to every child process through the
environment, so subprocesses started by a test talk to the same server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.procs.redis_server import RedisServer, available, free_port

__all__ = [
    "Proxy",
    "RedisServer",
    "child_env",
    "free_port",
    "managed",
    "persistent",
    "redis_url",
    "wait_for",
]

ROOT = Path(__file__).resolve().parent.parent

# Under pytest-xdist each test process has its own throwaway servers: the variables carry the
# process's name ("gw0"), which the worker processes a test starts inherit with the rest of the
# environment. The dead port is shared: nothing listens on it.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
PORT_ENV = f"JOBLOCK_TEST_REDIS_PORT_{_XDIST_WORKER}".rstrip("_")
PROXY_PORT_ENV = f"JOBLOCK_TEST_PROXY_PORT_{_XDIST_WORKER}".rstrip("_")
DEAD_PORT_ENV = "JOBLOCK_TEST_DEAD_PORT"


def _port_from_env(name: str) -> int:
    if name not in os.environ:
        os.environ[name] = str(free_port())
    return int(os.environ[name])


def managed() -> bool:
    """True when the tests run their own redis-server (the binary is on PATH)."""
    return available() and not os.environ.get("JOBLOCK_TEST_EXTERNAL")


def redis_url() -> str:
    """The Redis URL the test settings use."""
    if managed():
        return f"redis://127.0.0.1:{_port_from_env(PORT_ENV)}/0"
    return os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def proxy_url() -> str:
    return f"redis://127.0.0.1:{_port_from_env(PROXY_PORT_ENV)}/0"


_RESERVED: list[socket.socket] = []


def dead_url() -> str:
    """A URL where nothing listens (a Redis that is down). The process that picks the port keeps
    it bound without listening: connections are refused, and no server a later test starts on a
    "free" port can take it (a cluster node once did: the "unreachable" cluster answered)."""
    if DEAD_PORT_ENV not in os.environ:
        reserved = socket.socket()  # no SO_REUSEADDR: redis-server's bind then fails
        reserved.bind(("127.0.0.1", 0))
        _RESERVED.append(reserved)
        os.environ[DEAD_PORT_ENV] = str(reserved.getsockname()[1])
    return f"redis://127.0.0.1:{os.environ[DEAD_PORT_ENV]}/0"


def child_env(
    joblock: dict[str, Any] | None = None, settings_module: str = "tests.settings"
) -> dict[str, str]:
    """The environment of a child process of a test: this process's environment (the ports
    above included), the test settings, the project on ``PYTHONPATH``, the test database the
    pytest process created, and the test's ``JOBLOCK`` (read by tests/settings.py)."""
    from django.db import connection

    env = dict(os.environ, DJANGO_SETTINGS_MODULE=settings_module)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["JOBLOCK_CHILD_DB_NAME"] = str(connection.settings_dict["NAME"])
    env["JOBLOCK_TEST_SETTINGS"] = json.dumps(joblock or {})
    return env


class Proxy:
    """A TCP proxy in front of Redis: ``forward``, ``delay`` (seconds per chunk) or ``blackhole``;
    and, whatever the mode, the chunks that contain ``hold_matching`` held until it is cleared.

    In ``blackhole`` mode bytes are held in both directions and no connection is closed: to
    the client it looks like a server that stopped answering, until the mode changes back and
    the held bytes are delivered (late, like TCP after a partition).
    """

    def __init__(self, listen_port: int, upstream_port: int) -> None:
        self.listen_port = listen_port
        self.upstream_port = upstream_port
        self.mode = "forward"
        self.delay = 0.0
        # While set, a chunk a client sends that contains these bytes (a script's sha, say) is
        # held, on that connection alone, until it is cleared; ``held`` counts such chunks.
        self.hold_matching: bytes | None = None
        self.held = 0
        self._sock = socket.create_server(("127.0.0.1", listen_port), reuse_port=False)
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = None
            for _ in range(100):  # the server may be restarting: keep trying for ~5 s
                try:
                    upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
                    break
                except OSError:
                    time.sleep(0.05)
            if upstream is None:
                client.close()
                continue
            self._conns += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                break
            if not data:
                break
            while self.mode == "blackhole" and not self._closed:
                # Hold the bytes, as a network partition does (TCP retransmits them once it
                # heals): the peer sees silence, then everything arrives late. Nothing is lost.
                time.sleep(0.01)
            if self.hold_matching is not None and self.hold_matching in data:
                self.held += 1
                while self.hold_matching is not None and not self._closed:
                    time.sleep(0.01)
            if self.mode == "delay" and self.delay:
                time.sleep(self.delay)
            try:
                dst.sendall(data)
            except OSError:
                break
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass

    def set(self, mode: str, delay: float = 0.0) -> None:
        self.mode, self.delay = mode, delay

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):  # wakes the accept() under way: no late connection
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass


def dead_holder(resource: str, client: Any) -> int:
    """A process that took ``resource``'s lock without heartbeat (TTL 60 s) and was listed in
    the active-lock index, then SIGKILLed: its lock lives on with a dead holder. Its pid."""
    code = (
        "import django, time; django.setup()\n"
        "from django_joblock import lock\n"
        f"held = lock({resource!r}, ttl=60, heartbeat=False); held.acquire()\n"
        "print('held', flush=True); time.sleep(600)\n"
    )
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="tests.settings")
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    family = resource.split(":", 1)[0]
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert wait_for(lambda: client.zcard(f"joblock:active:{family}"), 5), "never indexed"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    return proc.pid


def persistent(server: RedisServer, client: Any, on: bool) -> None:
    """Switch the test server's append-only file on (a restart keeps the queues, as RQ needs)
    or off again."""
    client.config_set("appendfsync", "always")
    client.config_set("appendonly", "yes" if on else "no")
    server.persistent = on
    if on:
        assert wait_for(lambda: client.info("persistence")["aof_rewrite_in_progress"] == 0, 20)
        assert wait_for(lambda: client.info("persistence")["aof_enabled"] == 1, 20)


def wait_for(predicate: Any, timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(interval)


def wait_expired(client: Any, key: str, ttl: float) -> None:
    """Poll until ``key`` has expired on the server; fail if it outlives its ``ttl`` (s) by 5 s.

    For tests whose holder must be past its TTL: a sleep of "a bit more than the TTL" ends
    before the expiry whenever the reply of the acquire is late, polling cannot.
    """
    gone = wait_for(lambda: client.exists(key) == 0, ttl + 5.0)
    assert gone, f"{key} still exists {ttl + 5.0:g}s after a {ttl:g}s TTL"


def expire_now(client: Any, key: str) -> None:
    """``PEXPIRE key 1`` until the key is really gone.

    A renewal landing within that millisecond would replace the TTL and keep the lock alive;
    the fault must really happen for the test to mean anything.
    """
    for _ in range(100):
        client.pexpire(key, 1)
        time.sleep(0.005)
        if not client.exists(key):
            return
    raise AssertionError(f"{key} would not expire")


def load_scripts(client: Any) -> None:
    """Load every lock script into the server's cache (so a test's fault hits the command
    it aims at, not a NOSCRIPT round trip)."""
    from django_joblock.locks import scripts

    for script in (scripts.ACQUIRE, scripts.WAIT, scripts.LEAVE, scripts.RENEW, scripts.RELEASE):
        client.script_load(script.source)


def write_run(
    client: Any,
    resource: str,
    job_id: str,
    func: str,
    started: float,
    took: float,
    waited: float | None,
    outcome: str,
    key: str = "",
) -> None:
    """Append a run to its family's history as a worker does when a run ends."""
    from django_joblock.backend import send
    from django_joblock.jobs import history

    run = history.Delivery(job_id, func, key, resource, "w", "h", 1, started, took, outcome, waited)
    send(client, history.add_calls(run))
