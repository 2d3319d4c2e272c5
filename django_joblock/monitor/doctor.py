"""From "it ran twice" to the cause: the design article's debugging steps, walked with evidence.

:func:`diagnose` takes an RQ job id, an idempotency key or a resource and returns the story
(the key's deliveries, the resource's holder and operator releases, the family's recent
losses) and the article's seven steps, each with its evidence and a verdict (``ok``,
``problem``, ``info``, ``unknown``): 1. was it delivered twice? 2. do the runs build the same
lock key? 3. TTL and heartbeat against the runs' durations; 4. did a lock expire mid-run?
5. do release and renew verify the owner? 6. are the side effects guarded by the key (and did
those outside the database go through the outbox, delivered)? 7. is RQ's ``job_timeout`` (the
queue's ACK) in line with the durations?

Read-only; every read is bounded (one key's history, one resource, one family's metrics).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rq.exceptions import NoSuchJobError
from rq.job import Job

from .. import conf, metrics, outbox
from ..backend import REDIS_ERRORS
from ..choices import OutboxStatus
from ..exceptions import LockBackendUnavailable
from ..jobs.decorator import registry
from ..jobs.history import Delivery, summary
from ..locks.info import lock_info
from ..locks.keys import family, validate_resource
from .health import known_queues, record_deliveries

OK, PROBLEM, INFO, UNKNOWN = "ok", "problem", "info", "unknown"


@dataclass
class Step:
    number: int
    question: str
    verdict: str
    evidence: str


@dataclass
class Diagnosis:
    target: str
    scope: str = ""
    key: str = ""
    resource: str = ""
    story: list[str] = field(default_factory=list)
    deliveries: list[dict[str, Any]] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NotFound(LookupError):
    """Nothing is known of the target (the message says what was looked for)."""


def diagnose(*, job_id: str = "", key: str = "", scope: str = "", resource: str = "") -> Diagnosis:
    """The diagnosis of one RQ job, idempotency key (``scope``: its job's dotted name, needed
    when several jobs use the key) or resource. Raises :class:`NotFound`."""
    if job_id:
        scope, key, resource = _from_job(job_id)
        found = Diagnosis(f"job {job_id}")
    elif key:
        scope = scope or _scope_of(key)
        found = Diagnosis(f"key {key!r}")
    else:
        found = Diagnosis(f"resource {validate_resource(resource)!r}")
    found.scope, found.key = scope, key
    if key and not resource:  # the resource the key's record was claimed under, if any
        from ..models import IdempotencyRecord

        claimed = IdempotencyRecord.objects.filter(scope=scope, key=key)
        resource = next(iter(claimed.values_list("lock_resource", flat=True)[:1]), "")
    runs = record_deliveries(scope, key, resource) if key else []
    found.deliveries = [asdict(run) for run in runs]
    found.resource = resource or next((r.resource for r in runs if r.resource), "")
    if runs:
        found.story.append(f"deliveries of {key!r}: {summary(runs)}")
        found.story += [_line(run) for run in runs]
    if found.resource:
        found.story += _resource_story(found.resource)
    sent = _outbox_of(runs, key)
    found.story += [f"  outbox: {outbox.describe(message)}" for message in sent]
    found.steps = _steps(found, runs, sent)
    return found


def _outbox_of(runs: list[Delivery], key: str) -> list[Any]:
    """The outbox messages the key's runs recorded (by RQ job id), or under the key itself."""
    from django.db.models import Q

    from ..models import OutboxMessage

    if not runs and not key:
        return []
    jobs = {run.job_id for run in runs}
    return list(
        OutboxMessage.objects.filter(Q(rq_job_id__in=jobs) | Q(key=key)).order_by("pk")[:20]
    )


def _from_job(job_id: str) -> tuple[str, str, str]:
    for queue in known_queues().values():
        try:
            job = Job.fetch(job_id, connection=queue.connection)
        except (NoSuchJobError, *REDIS_ERRORS):
            continue
        spec = registry.get(job.func_name or "")
        if spec is None:
            raise NotFound(f"job {job_id} runs {job.func_name}, which is not a @locked_job")
        arguments = spec.bind(tuple(job.args), dict(job.kwargs))
        return spec.scope, spec.key(arguments) or "", spec.resource(arguments) or ""
    raise NotFound(f"no RQ job {job_id} on any known queue")


def _scope_of(key: str) -> str:
    from ..models import IdempotencyRecord

    scopes = sorted(set(IdempotencyRecord.objects.filter(key=key).values_list("scope", flat=True)))
    scopes = scopes or [spec.scope for spec in registry.values() if spec.idempotency_key]
    if len(scopes) != 1:
        raise NotFound(
            f"key {key!r}: give its job's dotted name with --scope (candidates: "
            f"{', '.join(scopes) or 'none'})"
        )
    return scopes[0]


def _line(run: Delivery) -> str:
    started = time.strftime("%H:%M:%S", time.gmtime(run.started)) if run.started else "-"
    took = f" took {run.took:g}s" if run.took is not None else ""
    twin = f" (duplicate in flight beside {run.duplicate_of})" if run.duplicate_of else ""
    where = f"{run.worker or '-'} {run.host}:{run.pid}"
    return f"  {started} job {run.job_id} on {where}: {run.outcome}{took}{twin}"


