"""The one-per-process renewal thread: heartbeats, loss detection and the active-lock index.

Every lock a process acquires is registered here. One daemon thread, however many locks:

- renews each heartbeat lock every ``heartbeat_interval`` seconds, batching the renewals due
  within a quarter interval into one round trip per Redis server (see :mod:`.heartbeat`);
- writes the family's active-lock index entry for locks held longer than ``INDEX_DELAY``
  seconds in the same round trips (a lock released sooner never touches the index, which
  keeps acquire and release to one round trip each);
- HELD -> SUSPECT when a renewal fails (retried quickly); SUSPECT -> LOST when the token is
  gone or someone else's, when no renewal can be confirmed before the local validity deadline,
  or when ``max_hold`` stopped the renewals and the lock ran out. On LOST: ``lock.lost``, the
  ``lock_lost`` signal, a warning and ``on_lost``;
- refers to the locks *weakly*: a ``Lock`` nobody references any more (dropped without
  release) is not renewed again; it expires after its TTL, and a warning names it.

Its own client has short socket timeouts and no client-side retries (see
:func:`django_joblock.backend.renewal_client`), so a black-holed server is noticed and the lock
declared LOST *before* the server-side TTL could let another holder in. A failure inside the
thread is logged and the loop goes on; a lock's own deadline keeps running out regardless.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import replace
from typing import Any, Protocol

from redis.exceptions import NoScriptError

from . import conf, lua, metrics
from .backend import connection, renewal_client
from .heartbeat import Entry, RenewalStats, batch
from .holding import LockState
from .lean import execute_packed
from .logs import logger


class Renewable(Protocol):
    """What the renewal thread needs of a lock (a :class:`django_joblock.Lock`). The lock
    changes its own state; this thread only decides when, and calls it."""

    resource: str
    key: str
    alias: str
    index_key: str
    family: str
    job_func: str
    token: str
    heartbeat: bool
    heartbeat_interval: float
    max_hold: float | None
    state: LockState

    @property
    def ttl(self) -> float: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def owner(self) -> str: ...
    @property
    def valid_until(self) -> float: ...
    @property
    def hold_until(self) -> float: ...
    def confirm_renewed(self, sent: float) -> None: ...
    def mark_lost(self, reason: str) -> bool: ...
    def announce_lost(self, reason: str) -> None: ...
    def renewal_failed(self, exc: BaseException) -> None: ...


INDEX_DELAY = 0.5  # seconds a lock is held before it is written to the active-lock index
COALESCE = 0.25  # renew up to this fraction of an interval early, to share a pipeline
BATCH = 2000  # renewals per pipeline, so one reply never approaches the socket timeout
IDLE_POLL = 0.25  # seconds between wake-ups while nothing is held ...
IDLE_STOP = 60.0  # ... for this long; after that the thread sleeps until a lock is added


# (entry, its lock, whether to renew it): one item of a batch sent to Redis.
_Work = tuple["_Entry", Renewable, bool]
_Entry = Entry[Renewable]


class Renewer:
    """Registry of the locks held by this process, and the thread that keeps them.

    Scheduling is a heap of ``(when, seq, entry)``; an entry is pushed again whenever its next
    moment changes and stale heap items are skipped, so a wake-up costs O(k log n) for the k
    locks due, not O(n), and registering a lock wakes the thread only if it is due first.
    Entries are keyed by ``id(lock)`` and refer to their lock weakly; an entry is current only
    while its weak reference still returns that lock.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._entries: dict[int, _Entry] = {}
        self._heap: list[tuple[float, int, _Entry]] = []
        self._seq = itertools.count()
        self._wake_at = math.inf
        self._idle_since: float | None = None
        self._thread: threading.Thread | None = None
        # alias -> (its renewal client, made on first use by the thread; the socket timeout)
        # alias -> (renewal client or None until first needed, its socket timeout, the
        # connection it was made for: a new one after a settings change means a new client)
        self._clients: dict[str, tuple[Any | None, float, Any]] = {}
        self._stats = RenewalStats()

    # -- registry -------------------------------------------------------------------------
    def add(self, held: Renewable, *, renew_within: float = math.inf) -> None:
        """Start keeping ``held`` (just acquired); renew it first within ``renew_within``
        seconds if that is sooner than its interval (a lock handed over by a release is valid
        for less than its TTL until renewed)."""
        now = time.monotonic()
        interval = held.heartbeat_interval
        entry: _Entry = Entry(
            ref=weakref.ref(held),
            lock_id=id(held),
            resource=held.resource,
            key=held.key,
            alias=held.alias,
            index_key=held.index_key,
            ttl_ms=held.ttl_ms,
            interval=interval,
            renew_due=now + min(interval, renew_within) if held.heartbeat else math.inf,
            index_due=now + INDEX_DELAY,
        )
        with self._cond:
            self._entries[id(held)] = entry
            self._ensure_client(held)
            when = self._schedule(entry, held)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="joblock-renewer", daemon=True
                )
                self._thread.start()
            if when < self._wake_at:
                self._cond.notify()

    def _pop(self, held: Renewable) -> _Entry | None:
        """Remove and return ``held``'s entry (caller holds the condition)."""
        entry = self._entries.get(id(held))
        if entry is None or entry.ref() is not held:
            return None
        del self._entries[entry.lock_id]
        return entry

    def remove(self, held: Renewable) -> bool:
        """Stop keeping ``held``; True if its active-index entry had been written."""
        with self._cond:
            entry = self._pop(held)
        return entry is not None and entry.indexed

    def held_locks(self) -> list[Renewable]:
        """The locks this process holds (acquired, not yet released, lost or dropped)."""
        with self._cond:
            found = [entry.ref() for entry in self._entries.values()]
        return [held for held in found if held is not None]

    def stats(self) -> RenewalStats:
        with self._cond:
            return replace(self._stats)

    # -- thread ---------------------------------------------------------------------------
    def _ensure_client(self, held: Renewable) -> None:
        """Note the socket timeout ``held`` needs (caller holds the condition). The client
        itself is made by the thread when it first sends (:meth:`_client`): most locks are
        released before that, and a short-lived work horse never pays for one."""
        wanted = max(0.01, min(conf.get().RENEW_TIMEOUT, held.ttl / 5))
        current = self._clients.get(held.alias)
        if current is None or current[1] > wanted:
            self._clients[held.alias] = (None, wanted, None)

    def _client(self, alias: str) -> Any:
        with self._cond:
            client, timeout, made_for = self._clients[alias]
            base = connection(alias)
            if client is None or made_for is not base:
                client = renewal_client(base, timeout)
                self._clients[alias] = (client, timeout, base)
            return client

    def _timeout(self, alias: str) -> float:
        return float(self._clients[alias][1])

    def _schedule(self, entry: _Entry, held: Renewable) -> float:
        """Push ``entry`` at its next moment (caller holds the condition)."""
        when = held.valid_until
        if held.state is LockState.SUSPECT:
            when -= self._timeout(entry.alias)
        when = min(when, entry.renew_due)
        if not entry.indexed:
            when = min(when, entry.index_due)
        heapq.heappush(self._heap, (when, next(self._seq), entry))
        return when

    def _mark_lost(self, held: Renewable, reason: str) -> bool:
        """Ask ``held`` to become LOST (caller holds the condition); True if it did."""
        if held.mark_lost(reason):
            self._stats.lost += 1
            return True
        return False

    def _run(self) -> None:
        while True:
            try:
                if not self._step():
                    return
            except Exception:  # noqa: BLE001 - never die silently: log, back off, go on
                logger.exception("django_joblock renewal thread error; continuing")
                time.sleep(0.05)

    def _step(self) -> bool:
        started_cpu = time.thread_time()
        self._flush_metrics()  # outside the condition: network I/O must not block add()
        with self._cond:
            if self.pid != os.getpid():
                return False
            now = time.monotonic()
            lost, work, dropped = self._gather(now)
            if not lost and not work and not dropped:
                # Nothing here refers to a lock any more: a lock dropped by its owner while
                # the thread sleeps can be collected.
                self._sleep(now)
                return True
            self._wake_at = -math.inf
        for held, reason in lost:
            held.announce_lost(reason)
        del lost
        for entry in dropped:
            logger.warning(
                "lock %s was dropped while held (no release, no reference left): no longer "
                "renewed, it expires within its TTL",
                entry.key,
                extra={"resource": entry.resource, "lock_key": entry.key, "outcome": "dropped"},
            )
        for alias, items in work.items():
            for start in range(0, len(items), BATCH):
                chunk = items[start : start + BATCH]
                try:
                    self._send(alias, chunk)
                finally:
                    with self._cond:
                        for entry, held, _renew in chunk:
                            entry.in_flight = False
                            if self._entries.get(entry.lock_id) is entry:
                                self._schedule(entry, held)
        with self._cond:
            self._stats.cpu_seconds += time.thread_time() - started_cpu
        return True

    def _gather(
        self, now: float
    ) -> tuple[list[tuple[Renewable, str]], dict[str, list[_Work]], list[_Entry]]:
        """Pop what is due (caller holds the condition): (lost, work per alias, dropped).

        Everything due within a quarter interval of the first due lock joins one batch:
        renewing a little early is harmless (renew replaces the TTL) and turns a stream of
        individual deadlines into a few pipelines per interval.
        """
        lost: list[tuple[Renewable, str]] = []
        work: dict[str, list[_Work]] = defaultdict(list)
        dropped: list[_Entry] = []
        later: list[tuple[_Entry, Renewable]] = []
        horizon = now
        if self._heap and self._heap[0][0] <= now:
            horizon = now + COALESCE * self._heap[0][2].interval
        while self._heap and self._heap[0][0] <= horizon:
            entry = heapq.heappop(self._heap)[2]
            if self._entries.get(entry.lock_id) is not entry or entry.in_flight:
                continue  # released, lost, or already in this batch
            held = entry.ref()
            if held is None:  # nobody references the lock any more: let it expire
                del self._entries[entry.lock_id]
                self._stats.dropped += 1
                dropped.append(entry)
                continue
            reason = self._lost_reason(entry, held, now)
            if reason:
                del self._entries[entry.lock_id]
                if self._mark_lost(held, reason):
                    lost.append((held, reason))
                continue
            if not (held.heartbeat and now < held.hold_until):
                entry.renew_due = math.inf  # heartbeat off or max_hold reached
            renew = entry.renew_due <= horizon
            if renew or (not entry.indexed and entry.index_due <= horizon):
                entry.in_flight = True
                work[entry.alias].append((entry, held, renew))
            else:
                later.append((entry, held))
        for entry, held in later:
            self._schedule(entry, held)
        return lost, work, dropped

    def _flush_metrics(self) -> bool:
        """Flush the process's metric buffer if due; True if it sent something."""
        pending = metrics.take_for_flush(force=False)
        if not pending:
            return False
        alias = conf.get().REDIS_ALIAS
        client = self._client(alias) if alias in self._clients else connection(alias)
        try:
            lua.run_args(client, metrics.recorder().command(pending))
        except Exception:  # noqa: BLE001 - Redis trouble: keep the counts for the next flush
            metrics.recorder().restore(pending)
            return False
        return True

    def _sleep(self, now: float) -> None:
        """Wait for the next due entry (caller holds the condition).

        Stale heap items (released locks) are dropped first, so a stream of short holds does
        not wake the thread. With nothing held it still wakes every IDLE_POLL seconds for a
        while: then registering a lock (due INDEX_DELAY later at the soonest, for normal TTLs)
        need not ``notify``, keeping a thread switch off the acquire hot path.
        """
        heap = self._heap
        while heap and self._entries.get(heap[0][2].lock_id) is not heap[0][2]:
            heapq.heappop(heap)
        if heap:
            self._idle_since = None
            self._wake_at = heap[0][0]
            if metrics.recorder().pending():
                self._wake_at = min(self._wake_at, now + metrics.FLUSH_INTERVAL)
        elif self._idle_since is None or now - self._idle_since < IDLE_STOP:
            self._idle_since = now if self._idle_since is None else self._idle_since
            self._wake_at = now + IDLE_POLL
        elif metrics.recorder().pending():
            self._wake_at = now + metrics.FLUSH_INTERVAL
        else:
            self._wake_at = math.inf
        self._cond.wait(None if self._wake_at == math.inf else max(0.0, self._wake_at - now))
        self._wake_at = -math.inf  # awake: add() need not notify

    def _lost_reason(self, entry: _Entry, held: Renewable, now: float) -> str:
        if now >= held.valid_until:
            if not held.heartbeat:
                return "ttl expired (heartbeat off)"
            if now >= held.hold_until:
                return f"max_hold ({held.max_hold:g}s) reached"
            return "no renewal confirmed before the validity deadline"
        if held.state is LockState.SUSPECT and now + self._timeout(entry.alias) >= held.valid_until:
            # One more attempt could not be confirmed in time: give up *before* the deadline.
            return f"renewals failing ({entry.failures} in a row) up to the validity deadline"
        return ""

    def _send(self, alias: str, items: list[_Work]) -> None:
        """One round trip (see :func:`heartbeat.batch`), never retried here: a failure makes
        the locks SUSPECT, and they are retried soon."""
        client = self._client(alias)
        renewing: list[tuple[_Entry, Renewable]] = []
        for entry, held, renew in items:
            entry.encode(held.token, held.owner)
            if renew:
                renewing.append((entry, held))
        packed, count, _ = batch(
            ((entry, held.family, renew) for entry, held, renew in items),
            conf.get().KEY_PREFIX,
        )
        sent = time.monotonic()
        try:
            replies = execute_packed(client, packed, count, retry=False)
        except Exception as exc:  # noqa: BLE001 - any failure makes these locks SUSPECT
            self._failed(renewing, sent, exc)
            return
        with self._cond:
            self._stats.round_trips += 1
            self._stats.index_writes += len(items)
            for entry, _held, _renew in items:
                entry.indexed = True
        self._renewed(renewing, replies[: len(renewing)], sent, client)

    def _renewed(
        self, items: list[tuple[_Entry, Renewable]], replies: list[Any], sent: float, client: Any
    ) -> None:
        lost: list[tuple[Renewable, str]] = []
        renewed: dict[tuple[str, str], int] = defaultdict(int)
        reload = False
        with self._cond:
            for (entry, held), reply in zip(items, replies, strict=True):
                if self._entries.get(entry.lock_id) is not entry:
                    continue  # released (or lost) while the pipeline was in flight
                if isinstance(reply, NoScriptError):
                    reload = True  # Redis restarted; retry at once, not a failure
                    entry.renew_due = 0.0
                elif isinstance(reply, Exception):
                    self._stats.renew_failed += 1
                    metrics.count("renew_failed", held.family, held.job_func)
                    self._suspect(entry, held, reply)
                elif reply == lua.Outcome.OK:
                    held.confirm_renewed(sent)
                    entry.failures = 0
                    entry.renew_due = sent + entry.interval
                    renewed[(held.family, held.job_func)] += 1
                else:
                    reason = lua.Outcome(reply).reason
                    del self._entries[entry.lock_id]
                    if self._mark_lost(held, reason):
                        lost.append((held, reason))
            self._stats.renewed += sum(renewed.values())
        for (family, func), count in renewed.items():
            metrics.count("renewed", family, func, count)
        if reload:
            try:
                lua.load_all(client)
            except Exception:  # noqa: BLE001 - the next renewal retries and reports
                logger.warning("could not reload lock scripts", exc_info=True)
        for held, reason in lost:
            held.announce_lost(reason)

    def _failed(self, items: list[tuple[_Entry, Renewable]], sent: float, exc: Exception) -> None:
        with self._cond:
            self._stats.round_trips += 1
            for entry, held in items:
                if self._entries.get(entry.lock_id) is entry:
                    self._stats.renew_failed += 1
                    metrics.count("renew_failed", held.family, held.job_func)
                    self._suspect(entry, held, exc)

    def _suspect(self, entry: _Entry, held: Renewable, exc: BaseException) -> None:
        entry.failures += 1
        held.renewal_failed(exc)
        # Retry soon, but do not hammer a server that just timed out.
        entry.renew_due = time.monotonic() + min(
            entry.interval / 2, max(0.02, self._timeout(entry.alias) / 2)
        )


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def renewer() -> Renewer:
    """This process's :class:`Renewer` (a new one after ``fork``)."""
    global _renewer
    current = _renewer
    if current is not None and current.pid == os.getpid():
        return current
    with _renewer_lock:
        if _renewer is None or _renewer.pid != os.getpid():
            _renewer = Renewer()
        return _renewer


def _after_fork_in_child() -> None:
    # The parent's registry (and its condition's lock, possibly held at fork time) is not
    # ours: a forked child starts with an empty registry and its own thread.
    global _renewer, _renewer_lock
    _renewer = None
    _renewer_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
