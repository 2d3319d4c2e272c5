"""Running the Lua scripts of :mod:`django_joblock.scripts`, and the one place their return
codes are given meaning.

Scripts are called by SHA (``EVALSHA``) on the lean command path; :func:`run` and
:func:`load_all` reload them after a ``NOSCRIPT`` (a Redis restart or ``SCRIPT FLUSH``; on
Redis Cluster, on the node that forgot them: see :func:`rerun`).
"""

from __future__ import annotations

import enum
import hashlib
from typing import Any

from redis.exceptions import NoScriptError

from .backend import REDIS_ERRORS, is_cluster
from .lean import execute, execute_many
from .scripts import (
    ACQUIRE,
    FENCE_COUNTER_TTL_MS,
    LEAVE,
    MAX_TTL_MS,
    METRICS,
    READ,
    RELEASE,
    RENEW,
    WAIT,
)

__all__ = [
    "ACQUIRE_SHA",
    "FENCE_COUNTER_TTL_MS",
    "LEAVE_SHA",
    "MAX_TTL_MS",
    "METRICS_SHA",
    "READ_SHA",
    "RELEASE_SHA",
    "RENEW_SHA",
    "WAIT_SHA",
    "Outcome",
    "busy_pttl_ms",
    "load_all",
    "read_each",
    "release",
    "replicated",
    "rerun",
    "run",
    "run_args",
    "sha",
]


class Outcome(enum.IntEnum):
    """Return codes of RENEW and RELEASE."""

    OK = 1
    GONE = 0
    OTHER_OWNER = -1

    @property
    def reason(self) -> str:
        return {1: "ok", 0: "expired", -1: "taken by another owner"}[self.value]


def sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()


ACQUIRE_SHA = sha(ACQUIRE)
WAIT_SHA = sha(WAIT)
LEAVE_SHA = sha(LEAVE)
RENEW_SHA = sha(RENEW)
RELEASE_SHA = sha(RELEASE)
METRICS_SHA = sha(METRICS)
READ_SHA = sha(READ)
_SOURCES = {
    script_sha: source
    for script_sha, source in (
        (ACQUIRE_SHA, ACQUIRE),
        (WAIT_SHA, WAIT),
        (LEAVE_SHA, LEAVE),
        (RENEW_SHA, RENEW),
        (RELEASE_SHA, RELEASE),
        (METRICS_SHA, METRICS),
        (READ_SHA, READ),
    )
}


def busy_pttl_ms(reply: int) -> int:
    """The holder's remaining TTL (ms) encoded in a negative ACQUIRE reply."""
    return -reply - 1


def load_all(client: Any) -> None:
    """Load every script into the server's script cache (after a restart or SCRIPT FLUSH).

    On Redis Cluster into every primary's, one node after the other: a node that does not
    answer does not keep the others from getting them (its error is raised at the end).
    """
    if not is_cluster(client):
        for source in _SOURCES.values():
            client.script_load(source)
        return
    failed: BaseException | None = None
    for node in client.get_primaries():
        try:
            for source in _SOURCES.values():
                client.execute_command("SCRIPT", "LOAD", source, target_nodes=node)
        except REDIS_ERRORS as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


def rerun(client: Any, command: list[Any]) -> Any:
    """Run an ``["EVALSHA", sha, numkeys, ...]`` command whose script the server forgot
    (``NOSCRIPT``): the script is loaded, then run.

    On Redis Cluster it is sent as ``EVAL`` with the script's source instead, in one command
    routed like the ``EVALSHA`` (by its keys' slot), so the script runs, and is cached, on the
    node that forgot it (a ``SCRIPT LOAD`` has no key to be routed by).
    """
    if is_cluster(client):
        return execute(client, "EVAL", _SOURCES[command[1]], *command[2:])
    execute(client, "SCRIPT", "LOAD", _SOURCES[command[1]])
    return execute(client, *command)


def run_args(client: Any, command: list[Any]) -> Any:
    """Run a prepared ``["EVALSHA", sha, numkeys, ...]`` command, loading the script if needed."""
    try:
        return execute(client, *command)
    except NoScriptError:
        return rerun(client, command)


def run(client: Any, script_sha: str, keys: list[str], args: list[Any]) -> Any:
    """``EVALSHA`` one script on the lean path, loading it if the server forgot it.

    A connection that fails mid-call is retried once (see :func:`lean.execute_packed`):
    every script is safe to run twice (acquire and wait recognise their own token, renew
    replaces the TTL, release compares the token and finds a lock it handed over taken, leave
    removes what is already gone; metrics may count an increment twice).
    """
    try:
        return execute(client, "EVALSHA", script_sha, len(keys), *keys, *args)
    except NoScriptError:
        return rerun(client, ["EVALSHA", script_sha, len(keys), *keys, *args])


def read_each(client: Any, keys: list[str]) -> list[Any]:
    """READ of each lock hash in ``keys`` (``[seconds, microseconds, pttl, hgetall list]``),
    in one pipeline: on Redis Cluster each runs on the node of its key's slot, with that
    node's clock. Raises the first error reply, or a connection error."""
    if not keys:
        return []
    commands: list[list[Any]] = [["EVALSHA", READ_SHA, 1, key] for key in keys]
    replies = execute_many(client, commands)
    for index, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):
            replies[index] = rerun(client, commands[index])
        elif isinstance(reply, Exception):
            raise reply
    return replies


def release(
    client: Any, keys: list[str], args: list[Any], also: list[list[Any]]
) -> tuple[Any, bool]:
    """Run RELEASE with ``keys`` and ``args``, and the commands ``also`` in the same round trip.

    Returns RELEASE's raw reply (an :class:`Outcome` value, or the ticket first in line as
    bytes: see the script) and whether the round trip was sent twice (its connection failed
    after sending): then a GONE outcome may be this very release's first run. Raises the first
    error reply, or a connection error.
    """
    commands: list[list[Any]] = [["EVALSHA", RELEASE_SHA, len(keys), *keys, *args], *also]
    replies = execute_many(client, commands)
    for index, reply in enumerate(replies):
        if isinstance(reply, NoScriptError):  # Redis restarted: load and run it again
            replies[index] = run_args(client, commands[index])
        elif isinstance(reply, Exception):
            raise reply
    return replies[0], replies.retried


def replicated(client: Any, key: str, token: str, ttl_ms: int, acks: int, timeout_ms: int) -> int:
    """How many replicas acknowledged the lock at ``key`` (``token``'s), waiting up to
    ``timeout_ms`` for ``acks`` of them; -1 if the lock is no longer ``token``'s.

    One round trip: RENEW (a write of this connection, after the acquire or the hand-over in
    the replication stream) then ``WAIT acks timeout_ms``, which returns once the replicas
    acknowledged every write up to it. A handed-over lock was written by the releaser's
    connection, which ``WAIT`` alone would not cover; the renew makes it this connection's.
    """
    commands: list[list[Any]] = [
        ["EVALSHA", RENEW_SHA, 1, key, token, ttl_ms],
        ["WAIT", acks, timeout_ms],
    ]
    replies = execute_many(client, commands)
    if isinstance(replies[0], NoScriptError):
        execute(client, "SCRIPT", "LOAD", RENEW)
        replies = execute_many(client, commands)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return int(replies[1]) if replies[0] == Outcome.OK else -1
