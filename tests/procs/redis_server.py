"""A throwaway ``redis-server`` for test suites, demos and benchmarks.

:class:`RedisServer` runs the ``redis-server`` binary found on ``PATH`` as a child of the calling
process, bound to 127.0.0.1 on a given or free port, with its data directory and log file in a
temporary directory of its own. Its owner may :meth:`~RedisServer.kill` it (SIGKILL: a crash),
:meth:`~RedisServer.restart` it on the same port and directory, and :meth:`~RedisServer.stop`
it for good (the directory is removed).

Guarantees and failure modes:

- Nothing is saved by default (no RDB snapshots, no append-only file): a kill or restart loses
  every key, as a crashed Redis without persistence does. With ``persistent=True`` the server
  keeps an append-only file fsync'ed on every write (``appendfsync always``), so a restart
  keeps every acknowledged write, RQ's queues included.
- :meth:`~RedisServer.start` returns once the server answers ``PING``; if it has not within
  ``startup_timeout`` seconds, or the process exits first (port taken, bad binary), it raises
  :class:`RedisServerError` with the end of the server's log, and no process is left running.
- On Linux the server is SIGTERMed when the thread that started it dies (``PR_SET_PDEATHSIG``),
  so a test run killed half-way leaves no orphan holding the port. Elsewhere, :meth:`stop` is
  the only clean-up.
- :func:`free_port` asks the kernel for a port that is free *now* and that no other test
  process got from it lately; a process of another kind may still take it before the server
  binds it, which :meth:`~RedisServer.start` reports as above, as it reports a server of
  another process answering on the port.

Not for production: no password, no TLS, one process per server.
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

#: Seconds :meth:`RedisServer.start` waits for the first ``PING`` to be answered.
STARTUP_TIMEOUT = 10.0
_PR_SET_PDEATHSIG = 1


class RedisServerError(RuntimeError):
    """The throwaway redis-server could not be started (the message says why)."""


# Ports given out by free_port() in the last PORT_RESERVATION seconds, one file each, shared by
# every test process of the machine (CI runs three suites side by side).
PORTS_GIVEN = Path(tempfile.gettempdir()) / "joblock-test-ports"
PORT_RESERVATION = 600.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the time of the call, and that no
    process on this machine got from this function in the last :data:`PORT_RESERVATION`
    seconds: two suites side by side once got one port at once, the second server failed to
    bind it and the first answered its owner's clients (CI: "the sentinels did not see the
    setup within 60s")."""
    PORTS_GIVEN.mkdir(exist_ok=True)
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if _reserve(PORTS_GIVEN / str(port)):
            return port
    raise RedisServerError(f"no free port found that {PORTS_GIVEN} does not list")


def _reserve(marker: Path) -> bool:
    """Create ``marker`` (the port is ours) unless another process made it recently."""
    try:
        marker.touch(exist_ok=False)
        return True
    except FileExistsError:
        try:
            stale = time.time() - marker.stat().st_mtime > PORT_RESERVATION
        except FileNotFoundError:
            stale = True
        if stale:
            marker.unlink(missing_ok=True)  # the next try may take it
        return False


def available() -> bool:
    """True when a ``redis-server`` binary is on ``PATH``."""
    return shutil.which("redis-server") is not None


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: ask the kernel to SIGTERM it when its parent
    # (thread) dies, so no orphan keeps the port.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class RedisServer:
    """A ``redis-server`` on 127.0.0.1, owned by this process (see the module docs).

    ``port``: the port to listen on (default: a free one, chosen once, so a restart keeps it).
    ``persistent``: keep an fsync'ed append-only file, read again on restart; it is read at each
    :meth:`start`, so it may be switched between a kill and the next start.
    ``startup_timeout``: seconds :meth:`start` waits for ``PING`` to be answered.
    ``extra_args``: more ``redis-server`` arguments (``--replicaof``, ``--cluster-enabled``...).
    ``config``: the text of a configuration file written to the server's directory and given
    first (a sentinel needs one it can rewrite; see :mod:`tests.procs.topologies`).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        persistent: bool = False,
        startup_timeout: float = STARTUP_TIMEOUT,
        extra_args: Sequence[str] = (),
        config: str | None = None,
    ) -> None:
        self.port = free_port() if port is None else port
        self.extra_args = list(extra_args)
        self.config = config
        self.persistent = persistent
        self.startup_timeout = startup_timeout
        self.dir = Path(tempfile.mkdtemp(prefix="joblock-redis-"))
        self.log_path = self.dir / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and the next kill, restart or stop."""
        return self.proc is not None and self.proc.poll() is None

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:PORT/DB``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new redis-py client for database 0 (5 s socket timeout unless given)."""
        kwargs.setdefault("socket_timeout", 5)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def _answered_by_ours(self, client: Any) -> bool:
        """Whether the server answering on the port is the process this object started."""
        assert self.proc is not None
        return int(client.info("server")["process_id"]) == self.proc.pid

    def start(self) -> None:
        """Start the server and wait until it answers (see the module docs for failures)."""
        if self.running:
            raise RedisServerError(f"redis-server on port {self.port} is already running")
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisServerError("redis-server is not on PATH")
        aof = ["yes", "--appendfsync", "always"] if self.persistent else ["no"]
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [binary]
        if self.config is not None:
            conf = self.dir / "redis.conf"
            if not conf.exists():  # a sentinel rewrites its file: a restart keeps what it learnt
                conf.write_text(self.config)
            args.append(str(conf))
        args += ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", *aof, "--dir", str(self.dir), "--daemonize", "no"]
        args += ["--logfile", str(self.log_path), *self.extra_args]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        client = self.client(socket_connect_timeout=1)
        deadline = time.monotonic() + self.startup_timeout
        foreign = False
        try:
            while True:
                try:
                    client.ping()
                    if self._answered_by_ours(client):
                        return
                    foreign = True  # another process's server holds the port: ours cannot bind
                    break
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
        finally:
            client.close()
        exited = self.proc.poll()
        self.kill()
        state = f"exited with status {exited}" if exited is not None else "did not answer"
        if foreign:
            state = "found another process's server answering on its port"
        raise RedisServerError(
            f"redis-server on port {self.port} {state} within {self.startup_timeout:g}s; "
            f"end of its log:\n{self._log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL the server and wait for it: a crash (without persistence every key is
        lost). Does nothing if it is not running."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """:meth:`kill`, then :meth:`start` on the same port and directory."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill the server and remove its directory (the append-only file and log with it)."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def answering(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis at ``url`` answers ``PING`` within ``timeout`` seconds."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()
