"""Removing what django-joblock wrote to Redis, for an uninstall (``joblock_purge --redis``):
every key under ``JOBLOCK["KEY_PREFIX"] + ":"`` (the index, families and metric totals never
expire), on the lock Redis and every known queue's, each server and database once. The one
keyspace walk of the package (``SCAN MATCH``, never ``KEYS``), an operator's one-off; keys
outside the prefix (RQ's, the Django cache's) are never touched. ``P:project`` names the project
that owns the prefix (:func:`other_project`): a purge, and ``check --deploy``, see another."""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from .. import conf
from ..backend import close, connection, dedicated, text
from ..jobs.queues import server_of
from ..locks.index import active_counts
from ..logs import logger
from .health import queue_connections

BATCH = 500


@dataclass
class Purge:
    """What a purge found (and removed unless it was a dry run), by kind of key."""

    kinds: Counter[str] = field(default_factory=Counter)
    removed: int = 0


def _kind(rest: str) -> str:
    """The kind of the key ``<prefix>:<rest>``."""
    if rest.startswith("{metrics}"):
        return "metrics"
    if rest.startswith("{"):  # lock, fence, queue, tickets, wake, released (an operator's note)
        return rest.partition("}:")[2].split(":", 1)[0]
    return rest.split(":", 1)[0]  # active (the index), families


def project_id() -> str:
    """This project's id on the locks' Redis: an irreversible hash of its ``SECRET_KEY``."""
    return hashlib.sha256(f"joblock-project:{settings.SECRET_KEY}".encode()).hexdigest()[:12]


def other_project(client: Any, *, claim: bool = True) -> str | None:
    """With ``claim``, claim ``KEY_PREFIX`` on ``client``'s Redis for this project (``P:project``,
    set once, no expiry: it lives with the keys under the prefix). Returns the id of another
    project that claimed it (sharing its locks, metrics and purge with this one), else None."""
    key = f"{conf.get().KEY_PREFIX}:project"
    if claim:
        client.set(key, project_id(), nx=True)
    found = client.get(key)
    return None if found is None or text(found) == project_id() else text(found)


def claim_key_prefix(**kwargs: Any) -> None:
    """Claim ``KEY_PREFIX`` on the locks' Redis for this project (``post_migrate``, so that
    ``check --deploy``'s W016 reads a claim and writes nothing). Best effort: a Redis that
    does not answer within 2 s is logged, and ``migrate`` goes on."""
    client = None
    try:
        client = dedicated(connection(conf.get().REDIS_ALIAS), 2.0)
        other_project(client, claim=True)
    except Exception as exc:  # noqa: BLE001 - the claim is advisory; migrate must not fail
        logger.warning("django_joblock: KEY_PREFIX not claimed on the locks' Redis: %s", exc)
    finally:
        if client is not None:
            close(client)


def held_locks() -> int:
    return sum(active_counts().values())


def purge_redis(*, dry_run: bool = False) -> Purge:
    """Find (and unless ``dry_run``, ``UNLINK``, ``BATCH`` at a time) the prefix's keys."""
    prefix = conf.get().KEY_PREFIX
    clients: dict[Any, Any] = {}
    for each in [connection(conf.get().REDIS_ALIAS), *queue_connections()]:
        clients.setdefault(server_of(each), each)  # each server and database once
    result = Purge()
    for each in clients.values():
        keys = map(text, each.scan_iter(match=f"{prefix}:*", count=1000))
        while batch := list(itertools.islice(keys, BATCH)):
            result.kinds.update(_kind(key[len(prefix) + 1 :]) for key in batch)
            if not dry_run:
                result.removed += int(each.unlink(*batch))
    return result
