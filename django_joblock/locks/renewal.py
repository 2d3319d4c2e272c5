"""The one-per-process renewal thread: heartbeats, loss detection and index refreshes.

It keeps every lock the process holds, however many:

- renews each heartbeat lock every ``heartbeat_interval``, batching the renewals due within a
  quarter interval into one round trip per alias (at most :data:`BATCH`), earliest deadline
  first, with the refresh of their active-lock index entries (:mod:`.index`);
- a failed renewal makes the lock SUSPECT (retried soon, logged once with its cause); it is
  LOST when its token is gone or another's, when no renewal can be confirmed before its local
  deadline (declared one socket timeout *before* it: never after the server may have let
  another holder in), or when ``max_hold`` stopped the renewals and it ran out;
- refers to locks weakly: an unreferenced ``Lock`` is not renewed (it expires), with a warning;
- flushes the process's buffered metrics once a second while there are any.

Its sockets time out after ``min(REDIS_TIMEOUT, TTL / 5)`` (per lock, rounded down to a power of
two; a round trip takes its locks' shortest, and so does the metrics flush) without retries, so a
black-holed server is noticed in time. While the process holds locks on several cache aliases,
each alias's round trips go from a sender thread of its own: a server that stopped answering
holds up its own locks only. A failure inside the thread is logged and the loop goes on.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .. import conf, metrics
from ..backend import REDIS_ERRORS, renewal_client, send
from ..logs import logger
from . import index, replicas
from .scripts import RENEW, Outcome
from .state import Holding, LockState  # a lock changes its own state; this thread decides when

COALESCE = 0.25  # renew up to this fraction of an interval early, to share a pipeline
BATCH = 2000  # renewals per pipeline, so one reply never approaches the socket timeout
IDLE_POLL = 0.25  # seconds between wake-ups while nothing is held ...
IDLE_STOP = 60.0  # ... for this long; after that the thread sleeps until a lock is added
# While a job's lock is held here, the job's release carries the metrics (DESIGN 4.16: a
# lock-only job costs 2 round trips); the thread flushes them once they are this old (s).
JOB_FLUSH_INTERVAL = 10.0


@dataclass
class RenewalStats:
    """Counters of this process's renewal thread (cumulative)."""

    round_trips: int = 0
    renewed: int = 0
    renew_failed: int = 0
    lost: int = 0
    dropped: int = 0


@dataclass(eq=False)
class Entry:
    """One holding of one lock, as the thread schedules it (its lock referred to weakly)."""

    ref: weakref.ReferenceType[Holding]
    lock_id: int  # id() of the lock: the registry key, valid while ``ref`` returns the lock
    key: str
    alias: str
    interval: float
    renew_due: float
    timeout: float  # socket timeout (s) of its renewals' round trips (:func:`_socket_timeout`)
    job: bool = False  # held by an RQ job: its release flushes the metrics
    failures: int = 0
    in_flight: bool = False


_Work = tuple[Entry, Holding]
_Lost = tuple[Holding, str]  # a lock found lost, and why


