"""``Lock`` and ``lock()``: one holder per resource, with a TTL, an owner token and a fence.

Guarantees (with a single Redis primary whose clock does not step backwards):

- at most one *valid* holder per resource: acquire is ``SET``-if-absent in one Lua script, and
  renew / release compare the owner token atomically (never a blind ``DEL`` or ``PEXPIRE``);
- every lock expires: the TTL is always set, so a dead holder frees it after at most ``ttl``;
- each acquisition gets a fence strictly greater than every earlier one for the same resource,
  for the database to reject a stale holder's writes (see :mod:`django_joblock.fencing`);
- the holder's own view is conservative: :meth:`Lock.remaining` counts from the *send* time of
  the last confirmed acquire/renew, minus a clock-drift margin, so the local copy of the lock
  always runs out before the server's does.

Failure modes: Redis down, timing out or out of memory raises :class:`LockBackendUnavailable`
(never "busy"). A reply lost after the server ran the acquire leaves a lock nobody knows it holds;
it expires after ``ttl``.
"""

from __future__ import annotations

import contextvars
import enum
import os
import secrets
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from redis.exceptions import NoScriptError
from rq import get_current_job as _get_current_job

from . import conf, lua, metrics
from .backend import REDIS_ERRORS, connection, execute_many, unavailable
from .backoff import full_jitter
from .exceptions import LockBackendUnavailable, LockError, LockLost, LockNotAcquired
from .keys import LockKeys, index_member, owner_hash, validate_resource
from .logs import log_lock, logger
from .signals import lock_acquired, lock_contended, lock_released

# Blocking acquire: first retry after <= 5 ms, doubling, never more than 0.5 s between tries.
ACQUIRE_BACKOFF = {"base": 0.005, "factor": 2.0, "cap": 0.5}
# Constant script arguments, encoded once (redis-py passes bytes through untouched).
_HOST = socket.gethostname()[:255].encode()
_FENCE_TTL = str(lua.FENCE_COUNTER_TTL_MS).encode()
_PID: tuple[int, bytes] = (0, b"")


def _pid() -> bytes:
    """This process's pid as bytes (recomputed after a fork)."""
    global _PID
    pid = os.getpid()
    if _PID[0] != pid:
        _PID = (pid, str(pid).encode())
    return _PID[1]


OnLost = Callable[["Lock", str], Any]

_current: contextvars.ContextVar[Lock | None] = contextvars.ContextVar(
    "django_joblock_current_lock", default=None
)


class LockState(enum.Enum):
    """Life cycle: UNLOCKED -> HELD <-> SUSPECT -> LOST, and HELD/SUSPECT/LOST -> RELEASED."""

    UNLOCKED = "unlocked"
    HELD = "held"
    SUSPECT = "suspect"  # renewals are failing; still valid until the local deadline
    LOST = "lost"
    RELEASED = "released"


def drift(ttl: float) -> float:
    """Safety margin (s) for clock drift between us and Redis: 1 % of the TTL + 2 ms."""
    return ttl * 0.01 + 0.002


