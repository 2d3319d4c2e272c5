"""From "it ran twice" to the cause: :func:`diagnose` takes an RQ job id, an idempotency key
or a resource and returns the story (the key's deliveries, the resource's holder and operator
releases, the family's recent losses) and the seven debugging steps of docs/operations.md,
each with its evidence and a verdict (``ok``, ``problem``, ``info``, ``unknown``). Read-only;
every read is bounded (one key's history, one resource, one family's metrics)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from django.db.models import Q
from rq.exceptions import NoSuchJobError
from rq.job import Job

from .. import conf, metrics, outbox
from ..backend import REDIS_ERRORS
from ..choices import OutboxStatus
from ..exceptions import LockBackendUnavailable
from ..jobs import history
from ..jobs.decorator import idempotency_scopes, registry
from ..jobs.history import Delivery, summary
from ..locks.info import lock_info
from ..locks.keys import family, validate_resource
from ..models import IdempotencyRecord, LockAudit, OutboxMessage
from .health import known_queues, queue_connections, record_deliveries

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
        claimed = IdempotencyRecord.objects.filter(scope=scope, key=key)
        resource = next(iter(claimed.values_list("lock_resource", flat=True)[:1]), "")
    if key:
        runs = record_deliveries(scope, key, resource)
    else:  # the resource's own runs, from its family's history
        recent = history.read(queue_connections(), family(resource))
        runs = [run for run in recent if run.resource == resource]
    found.deliveries = [asdict(run) for run in runs]
    found.resource = resource or next((r.resource for r in runs if r.resource), "")
    if runs:
        found.story += [f"deliveries of {key or resource!r}: {summary(runs)}", *map(_line, runs)]
    if found.resource:
        found.story += _resource_story(found.resource)
    # The outbox messages the key's runs recorded (by RQ job id), or under the key itself.
    by_key = Q(rq_job_id__in={run.job_id for run in runs}) | Q(key=key)
    sent = list(OutboxMessage.objects.filter(by_key).order_by("pk")[:20]) if key else []
    found.story += [f"  outbox: {outbox.describe(message)}" for message in sent]
    found.steps = _steps(found, runs, sent)
    return found


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
    # Among the known scopes only (the jobs', and idempotent()'s default ""): the (scope, key)
    # index answers that; a key alone would scan the whole table.
    known = idempotency_scopes()
    found = IdempotencyRecord.objects.filter(scope__in=known, key=key)
    scopes = sorted(set(found.values_list("scope", flat=True))) or sorted(known - {""})
    if len(scopes) != 1:
        why = f"give its job's dotted name with --scope (candidates: {', '.join(scopes) or 'none'})"
        raise NotFound(f"key {key!r}: {why}")
    return scopes[0]


def _line(run: Delivery) -> str:
    started = time.strftime("%H:%M:%S", time.gmtime(run.started)) if run.started else "-"
    took = f" took {run.took:g}s" if run.took is not None else ""
    twin = f" (duplicate in flight beside {run.duplicate_of})" if run.duplicate_of else ""
    where = f"{run.worker or '-'} {run.host}:{run.pid}"
    return f"  {started} job {run.job_id} on {where}: {run.outcome}{took}{twin}"


def _resource_story(resource: str) -> list[str]:
    try:
        info = lock_info(resource)
        now = "free now"
        if info is not None:
            now = f"held now by {info.host}:{info.pid} (job {info.job_id or '-'}), fence "
            now += f"{info.fence}, {info.expires_in:.1f}s of TTL left"
    except LockBackendUnavailable as exc:
        now = f"Redis unavailable ({exc})"
    return [f"resource {resource!r}: {now}"] + [
        f"  {audit.created_at:%Y-%m-%d %H:%M:%S} operator {audit.action} by {audit.actor}: "
        f"{audit.outcome} ({audit.reason})"
        for audit in LockAudit.objects.filter(resource=resource)[:5]
    ]


QUESTIONS = (
    "Did the queue deliver it twice?",
    "Do conflicting runs build the same lock key?",
    "TTL and heartbeat against real durations",
    "Did a lock expire mid-run?",
    "Do release and renew verify the owner?",
    "Are side effects guarded by the key?",
    "Is the ACK (job_timeout) in line with durations?",
)


def _steps(found: Diagnosis, runs: list[Delivery], sent: list[Any]) -> list[Step]:
    """The answers to :data:`QUESTIONS`, in order."""
    steps: list[Step] = []

    def answer(verdict: str, text: str) -> None:
        steps.append(Step(len(steps) + 1, QUESTIONS[len(steps)], verdict, text))

    ran = [run.job_id for run in runs if run.outcome == "ran"]
    jobs = list(dict.fromkeys(run.job_id for run in runs))
    replayed = sorted({run.job_id for run in runs if run.outcome == "replayed"})
    # A resource's runs are of several keys: one key delivered (or run) twice is what counts.
    per_key: dict[str, list[Delivery]] = {}
    for run in runs:
        per_key.setdefault(run.key, []).append(run)
    twice = {
        key: ids
        for key, each in per_key.items()
        if key and len(ids := [run.job_id for run in each if run.outcome == "ran"]) > 1
    }
    if not runs:
        answer(UNKNOWN, "no delivery history for it")
    elif not found.key:
        again = [key for key, each in per_key.items() if key and len(each) > 1]
        text = f"{len(jobs)} deliveries of {len(per_key)} key(s)"
        text += f"; delivered again: {', '.join(again)}" if again else ""
        answer(INFO if again else OK, text)
    elif len(jobs) > 1:
        text = f"yes: {len(jobs)} deliveries (RQ jobs {', '.join(jobs)}); "
        text += f"{', '.join(sorted(set(ran))) or 'none'} ran, "
        answer(INFO, text + f"{', '.join(replayed) or 'none'} replayed the stored result")
    else:
        answer(OK, f"no: one delivery (job {jobs[0]})")
    resources = sorted({run.resource for run in runs})
    if not runs:
        answer(UNKNOWN, "no runs to compare")
    elif resources == [""]:
        answer(INFO, "no lock: the idempotency record alone serializes the runs")
    elif len(resources) == 1:
        answer(OK, f"every run locked {resources[0]!r}")
    else:
        answer(PROBLEM, f"runs of one key locked different resources: {', '.join(resources)}")
    spec = registry.get(found.scope or (runs[0].func if runs else ""))
    longest = max((run.took for run in runs if run.took is not None), default=None)
    ttl = conf.get().LOCK_TTL if spec is None or spec.ttl is None else spec.ttl
    if longest is None or spec is None:
        answer(UNKNOWN, "no durations recorded")
    elif spec.lock is None:
        answer(INFO, f"longest run {longest:g}s; no lock, so no TTL to outlive")
    elif not spec.heartbeat and longest >= ttl:
        text = f"a run took {longest:g}s, longer than the TTL {ttl:g}s, with heartbeat off"
        answer(PROBLEM, text)
    else:
        beat = "renewed every TTL/3" if spec.heartbeat else "heartbeat off"
        answer(OK, f"longest run {longest:g}s; TTL {ttl:g}s, {beat}")
    aborted = ", ".join(run.job_id for run in runs if run.outcome == "aborted")
    fam = family(found.resource) if found.resource else ""
    lost = metrics.window(conf.get().ALERTS["WINDOW"]).total("lost", fam) if fam else 0
    verdict, text = OK, "no run of this key lost its lock"
    if aborted:
        verdict, text = INFO, f"lost mid-run and aborted (rolled back): jobs {aborted}"
    text += f"; {lost} lock(s) of family {fam!r} lost in the last alert window" if lost else ""
    answer(verdict, text)
    atomic = "always: the release and renew scripts compare the owner token atomically"
    answer(OK, f"{atomic}; operator releases are in the story above")
    pending = [message.key for message in sent if message.status != OutboxStatus.DELIVERED]
    text = f"the idempotency record let one run commit ({ran[0] if ran else 'none yet'})"
    if sent:
        text += f"; {len(sent)} effect(s) outside the database went through the outbox"
        text += f", not delivered yet: {', '.join(pending)}" if pending else ", all delivered"
    else:
        text += "; effects outside the database (e-mail, APIs) need send_after_commit"
    if twice:
        shown = "; ".join(f"{key!r} by {', '.join(ids)}" for key, ids in twice.items())
        answer(PROBLEM, f"runs committed one key's effect more than once: {shown}")
    elif found.key:
        answer(INFO if pending else OK, text)
    else:
        answer(UNKNOWN, "no idempotency key: only the lock and the fence guard it")
    ratio = conf.get().ALERTS["TIMEOUT_RATIO"]
    took = [(run.job_id, run.took, run.timeout) for run in runs if run.took is not None]
    near = [job for job, ran_for, timeout in took if timeout and ran_for >= ratio * timeout]
    if near:
        answer(PROBLEM, f"runs took {ratio:.0%}+ of their job_timeout: {', '.join(near)}")
    elif runs:
        answer(OK, "every run ended well within its RQ job_timeout")
    else:
        answer(UNKNOWN, "no runs")
    return steps


def render(found: Diagnosis) -> str:
    lines = [f"joblock doctor: {found.target}"]
    if found.scope:
        lines.append(f"scope {found.scope}, key {found.key!r}")
    lines += ["", "Story:"] + (found.story or ["  nothing recorded"]) + ["", "Steps:"]
    lines += [f"  {s.number}. {s.question} [{s.verdict}] {s.evidence}" for s in found.steps]
    return "\n".join(lines)