class Renewer:
    """Registry of the locks held by this process, and the thread that keeps them.

    Scheduling is a heap of ``(when, seq, entry)``; an entry is pushed again whenever its next
    moment changes and stale heap items are skipped, so a wake-up costs O(k log n) for the k
    locks due, and registering a lock wakes the thread only if it is due first."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        # The registry's guard; the thread sleeps on a condition of it (Condition's own
        # ``with`` costs a Python call on each acquire and release).
        self._guard = threading.Lock()
        self._cond = threading.Condition(self._guard)
        self._entries: dict[int, Entry] = {}
        self._heap: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count()
        self._wake_at = math.inf
        self._idle_since: float | None = None
        self._thread: threading.Thread | None = None
        self._senders: dict[str, ThreadPoolExecutor] = {}  # with locks on several aliases
        self._stats = RenewalStats()

    def add(self, held: Holding, *, valid_for: float = math.inf) -> None:
        """Start keeping ``held`` (just acquired), valid for ``valid_for`` s from now when that
        is less than its TTL (a lock handed over by a release lives ``WAITER_TTL``): until its
        first renewal is confirmed, it is renewed within a third of that, and its round trips
        time out after a fifth of it, so that a renewal that cannot be confirmed is given up
        before the lock runs out on the server, as for the TTL."""
        interval = held.heartbeat_interval
        due = time.monotonic() + min(interval, valid_for / 3) if held.heartbeat else math.inf
        timeout = _socket_timeout(min(held.ttl, valid_for))
        ref = weakref.ref(held)
        entry = Entry(
            ref, id(held), held.key, held.cache, interval, due, timeout, job=bool(held.job_id)
        )
        with self._guard:
            self._entries[id(held)] = entry
            when = self._schedule(entry, held)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="joblock-renewer", daemon=True
                )
                self._thread.start()
            if when < self._wake_at:
                self._cond.notify()

    def remove(self, held: Holding) -> None:
        """Stop keeping ``held``."""
        with self._guard:
            entry = self._entries.get(id(held))
            if entry is not None and entry.ref() is held:
                del self._entries[entry.lock_id]
            if len(self._heap) > 2 * len(self._entries) + 1000:  # released locks' items: drop
                self._heap = [
                    item for item in self._heap if self._entries.get(item[2].lock_id) is item[2]
                ]
                heapq.heapify(self._heap)

    def held_locks(self) -> list[Holding]:
        """The locks this process holds (acquired, not yet released, lost or dropped)."""
        with self._guard:
            found = [entry.ref() for entry in self._entries.values()]
        return [held for held in found if held is not None]

    def stats(self) -> RenewalStats:
        with self._guard:
            return replace(self._stats)

    def _schedule(self, entry: Entry, held: Holding) -> float:
        """Push ``entry`` at its next moment (caller holds the guard)."""
        when = min(self._give_up_at(entry, held), entry.renew_due)
        heapq.heappush(self._heap, (when, next(self._seq), entry))
        return when

    def _give_up_at(self, entry: Entry, held: Holding) -> float:
        """When a lock must be declared lost at the latest: its local deadline, or, while its
        renewals fail, one socket timeout before it (a later renewal could not be confirmed)."""
        if held.state is LockState.SUSPECT:
            return held.valid_until - entry.timeout
        return held.valid_until

    def _run(self) -> None:
        try:
            while True:
                try:
                    if not self._step():
                        return
                except BaseException:  # noqa: BLE001 - never die silently: log, back off, go on
                    # BaseException too: an ``on_lost`` callback or ``lock_lost`` receiver
                    # that calls sys.exit() raises SystemExit here, which would end the thread
                    # without a word and leave every other lock of the process unrenewed.
                    logger.exception("django_joblock renewal thread error; continuing")
                    time.sleep(0.05)
        finally:
            # Should it end all the same, the next add() starts another (add() looks at
            # ``_thread`` only: Thread.is_alive() would cost three calls per acquire).
            with self._guard:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _step(self) -> bool:
        with self._guard:
            # Taken under the guard: a job's lock is added here before its acquire is
            # counted, so a running job's metrics stay for its release, unless it runs long.
            job_held = any(entry.job for entry in self._entries.values())
            interval = JOB_FLUSH_INTERVAL if job_held else metrics.FLUSH_INTERVAL
            taken = metrics.take_for_flush(force=False, interval=interval)
        if taken:
            metrics.flush(self._flush_client, taken)  # outside the guard
        with self._guard:
            if self.pid != os.getpid():
                return False
            now = time.monotonic()
            lost, work, dropped = self._gather(now)
            if not lost and not work and not dropped:
                self._sleep(now)
                return True
            self._wake_at = -math.inf
        _announce(lost)
        del lost
        for key in dropped:
            message = (
                "lock %s was dropped while held (no release, no reference left): no longer "
                "renewed, it expires within its TTL"
            )
            logger.warning(message, key, extra={"lock_key": key, "outcome": "dropped"})
        self._dispatch(work)
        return True

    def _dispatch(self, work: dict[str, list[_Work]]) -> None:
        """Send each alias's renewals: in this thread while the process holds locks of one
        alias only; else each alias's in a sender thread of its own, so that a Redis that
        stopped answering holds up only its own locks' renewals (for its socket timeout),
        never those of the locks on another Redis."""
        with self._guard:
            several = len({entry.alias for entry in self._entries.values()}) > 1
        for alias, items in work.items():
            chunks = [items[start : start + BATCH] for start in range(0, len(items), BATCH)]
            if several and self._submitted(alias, chunks):
                continue
            self._send_chunks(alias, chunks)

    def _submitted(self, alias: str, chunks: list[list[_Work]]) -> bool:
        """Hand ``chunks`` to ``alias``'s sender thread; False once the interpreter is shutting
        down (no new thread may start then: this thread sends them itself)."""
        try:
            self._sender(alias).submit(self._send_in_sender, alias, chunks)
        except RuntimeError:
            return False
        return True

    def _sender(self, alias: str) -> ThreadPoolExecutor:
        """The sender thread of ``alias`` (made on first use; only this thread asks)."""
        found = self._senders.get(alias)
        if found is None:
            found = ThreadPoolExecutor(max_workers=1, thread_name_prefix="joblock-renewer-send")
            self._senders[alias] = found
        return found

    def _send_in_sender(self, alias: str, chunks: list[list[_Work]]) -> None:
        try:
            self._send_chunks(alias, chunks)
        except BaseException:  # noqa: BLE001 - a future would keep it unseen: log it
            logger.exception("django_joblock renewal of %s locks failed; continuing", alias)

    def _send_chunks(self, alias: str, chunks: list[list[_Work]]) -> None:
        """Renew ``chunks`` one round trip each, then schedule their locks' next moments: all
        of them, even if a round trip raised (a lock left in flight would never be renewed
        again, nor declared lost)."""
        try:
            for chunk in chunks:
                self._send(alias, chunk)
        finally:
            with self._guard:
                for entry, held in (work for chunk in chunks for work in chunk):
                    entry.in_flight = False
                    if self._entries.get(entry.lock_id) is not entry:
                        continue
                    if self._schedule(entry, held) < self._wake_at:
                        self._cond.notify()  # (sent by a sender thread: the loop sleeps)

    def _gather(self, now: float) -> tuple[list[_Lost], dict[str, list[_Work]], list[str]]:
        """Pop what is due (caller holds the guard): (lost, work per alias, dropped keys).
        Everything due within a quarter interval of the first due lock joins one batch: early
        renewal is harmless (it replaces the TTL) and turns many deadlines into few pipelines."""
        lost: list[_Lost] = []
        work: dict[str, list[_Work]] = defaultdict(list)
        dropped: list[str] = []
        later: list[_Work] = []
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
                dropped.append(entry.key)
                continue
            reason = self._lost_reason(entry, held, now)
            if reason:
                del self._entries[entry.lock_id]
                if held.mark_lost(reason):
                    self._stats.lost += 1
                    lost.append((held, reason))
                continue
            if not (held.heartbeat and now < held.hold_until):
                entry.renew_due = math.inf  # heartbeat off or max_hold reached
            if entry.renew_due <= horizon:
                entry.in_flight = True
                work[entry.alias].append((entry, held))
            else:
                later.append((entry, held))
        for entry, held in later:  # after the loop: each may be due within the horizon
            self._schedule(entry, held)
        return lost, work, dropped

    def _sleep(self, now: float) -> None:
        """Wait for the next due entry (caller holds the guard), stale heap items dropped
        first. With nothing held it still wakes every ``IDLE_POLL`` s for a while, so that
        registering a lock need not ``notify``: no thread switch on the acquire's path."""
        heap = self._heap
        while heap and self._entries.get(heap[0][2].lock_id) is not heap[0][2]:
            heapq.heappop(heap)
        if heap:
            self._idle_since = None
            self._wake_at = heap[0][0]
        else:
            self._idle_since = now if self._idle_since is None else self._idle_since
            self._wake_at = now + IDLE_POLL if now - self._idle_since < IDLE_STOP else math.inf
        if metrics.pending():
            self._wake_at = min(self._wake_at, now + metrics.FLUSH_INTERVAL)
        self._cond.wait(None if self._wake_at == math.inf else max(0.0, self._wake_at - now))
        self._wake_at = -math.inf  # awake: add() need not notify

    def _flush_client(self) -> Any:
        """The metrics flush's (when one is due): it waits no longer than any renewal may."""
        with self._guard:
            timeout = min((entry.timeout for entry in self._entries.values()), default=None)
        return renewal_client(timeout=timeout)

    def _lost_reason(self, entry: Entry, held: Holding, now: float) -> str:
        if now >= held.valid_until:
            if not held.heartbeat:
                return "ttl expired (heartbeat off)"
            if now >= held.hold_until:
                return f"max_hold ({held.max_hold:g}s) reached"
            return "no renewal confirmed before the validity deadline"
        if held.state is LockState.SUSPECT and now >= self._give_up_at(entry, held):
            return f"renewals failing ({entry.failures} in a row) up to the validity deadline"
        return ""

    def _send(self, alias: str, items: list[_Work]) -> None:
        """One round trip: the renewals, earliest deadline first, each refreshing its index
        entry (on Redis Cluster the refresh follows in a round trip of its own:
        :func:`_renewals`). Never retried here: a failure makes the locks SUSPECT, and they are
        retried soon."""
        items.sort(key=lambda item: item[1].valid_until)
        timeout = min(entry.timeout for entry, _ in items)
        wait = replicas.replica_wait(timeout / 2)  # REPLICA_ACKS: right after the renewals
        sent = time.monotonic()
        try:
            found = renewal_client(alias, timeout)
            calls, refresh = _renewals(found, items)
            replies = send(found, [*calls, wait] if wait else calls, refresh)
            if wait:
                replicas.check_acked(wait, replies[len(calls)])
        except Exception as exc:  # noqa: BLE001 - any failure makes these locks SUSPECT
            replies = [exc] * len(items)
        lost: list[_Lost] = []
        renewed: dict[tuple[str, str], int] = defaultdict(int)
        with self._guard:
            self._stats.round_trips += 1
            for (entry, held), reply in zip(items, replies, strict=False):
                if self._entries.get(entry.lock_id) is not entry:
                    continue  # released (or lost) while the pipeline was in flight
                if isinstance(reply, Exception):
                    self._stats.renew_failed += 1
                    metrics.count("renew_failed", held.family, held.job_func)
                    entry.failures += 1
                    held.renewal_failed(reply)
                    # Retry soon, but do not hammer a server that just timed out.
                    retry_in = min(entry.interval / 2, max(0.02, timeout / 2))
                    entry.renew_due = time.monotonic() + retry_in
                elif reply == Outcome.OK:
                    held.confirm_renewed(sent)
                    entry.timeout = _socket_timeout(held.ttl)  # valid for its TTL now
                    entry.failures = 0
                    entry.renew_due = sent + entry.interval
                    renewed[(held.family, held.job_func)] += 1
                else:
                    reason = Outcome(reply).reason
                    del self._entries[entry.lock_id]
                    if held.mark_lost(reason):
                        self._stats.lost += 1
                        lost.append((held, reason))
            self._stats.renewed += sum(renewed.values())
        for (family, func), count in renewed.items():
            metrics.count("renewed", family, func, count)
        _announce(lost)
        if lost:
            self._unindex(alias, [held for held, _ in lost], timeout)

    def _unindex(self, alias: str, lost: list[Holding], timeout: float) -> None:
        """Remove the index entries of ``lost`` locks: the refresh sent with their renewals put
        them back (a force-release had removed them, or the lock expired), and they would count
        as active for up to a TTL. One round trip, only when a renewal finds a lock lost; best
        effort (an entry left expires by its score). Another holder's entry is not touched:
        the member names the owner."""
        prefix = conf.get().KEY_PREFIX
        calls = [
            index.remove_call(prefix, held.resource, held.owner, held.job_id, held.slot)
            for held in lost
        ]
        try:
            send(renewal_client(alias, timeout), calls)
        except REDIS_ERRORS as exc:
            logger.warning("lost locks' index entries not removed (%s); they expire", exc)