def _resource_story(resource: str) -> list[str]:
    from ..models import LockAudit

    try:
        info = lock_info(resource)
    except LockBackendUnavailable as exc:
        lines = [f"resource {resource!r}: Redis unavailable ({exc})"]
    else:
        lines = [
            f"resource {resource!r}: free now"
            if info is None
            else f"resource {resource!r}: held now by {info.host}:{info.pid} (job "
            f"{info.job_id or '-'}), fence {info.fence}, {info.expires_in:.1f}s of TTL left"
        ]
    for audit in LockAudit.objects.filter(resource=resource)[:5]:
        lines.append(
            f"  {audit.created_at:%Y-%m-%d %H:%M:%S} operator {audit.action} by {audit.actor}: "
            f"{audit.outcome} ({audit.reason})"
        )
    return lines


def _steps(found: Diagnosis, runs: list[Delivery], sent: list[Any]) -> list[Step]:
    steps: list[Step] = []

    def step(question: str, verdict: str, text: str) -> None:
        steps.append(Step(len(steps) + 1, question, verdict, text))

    ran = [run for run in runs if run.outcome == "ran"]
    jobs = list(dict.fromkeys(run.job_id for run in runs))
    spec = registry.get(found.scope)
    if not found.key:
        verdict, text = UNKNOWN, "no idempotency key"
    elif not runs:
        verdict, text = UNKNOWN, "no delivery history for it"
    elif len(jobs) > 1:
        replayed = sorted({run.job_id for run in runs if run.outcome == "replayed"})
        verdict = INFO
        text = (
            f"yes: {len(jobs)} deliveries (RQ jobs {', '.join(jobs)}); "
            f"{', '.join(sorted({r.job_id for r in ran})) or 'none'} ran, "
            f"{', '.join(replayed) or 'none'} replayed the stored result"
        )
    else:
        verdict, text = OK, f"no: one delivery (job {jobs[0]})"
    step("Did the queue deliver it twice?", verdict, text)
    resources = sorted({run.resource for run in runs})
    if not runs:
        verdict, text = UNKNOWN, "no runs to compare"
    elif resources == [""]:
        verdict, text = INFO, "no lock: the idempotency record alone serializes the runs"
    elif len(resources) == 1:
        verdict, text = OK, f"every run locked {resources[0]!r}"
    else:
        verdict = PROBLEM
        text = f"runs of one key locked different resources: {', '.join(resources)}"
    step("Do conflicting runs build the same lock key?", verdict, text)
    longest = max((run.took for run in runs if run.took is not None), default=None)
    if longest is None or spec is None:
        verdict, text = UNKNOWN, "no durations recorded"
    elif spec.lock is None:
        verdict, text = INFO, f"longest run {longest:g}s; no lock, so no TTL to outlive"
    else:
        ttl = conf.get().LOCK_TTL if spec.ttl is None else spec.ttl
        if not spec.heartbeat and longest >= ttl:
            verdict = PROBLEM
            text = f"a run took {longest:g}s, longer than the TTL {ttl:g}s, with heartbeat off"
        else:
            beat = "renewed every TTL/3" if spec.heartbeat else "heartbeat off"
            verdict, text = OK, f"longest run {longest:g}s; TTL {ttl:g}s, {beat}"
    step("TTL and heartbeat against real durations", verdict, text)
    aborted = [run.job_id for run in runs if run.outcome == "aborted"]
    fam = family(found.resource) if found.resource else ""
    lost = metrics.window(conf.get().ALERTS["WINDOW"]).total("lost", fam) if fam else 0
    if aborted:
        verdict = INFO
        text = f"lost mid-run and aborted (rolled back): jobs {', '.join(aborted)}"
    else:
        verdict, text = OK, "no run of this key lost its lock"
    if lost:
        text += f"; {lost} lock(s) of family {fam!r} lost in the last alert window"
    step("Did a lock expire mid-run?", verdict, text)
    step(
        "Do release and renew verify the owner?",
        OK,
        "always: the release and renew scripts compare the owner token atomically; "
        "operator releases are in the story above",
    )
    if len(ran) > 1:
        verdict = PROBLEM
        text = f"{len(ran)} runs committed the effect: {', '.join(r.job_id for r in ran)}"
    elif found.key:
        pending = [message.key for message in sent if message.status != OutboxStatus.DELIVERED]
        verdict = INFO if pending else OK
        text = f"the idempotency record let one run commit ({ran[0].job_id if ran else 'none yet'})"
        if sent:
            text += f"; {len(sent)} effect(s) outside the database went through the outbox"
            text += f", not delivered yet: {', '.join(pending)}" if pending else ", all delivered"
        else:
            text += "; effects outside the database (e-mail, APIs) need send_after_commit"
    else:
        verdict, text = UNKNOWN, "no idempotency key: only the lock and the fence guard it"
    step("Are side effects guarded by the key?", verdict, text)
    ratio = conf.get().ALERTS["TIMEOUT_RATIO"]
    near = [
        run.job_id
        for run in runs
        if run.timeout and run.took is not None and run.took >= ratio * run.timeout
    ]
    if near:
        verdict = PROBLEM
        text = f"runs took {ratio:.0%}+ of their job_timeout: {', '.join(near)}"
    elif runs:
        verdict, text = OK, "every run ended well within its RQ job_timeout"
    else:
        verdict, text = UNKNOWN, "no runs"
    step("Is the ACK (job_timeout) in line with durations?", verdict, text)
    return steps


def render(found: Diagnosis) -> str:
    """The diagnosis as text."""
    lines = [f"joblock doctor: {found.target}"]
    if found.scope:
        lines.append(f"scope {found.scope}, key {found.key!r}")
    lines += ["", "Story:"] + (found.story or ["  nothing recorded"]) + ["", "Steps:"]
    for step in found.steps:
        lines.append(f"  {step.number}. {step.question} [{step.verdict}] {step.evidence}")
    return "\n".join(lines)
