"""Test settings with the locks *and* django-rq's queues on Redis Sentinel.

``JOBLOCK_TEST_SENTINELS`` is ``host:port,host:port,...`` of the sentinels and
``JOBLOCK_TEST_MASTER`` the service name they monitor. The locks take django-redis'
``SentinelClient`` (cache alias ``sentinel``, ``REDIS_ALIAS``); the queues take django-rq's
``SENTINELS`` / ``MASTER_NAME``. Worker processes of tests/test_sentinel.py run with these.
"""

from __future__ import annotations

import os

from tests.procs.topologies import sentinel_cache, sentinel_queue
from tests.settings import *  # noqa: F403
from tests.settings import CACHES, JOBLOCK

SENTINELS = [
    (host, int(port))
    for host, port in (
        item.rsplit(":", 1) for item in os.environ["JOBLOCK_TEST_SENTINELS"].split(",")
    )
]
MASTER = os.environ["JOBLOCK_TEST_MASTER"]


CACHES = {**CACHES, "sentinel": sentinel_cache(SENTINELS, MASTER)}
RQ_QUEUES = {"default": sentinel_queue(SENTINELS, MASTER)}
JOBLOCK = {"REDIS_ALIAS": "sentinel", **JOBLOCK}  # a test may keep the locks elsewhere
