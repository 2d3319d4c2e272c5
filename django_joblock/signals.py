"""Django signals sent by django-joblock.

Lock signals are sent with ``sender=Lock`` and ``lock=<the Lock>``; receivers run in the thread
that noticed the event: ``lock_lost`` is usually sent from the renewal thread, so a receiver must
be quick and must not block on the lock itself.

- ``lock_acquired(lock, waited)``: the lock was taken; ``waited`` seconds spent waiting.
- ``lock_contended(lock, waited)``: the lock was busy for the whole allowed wait.
- ``lock_lost(lock, reason)``: expired, taken by another owner, renewals failed past the
  validity deadline, or ``max_hold`` reached.
- ``lock_released(lock, released, held_for)``: ``released`` is False when it was no longer ours.
- ``job_requeued(job, lock, delay)``: an RQ job was requeued because its lock was busy.
- ``duplicate_blocked(key, scope, record)``: an idempotency key was found already done."""

from __future__ import annotations

from django.dispatch import Signal

lock_acquired = Signal()
lock_contended = Signal()
lock_lost = Signal()
lock_released = Signal()
job_requeued = Signal()
duplicate_blocked = Signal()