def _socket_timeout(valid_for: float) -> float:
    """The socket timeout (s) of the round trips renewing a lock valid for ``valid_for`` s:
    ``min(REDIS_TIMEOUT, valid_for / 5)``, rounded down to a power of two (few values: few
    clients, and pools)."""
    wanted = max(0.01, min(conf.get().REDIS_TIMEOUT, valid_for / 5))
    return float(2.0 ** math.floor(math.log2(wanted)))


def _renewals(found: Any, items: list[_Work]) -> tuple[list[Any], list[Any]]:
    """The RENEW calls of ``items`` on client ``found``, and the index refresh to send after
    them. On one server each RENEW writes its holding's index entry itself, and only if it
    renewed: a renewal that reaches Redis after the holder's release (under way meanwhile, or
    timed out on this side) never puts the released holding's entry back. On Redis Cluster the
    index lives on other nodes: a ``ZADD`` per family follows, and a late one may put an entry
    back, which then expires by its score."""
    prefix = conf.get().KEY_PREFIX
    calls: list[Any] = []
    apart: list[index.Entry] = []  # Redis Cluster: indexed by the refresh
    for _, held in items:
        entry = held.index_entry()
        index_keys, index_args = index.in_script(found, prefix, entry)
        calls.append((RENEW, [held.key, *index_keys], [held.token, held.ttl_ms, *index_args]))
        if not index_keys:
            apart.append(entry)
    return calls, index.add_calls(prefix, apart)


def _announce(lost: list[_Lost]) -> None:
    """Announce each lock the thread found lost (:meth:`Holding.announce_lost` logs what a
    callback or receiver raises). A ``sys.exit()`` in ``on_lost`` raises ``SystemExit``, which
    it lets through: logged here too, so that the other locks lost in the same batch are
    announced, and their index entries removed, all the same."""
    for held, reason in lost:
        try:
            held.announce_lost(reason)
        except BaseException:  # noqa: BLE001 - the thread serves every lock: log, go on
            logger.exception("announcing the loss of %s raised; the renewals go on", held.key)


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
