"""What ``@locked_job`` accepts besides its own options: RQ's, by name, checked at decoration
and at every ``.enqueue()``.

Found by trying the app in a new project: RQ's ``enqueue`` called with ``args=`` / ``kwargs=``
(as ``@locked_job`` calls it) drops every keyword it does not know without a word, so a typo
(``job_timout=1``) left the default timeout in force, and a job argument passed to
``.enqueue()`` beside ``kwargs=`` vanished; a ``job_timeout`` RQ cannot parse crashed
``manage.py check`` with RQ's own traceback.
"""

from __future__ import annotations

import math
import warnings

import pytest
from rq import Retry

from django_joblock import locked_job
from django_joblock.jobs.queues import get_queue

pytestmark = pytest.mark.django_db(transaction=True)


def test_rq_drops_unknown_keywords_beside_args_and_kwargs(rconn):
    """Negative control: what RQ does with them, which ``@locked_job`` must not let happen."""
    job = get_queue("default").enqueue(
        "tests.jobs.hold_resource", args=(1, "x", 0.0), kwargs={}, job_timout=1, count=5
    )
    assert job.timeout == 180 and job.kwargs == {}, "RQ kept them after all"


def test_an_unknown_rq_option_fails_at_decoration(scratch_registry):
    with pytest.raises(ValueError, match=r"typo_opt: job_timout is not an option of RQ's enqueue"):

        @locked_job("default", lock="t:{n}", job_timout=1)
        def typo_opt(n: int) -> int:
            return n


def test_job_arguments_given_as_rq_options_fail_at_enqueue(scratch_registry, rconn):
    @locked_job("default", lock="thing:{name}")
    def lock_only(name: str, count: int = 1) -> int:
        return count

    queue = get_queue("default")
    with pytest.raises(ValueError, match=r"lock_only.enqueue\(\): count is not an option"):
        lock_only.enqueue(kwargs={"name": "e1"}, count=5)
    with pytest.raises(ValueError, match=r"name is not an option.*\.delay\(\.\.\.\)"):
        lock_only.enqueue_call(name="e1")
    assert queue.count == 0, "nothing may be enqueued after a bad call"
    job = lock_only.enqueue(kwargs={"name": "e1", "count": 5}, result_ttl=60)
    assert job.kwargs == {"name": "e1", "count": 5}
    assert job.result_ttl == 60


def test_enqueue_takes_the_jobs_arguments_as_rqs_enqueue_does(scratch_registry, rconn):
    """An rq user's ``job.enqueue(1, "10")`` enqueues like ``.delay(1, "10")``; RQ's options
    ride among the keywords as with ``Queue.enqueue``, except a keyword the job takes itself;
    ``.enqueue_call(args, kwargs, **options)`` keeps them apart."""

    @locked_job("default", lock="thing:{name}")
    def lock_only(name: str, count: str = "1", description: str = "") -> str:
        return count

    queue = get_queue("default")
    delayed = lock_only.delay(1, "10")
    enqueued = lock_only.enqueue(1, "10")
    assert (enqueued.args, enqueued.kwargs) == (delayed.args, delayed.kwargs) == ((1, "10"), {})
    assert enqueued.meta["joblock"]["resource"] == "thing:1"
    with_options = lock_only.enqueue(2, count="3", job_timeout=30, description="mine")
    assert with_options.kwargs == {"count": "3", "description": "mine"}, "the job's keywords"
    assert with_options.timeout == 30, "RQ's option"
    called = lock_only.enqueue_call((3,), {"count": "4"}, job_timeout=40)
    assert (called.args, called.kwargs, called.timeout) == ((3,), {"count": "4"}, 40)
    before = queue.count
    with pytest.raises(TypeError, match="positional arguments cannot be used with args="):
        lock_only.enqueue(4, args=(5,))
    assert queue.count == before, "nothing enqueued"