def _number(name: str, value: object, *, allow_zero: bool, resource: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"lock({resource!r}): {name} must be a number of seconds, got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"lock({resource!r}): {name} must be {bound} seconds, got {value!r}.")
    return float(value)


def _job_context() -> tuple[str, str, str]:
    """(job id, function name, worker name) of the RQ job running in this thread, if any."""
    try:
        job = _get_current_job()
    except Exception:  # noqa: BLE001 - outside a worker, rq may raise on a missing connection
        return "", "", ""
    if job is None:
        return "", "", ""
    return job.id or "", job.func_name or "", getattr(job, "worker_name", None) or ""


class Lock:
    """A lock on one resource. Use as a context manager or call acquire/release yourself.

    ``ttl`` (s) defaults to ``JOBLOCK["LOCK_TTL"]``; ``wait`` (s) is how long :meth:`acquire`
    retries a busy lock (default ``JOBLOCK["ACQUIRE_WAIT"]``, 0 = one try). With ``heartbeat``
    the process's renewal thread renews the lock every ``HEARTBEAT_INTERVAL`` (default ttl/3);
    ``max_hold`` (s) stops renewing after that long. ``on_lost(lock, reason)`` is called (from
    the renewal thread) when the lock is found lost. ``using`` names the django-redis cache.
    """

    def __init__(
        self,
        resource: str,
        *,
        ttl: float | None = None,
        wait: float | None = None,
        heartbeat: bool = True,
        max_hold: float | None = None,
        on_lost: OnLost | None = None,
        using: str | None = None,
    ) -> None:
        settings = conf.get()
        self.resource: str = validate_resource(resource)
        self.ttl: float = _number(
            "ttl", settings.LOCK_TTL if ttl is None else ttl, allow_zero=False, resource=resource
        )
        if self.ttl < 0.01:
            raise ValueError(f"lock({resource!r}): ttl must be at least 0.01 seconds, got {ttl!r}.")
        self.wait: float = _number(
            "wait",
            settings.ACQUIRE_WAIT if wait is None else wait,
            allow_zero=True,
            resource=resource,
        )
        hold = settings.MAX_HOLD if max_hold is None else max_hold
        self.max_hold: float | None = (
            None if hold is None else _number("max_hold", hold, allow_zero=False, resource=resource)
        )
        self.heartbeat: bool = bool(heartbeat)
        self.heartbeat_interval: float = settings.heartbeat_interval(self.ttl)
        self.on_lost: OnLost | None = on_lost
        self.alias: str = using or settings.REDIS_ALIAS
        keys = LockKeys(settings.KEY_PREFIX, self.resource)
        self.key: str = keys.lock
        self.fence_key: str = keys.fence
        self.family: str = keys.family
        self.index_key: str = keys.index
        self.token: str = secrets.token_hex(16)
        self._owner: tuple[str, str] = ("", "")
        self.fence: int | None = None
        self.state: LockState = LockState.UNLOCKED
        self.lost_reason: str = ""
        self.job_id: str = ""
        self.job_func: str = ""
        self.acquired_at: float | None = None  # monotonic
        # Local validity deadline (monotonic): send time of last confirmed acquire/renew
        # + ttl - drift. Written by the renewal thread, read by the owner; float stores are atomic.
        self._valid_until: float = 0.0
        self._context_token: contextvars.Token[Lock | None] | None = None

    # -- state ---------------------------------------------------------------------------
    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    def remaining(self) -> float:
        """Seconds of validity left by the local monotonic clock (0 when not held)."""
        if self.state not in (LockState.HELD, LockState.SUSPECT):
            return 0.0
        return max(0.0, self._valid_until - time.monotonic())

    @property
    def held(self) -> bool:
        """True while acquired, not released, not lost, and the local deadline has not passed."""
        return self.remaining() > 0.0

    @property
    def lost(self) -> bool:
        """True once the lock is known lost, or its local validity deadline has passed."""
        if self.state is LockState.LOST:
            return True
        return self.state in (LockState.HELD, LockState.SUSPECT) and self.remaining() <= 0.0

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless this lock is still validly held.

        Noticing an expired deadline here (before the renewal thread did) counts as the loss:
        the lock is marked LOST with the usual signal, log, metric and ``on_lost``.
        """
        if not self.held:
            if self.state in (LockState.HELD, LockState.SUSPECT):
                from .renewal import renewer

                renewer().declare_lost(self, "validity deadline passed")
            reason = self.lost_reason or (
                "validity deadline passed"
                if self.state is not LockState.RELEASED
                else "already released"
            )
            raise LockLost(
                f"Lock is no longer held: {reason}",
                resource=self.resource,
                key=self.key,
                owner=self.owner,
            )

    # -- acquire / renew / release -------------------------------------------------------
    def _client(self) -> Any:
        return connection(self.alias)

    def _unavailable(self, exc: BaseException, action: str) -> LockBackendUnavailable:
        return unavailable(exc, action, resource=self.resource, key=self.key, owner=self.owner)

    @property
    def owner(self) -> str:
        """Short hash of the current token: safe to log and show (the token is not)."""
        if self._owner[0] != self.token:
            self._owner = (self.token, owner_hash(self.token))
        return self._owner[1]

    def acquire(self, wait: float | None = None) -> bool:
        """Take the lock, retrying a busy lock with exponential backoff + full jitter.

        Returns False if it was still busy after ``wait`` seconds (default: this lock's wait).
        Raises :class:`LockBackendUnavailable` if Redis cannot be asked, :class:`LockError` if
        this object already holds the lock.
        """
        if self.state in (LockState.HELD, LockState.SUSPECT):
            raise LockError(
                "This Lock object already holds the lock",
                resource=self.resource,
                key=self.key,
                owner=self.owner,
            )
        wait = (
            self.wait
            if wait is None
            else _number("wait", wait, allow_zero=True, resource=self.resource)
        )
        if self.state is not LockState.UNLOCKED:
            # A fresh token per acquisition: a late renew of the previous holding can never
            # extend this one.
            self.token = secrets.token_hex(16)
        self.job_id, self.job_func, worker = _job_context()
        client = self._client()
        args = [
            self.token,
            self.ttl_ms,
            _FENCE_TTL,
            _HOST,
            _pid(),
            self.job_id,
            self.job_func,
            worker,
        ]
        started = time.monotonic()
        deadline = started + wait
        attempt = 0
        while True:
            sent = time.monotonic()
            try:
                reply = lua.run(client, lua.ACQUIRE_SHA, [self.key, self.fence_key], args)
            except REDIS_ERRORS as exc:
                metrics.count("acquire_attempts", self.family, self.job_func)
                metrics.count("acquire_errors", self.family, self.job_func)
                raise self._unavailable(exc, "acquire the lock") from exc
            if reply > 0:
                metrics.record_acquire(self.family, self.job_func, sent - started, acquired=True)
                self._on_acquired(reply, sent, waited=sent - started)
                return True
            now = time.monotonic()
            if now >= deadline:
                metrics.record_acquire(self.family, self.job_func, now - started, acquired=False)
                lock_contended.send(sender=Lock, lock=self, waited=now - started)
                log_lock(
                    20,
                    "contended",
                    self,
                    "lock busy",
                    reason=f"held, pttl={lua.busy_pttl_ms(reply)}ms",
                )
                return False
            delay = full_jitter(
                attempt,
                base=ACQUIRE_BACKOFF["base"],
                factor=ACQUIRE_BACKOFF["factor"],
                cap=ACQUIRE_BACKOFF["cap"],
            )
            time.sleep(min(delay, deadline - now))
            attempt += 1

    def _on_acquired(self, fence: int, sent: float, *, waited: float) -> None:
        from .renewal import renewer

        self.fence = fence
        self.acquired_at = sent
        self._valid_until = sent + self.ttl - drift(self.ttl)
        self.lost_reason = ""
        self.state = LockState.HELD
        renewer().add(self)
        lock_acquired.send(sender=Lock, lock=self, waited=waited)
        log_lock(10, "acquired", self, "lock acquired")

    def confirm_renewed(self, sent: float) -> None:
        """Record a renewal confirmed by Redis that was sent at monotonic time ``sent``."""
        self._valid_until = max(self._valid_until, sent + self.ttl - drift(self.ttl))
        if self.state is LockState.SUSPECT:
            self.state = LockState.HELD

    def renew(self) -> bool:
        """Renew now (replacing the TTL). False, and the lock marked lost, if no longer ours."""
        from .renewal import renewer

        if self.state not in (LockState.HELD, LockState.SUSPECT):
            return False
        sent = time.monotonic()
        try:
            code = lua.Outcome(
                lua.run(self._client(), lua.RENEW_SHA, [self.key], [self.token, self.ttl_ms])
            )
        except REDIS_ERRORS as exc:
            raise self._unavailable(exc, "renew the lock") from exc
        if code is lua.Outcome.OK:
            self.confirm_renewed(sent)
            log_lock(10, "renewed", self, "lock renewed")
            return True
        renewer().declare_lost(self, code.reason)
        return False

    def release(self) -> bool:
        """Release if still ours (compare-and-delete). False if it had expired or changed owner.

        Raises :class:`LockBackendUnavailable` if Redis cannot be asked; the lock then expires
        after its TTL.
        """
        from .renewal import renewer

        if self.state not in (LockState.HELD, LockState.SUSPECT, LockState.LOST):
            return False
        indexed = renewer().remove(self)
        self.state = LockState.RELEASED
        held_for = time.monotonic() - (self.acquired_at or time.monotonic())
        metrics.observe("hold_seconds", self.family, self.job_func, held_for)
        client = self._client()
        commands: list[list[Any]] = [["EVALSHA", lua.RELEASE_SHA, 1, self.key, self.token]]
        if indexed:
            commands.append(["ZREM", self.index_key, index_member(self.resource, self.owner)])
        # Metrics ride along with the release: inside a job always (the work horse may exit
        # right after), elsewhere once a flush is due.
        pending = metrics.take_for_flush(force=bool(self.job_id))
        if pending:
            commands.append(metrics.recorder().command(pending))
        try:
            replies = execute_many(client, commands)
            for index, reply in enumerate(replies):
                if isinstance(reply, NoScriptError):  # Redis restarted: load and run it again
                    replies[index] = lua.run_args(client, commands[index])
                elif isinstance(reply, Exception):
                    raise reply
        except REDIS_ERRORS as exc:
            if pending:
                metrics.recorder().restore(pending)
            raise self._unavailable(exc, "release the lock") from exc
        code = lua.Outcome(replies[0])
        released = code is lua.Outcome.OK
        lock_released.send(sender=Lock, lock=self, released=released, held_for=held_for)
        log_lock(
            10 if released else 30,
            "released",
            self,
            "lock released" if released else "lock was no longer ours at release",
            reason=code.reason,
        )
        return released

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> Lock:
        if not self.acquire():
            raise LockNotAcquired(
                f"Lock busy after waiting {self.wait:g}s",
                resource=self.resource,
                key=self.key,
                owner=None,
            )
        self._context_token = _current.set(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._context_token is not None:
            _current.reset(self._context_token)
            self._context_token = None
        try:
            self.release()
        except LockBackendUnavailable:
            if exc is None:
                raise
            # Do not hide the body's own exception; the lock expires after its TTL.
            logger.warning(
                "Could not release %s after an error in the block", self.key, exc_info=True
            )

    def __repr__(self) -> str:
        return (
            f"<Lock resource={self.resource!r} state={self.state.value} "
            f"owner={self.owner} fence={self.fence}>"
        )


def lock(
    resource: str,
    *,
    ttl: float | None = None,
    wait: float | None = None,
    heartbeat: bool = True,
    max_hold: float | None = None,
    on_lost: OnLost | None = None,
    using: str | None = None,
) -> Lock:
    """A :class:`Lock` on ``resource``; ``with lock("order:1") as held: ...``.

    Entering raises :class:`LockNotAcquired` if the lock stayed busy for ``wait`` seconds.
    """
    return Lock(
        resource,
        ttl=ttl,
        wait=wait,
        heartbeat=heartbeat,
        max_hold=max_hold,
        on_lost=on_lost,
        using=using,
    )


def current_lock() -> Lock | None:
    """The lock entered by the code (or RQ job) running in this thread/context, if any."""
    return _current.get()


def set_current_lock(held: Lock | None) -> contextvars.Token[Lock | None]:
    """Make ``held`` the :func:`current_lock` (used by the RQ wrapper); undo with the token."""
    return _current.set(held)


def reset_current_lock(token: contextvars.Token[Lock | None]) -> None:
    """Undo :func:`set_current_lock`."""
    _current.reset(token)
