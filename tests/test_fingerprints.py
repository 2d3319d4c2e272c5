"""A job's fingerprint is the same in every worker process, whatever its arguments.

Found by trying the app in a new project: a duplicate delivery of a job whose arguments JSON
cannot encode (a set of strings, a plain object) failed with ``IdempotencyKeyMismatch`` in
another worker instead of replaying, because the fingerprint fell back to the arguments'
``repr``: a set's order follows the per-process hash seed, a default repr holds an address.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from rq.job import JobStatus

from django_joblock import IdempotencyRecord, fingerprint_of
from tests import jobs
from tests.harness import child_env
from tests.workers import DONE, ROOT, Workers, wait_status

pytestmark = pytest.mark.django_db(transaction=True)

TAGS = {"red", "green", "blue", "yellow", "black", "white", "pink", "grey"}
SEEDS = ("1", "2")


class SeededWorkers(Workers):
    """Workers whose processes hash with ``PYTHONHASHSEED=seed``."""

    def __init__(self, seed: str) -> None:
        super().__init__()
        self.seed = seed

    def env(self) -> dict[str, str]:
        return {**super().env(), "PYTHONHASHSEED": self.seed}


def _in_process(seed: str, code: str) -> str:
    env = dict(child_env(), PYTHONHASHSEED=seed)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _set_orders() -> set[str]:
    return {_in_process(seed, f"print(list({TAGS!r}))") for seed in SEEDS}


def test_json_values_keep_the_fingerprint_they_always_had():
    # Records written before this change must still match: plain JSON is hashed as before.
    value = {"order": 7, "amount": "1.00", "tags": ["a", "b"]}
    assert (
        fingerprint_of(value)
        == hashlib.sha256(b'{"amount":"1.00","order":7,"tags":["a","b"]}').hexdigest()
    )


@pytest.mark.slow
def test_sets_objects_bytes_and_odd_keys_fingerprint_alike_in_every_process():
    assert len(_set_orders()) == 2, "negative control: the two seeds order the set differently"
    code = (
        "import django; django.setup()\n"
        "from django_joblock import fingerprint_of\n"
        "from tests.jobs import Options\n"
        f"print(fingerprint_of({{'tags': {TAGS!r}, 'opts': Options(5), 'raw': b'\\x00x',"
        " 'pairs': {(1, 2): 'a', 3: 'b'}}))"
    )
    prints = {_in_process(seed, code) for seed in SEEDS}
    assert len(prints) == 1, prints
    assert fingerprint_of({"opts": jobs.Options(5)}) != fingerprint_of({"opts": jobs.Options(6)})
    assert fingerprint_of({"raw": b"ab"}) != fingerprint_of({"raw": "ab"})
    assert fingerprint_of({"s": {1, 2}}) != fingerprint_of({"s": [1, 2]})


@pytest.mark.slow
def test_a_duplicate_with_set_and_object_arguments_replays_in_another_worker(rconn):
    assert len(_set_orders()) == 2, "negative control: the two seeds order the set differently"
    results = []
    for seed in SEEDS:  # one delivery per worker process, each with its own hash seed
        crew = SeededWorkers(seed)
        try:
            job = jobs.tag_order.delay(1, set(TAGS), jobs.Options(5))
            crew.start("default", burst=True)
            assert wait_status(job, DONE, 60, crew) is JobStatus.FINISHED, crew.logs()
            job.refresh()
            results.append((job.meta["joblock"]["outcome"], job.return_value()))
        finally:
            crew.stop()
    expected = [*sorted(TAGS), "5"]
    assert results == [("ran", expected), ("replayed", expected)]
    assert int(rconn.get("test:effects:tags:1")) == 1, "the effect ran once"
    assert IdempotencyRecord.objects.get(key="tags:1").status == "succeeded"
