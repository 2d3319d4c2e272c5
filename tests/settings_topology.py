"""Test settings with locks and queues apart, as many deployments run them.

``JOBLOCK_TEST_LOCK_URL`` is the Redis of the locks (the ``default`` django-redis cache) and
``JOBLOCK_TEST_QUEUE_URL`` the Redis of django-rq's queues: another database of the same
server, or another server. Worker processes of the topology tests run with these settings.
"""

from __future__ import annotations

import os

from tests.settings import *  # noqa: F403
from tests.settings import CACHES, _cache

LOCK_URL = os.environ["JOBLOCK_TEST_LOCK_URL"]
QUEUE_URL = os.environ["JOBLOCK_TEST_QUEUE_URL"]

CACHES = {**CACHES, "default": _cache(LOCK_URL)}
RQ_QUEUES = {"default": {"URL": QUEUE_URL}, "other": {"URL": QUEUE_URL}}
