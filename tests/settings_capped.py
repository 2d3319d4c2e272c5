"""Test settings for a worker started by a test, with the lock cache's pool capped.

``JOBLOCK_TEST_MAX_CONNECTIONS`` (default 2) is the ``max_connections`` of the ``default``
cache, which the locks, django-rq's queues and RQ itself all use: a worker's pub/sub thread
keeps one connection, RQ's commands need another.
"""

from __future__ import annotations

import copy
import os

from tests.settings import *  # noqa: F403
from tests.settings import CACHES as _BASE_CACHES

CACHES = copy.deepcopy(_BASE_CACHES)
CACHES["default"]["OPTIONS"]["CONNECTION_POOL_KWARGS"] = {  # type: ignore[index]
    "max_connections": int(os.environ.get("JOBLOCK_TEST_MAX_CONNECTIONS", "2"))
}