def test_the_old_positional_spelling_of_enqueue_warns_and_still_works(scratch_registry, rconn):
    @locked_job("default", lock="thing:{count}")
    def lock_only(name: str, count: int = 1) -> int:
        return count

    with pytest.warns(DeprecationWarning, match=r"lock_only.enqueue\(args, kwargs\).*enqueue_call"):
        job = lock_only.enqueue(("e2",), {"count": 2}, job_timeout=50)
    assert (job.args, job.kwargs, job.timeout) == (("e2",), {"count": 2}, 50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tuple the job takes as its argument: no warning
        assert lock_only.enqueue(("a", "b", "c")).args == (("a", "b", "c"),)


# 10**12 s and '99999999999d' (regression, review): accepted, then every run failed in the
# worker with OverflowError from RQ's signal.alarm.
@pytest.mark.parametrize(
    "bad", ["abc", "1.5", 0, -5, True, math.inf, math.nan, [30], 10**12, "99999999999d"]
)
def test_a_bad_job_timeout_is_named_at_decoration_and_at_enqueue(scratch_registry, rconn, bad):
    with pytest.raises(ValueError, match=r"slow: job_timeout must be whole seconds"):

        @locked_job("default", lock="t:{n}", job_timeout=bad)
        def slow(n: int) -> None: ...

    @locked_job("default", lock="t:{n}")
    def fine(n: int) -> None: ...

    with pytest.raises(ValueError, match=r"fine.enqueue\(\): job_timeout must be"):
        fine.enqueue_call((1,), job_timeout=bad)
    assert get_queue("default").count == 0


def test_rq_timeout_forms_are_accepted(scratch_registry, rconn):
    @locked_job("default", lock="t:{n}", job_timeout="10m")
    def slow(n: int) -> None: ...

    assert slow.delay(1).timeout == 600
    assert slow.enqueue_call((2,), job_timeout=-1).timeout == -1
    assert slow.enqueue_call((3,), job_timeout=90).timeout == 90


def test_decorator_arguments_of_the_wrong_kind_are_named():
    with pytest.raises(ValueError, match="heartbeat must be True or False, got 'no'"):
        locked_job("default", lock="x", heartbeat="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_lost must be a callable"):
        locked_job("default", lock="x", on_lost="print")  # type: ignore[arg-type]

    def my_func(n: int) -> None: ...

    with pytest.raises(TypeError, match=r"takes the queue first.*'test_decorator_arguments"):
        locked_job(my_func)  # type: ignore[call-arg]


def test_a_call_that_does_not_fit_names_the_job(scratch_registry, rconn):
    @locked_job("default", lock="thing:{name}")
    def lock_only(name: str) -> None: ...

    with pytest.raises(TypeError, match=r"lock_only\(\): missing a required argument: 'name'"):
        lock_only.delay()  # type: ignore[call-arg]


def test_delay_reuses_the_queues_connection(rconn, settings):
    """django-rq builds a new client per ``get_queue()`` (a new pool; on ``SENTINELS`` a lookup
    of the primary too): every ``.delay()`` opened a connection, and on Sentinel queues it cost
    2-3x a URL queue's. The queue's client is now made once per name."""
    from tests import harness, jobs

    settings.RQ_QUEUES = {**settings.RQ_QUEUES, "default": {"URL": harness.redis_url()}}

    def connections_received() -> int:
        return int(rconn.info("stats")["total_connections_received"])

    import django_rq

    before = connections_received()
    for n in range(10):  # negative control: django-rq's own get_queue
        django_rq.get_queue("default").enqueue("tests.jobs.hold_resource", 100 + n, "n", 0.0)
    assert connections_received() - before >= 10, "django-rq reused a connection after all"
    before = connections_received()
    for n in range(30):
        jobs.hold_resource.delay(n, "reuse", 0.0)
    assert connections_received() - before <= 2
    assert get_queue("default").connection is get_queue("default").connection
    other_db = harness.redis_url().rsplit("/", 1)[0] + "/1"  # a settings change is seen
    settings.RQ_QUEUES = {**settings.RQ_QUEUES, "default": {"URL": other_db}}
    assert get_queue("default").connection.connection_pool.connection_kwargs["db"] == 1


@pytest.mark.parametrize(
    ("option", "bad", "expected"),
    [
        ("retry", 3, "retry must be an rq.Retry"),
        ("meta", ["x"], "meta must be a dict"),
        ("at_front", "yes", "at_front must be True or False"),
        ("result_ttl", 1.5, "result_ttl must be whole seconds"),
        ("failure_ttl", -5, "failure_ttl must be whole seconds"),
        ("result_ttl", math.inf, "result_ttl must be whole seconds"),
    ],
)
def test_rq_options_of_the_wrong_type_are_named_at_decoration_and_at_enqueue(
    scratch_registry, rconn, option, bad, expected
):
    """``retry=3`` was accepted, then raised from deep inside RQ at every ``.delay()``."""

    def sent(n: int) -> int:
        return n

    with pytest.raises(ValueError, match=rf"@locked_job .*sent: {expected}.*got"):
        locked_job("default", lock="x:{n}", **{option: bad})(sent)
    sent = locked_job("default", lock="x:{n}")(sent)

    with pytest.raises(ValueError, match=rf"sent.enqueue\(\): {expected}"):
        sent.enqueue_call((1,), **{option: bad})
    assert get_queue("default").count == 0, "nothing enqueued"
    job = sent.enqueue_call((1,), retry=Retry(max=2), meta={"a": 1}, result_ttl=-1)
    assert job.retries_left == 2 and job.meta["a"] == 1


def test_meta_none_is_rqs_not_set_at_decoration_and_at_enqueue(scratch_registry, rconn):
    """Review bug: ``meta=None`` passed the option check (None is RQ's "not set") and then every
    enqueue raised ``TypeError: 'NoneType' object is not a mapping``."""

    def sent(n: int) -> int:
        return n

    decorated = locked_job("default", lock="x:{n}", meta=None)(sent)
    job = decorated.delay(1)
    assert job.meta["joblock"]["resource"] == "x:1"
    job = decorated.enqueue_call((2,), meta=None)
    assert job.meta["joblock"]["resource"] == "x:2" and set(job.meta) == {"joblock"}


def test_args_none_beside_kwargs_is_rqs_no_positional_arguments(scratch_registry, rconn):
    """Review bug: RQ's ``enqueue(f, args=None, kwargs={...})`` takes ``None`` as no positional
    arguments (as ``kwargs=None``); ``.enqueue(args=None, kwargs={...})`` raised
    ``TypeError: 'NoneType' object is not iterable`` instead."""

    @locked_job("default", lock="thing:{name}")
    def lock_only(name: str = "x", count: str = "1") -> str:
        return count

    plain = get_queue("default").enqueue("os.getpid", args=None, kwargs={})
    assert plain.args == (), "negative control: what RQ does"
    job = lock_only.enqueue(args=None, kwargs={"name": "n"}, job_timeout=30)
    assert (job.args, job.kwargs, job.timeout) == ((), {"name": "n"}, 30)
    assert job.meta["joblock"]["resource"] == "thing:n"
