"""Test settings with the locks on Redis Cluster and the queues on the ordinary test Redis.

The locks, fences, active-lock index and metrics go to the cluster whose nodes
``JOBLOCK_TEST_CLUSTER_NODES`` names (``JOBLOCK["REDIS_CLIENT"]`` = ``tests.cluster_client.make``);
django-rq's queues stay on the test Redis (RQ does not run on Cluster). Worker processes of
tests/test_cluster.py run with these settings.
"""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import JOBLOCK, REDIS_URL

JOBLOCK = {**JOBLOCK, "REDIS_CLIENT": "tests.cluster_client.make"}
RQ_QUEUES = {"default": {"URL": REDIS_URL}, "other": {"URL": REDIS_URL}}
