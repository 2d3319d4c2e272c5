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
from ..idempotency.store import cut_job_id
from ..jobs import history
from ..jobs.decorator import idempotency_scopes, registry
from ..jobs.history import Delivery, summary
from ..locks import index
from ..locks.info import LockInfo, lock_holders, lock_info
from ..locks.keys import MAX_LIMIT, family, validate_resource
from ..models import IdempotencyRecord, LockAudit, OutboxMessage
from .health import known_queues, queue_connections, record_deliveries

INDEX_READ = 1000  # active-lock index entries of a resource's family the doctor reads
OK = "ok"
PROBLEM = "problem"
INFO = "info"
UNKNOWN = "unknown"


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
    found.scope = scope
    found.key = key
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
        found.story.append(f"deliveries of {key or resource!r}: {summary(runs)}")
        found.story.extend(_line(run) for run in runs)
    if found.resource:
        found.story.extend(_resource_story(found.resource))
    # The outbox messages the key's runs recorded (by RQ job id), or under the key itself.
    by_key = Q(rq_job_id__in={cut_job_id(OutboxMessage, run.job_id) for run in runs}) | Q(key=key)
    sent = list(OutboxMessage.objects.filter(by_key).order_by("pk")[:20]) if key else []
    found.story.extend(f"  outbox: {outbox.describe(message)}" for message in sent)
    found.steps = _steps(found, runs, sent)
    return found


def _from_job(job_id: str) -> tuple[str, str, str]:
    """The (scope, key, resource) of RQ job ``job_id``: from the job, or once RQ has expired
    it (after its ``result_ttl``), or when its arguments no longer fit the function (enqueued
    before a change of its signature), from the idempotency record its run left."""
    missing = f"no RQ job {job_id} on any known queue (RQ keeps a finished job for its result_ttl)"
    for queue in known_queues().values():
        try:
            job = Job.fetch(job_id, connection=queue.connection)
        except (NoSuchJobError, *REDIS_ERRORS):
            continue
        spec = registry.get(job.func_name or "")
        if spec is None:
            raise NotFound(f"job {job_id} runs {job.func_name}, which is not a @locked_job")
        try:
            arguments = spec.bind(tuple(job.args), dict(job.kwargs))
            return spec.scope, spec.key(arguments) or "", spec.resource(arguments) or ""
        except (TypeError, ValueError) as exc:  # bind() and the templates name what failed
            missing = f"job {job_id}'s arguments do not fit {spec.name} ({exc})"
            break
    # A full scan of the records, for one diagnosis: no index serves rq_job_id alone.
    stored = cut_job_id(IdempotencyRecord, job_id)
    recorded = IdempotencyRecord.objects.filter(rq_job_id=stored).order_by("-pk").first()
    if recorded is not None:
        return recorded.scope, recorded.key, recorded.lock_resource
    raise NotFound(f"{missing}, and no idempotency record of it: look it up with --resource")


def _scope_of(key: str) -> str:
    # Among the known scopes only (the jobs', and idempotent()'s default ""): the (scope, key)
    # index answers that; a key alone would scan the whole table.
    known = idempotency_scopes()
    found = IdempotencyRecord.objects.filter(scope__in=known, key=key)
    scopes = sorted(set(found.values_list("scope", flat=True))) or sorted(known - {""})
    if len(scopes) != 1:
        raise NotFound(
            f"key {key!r}: give its job's dotted name with --scope "
            f"(candidates: {', '.join(scopes) or 'none'})"
        )
    return scopes[0]


def _line(run: Delivery) -> str:
    started = time.strftime("%H:%M:%S", time.gmtime(run.started)) if run.started else "-"
    took = f" took {run.took:g}s" if run.took is not None else ""
    twin = f" (duplicate in flight beside {run.duplicate_of})" if run.duplicate_of else ""
    where = f"{run.worker or '-'} {run.host}:{run.pid}"
    return f"  {started} job {run.job_id} on {where}: {run.outcome}{took}{twin}"


def _resource_story(resource: str) -> list[str]:
    """The resource's holders now, then its latest operator actions (five at most)."""
    return _holders_story(resource) + [
        f"  {audit.created_at:%Y-%m-%d %H:%M:%S} operator {audit.action} by {audit.actor}: "
        f"{audit.outcome} ({audit.reason})"
        for audit in LockAudit.objects.filter(resource=resource)[:5]
    ]


def _holders_story(resource: str) -> list[str]:
    """Who holds the resource's lock now (each holder of a lock with a limit, by slot), or that
    it is free (or that Redis did not answer)."""
    try:
        holders = _holders_now(resource)
    except (LockBackendUnavailable, *REDIS_ERRORS) as exc:
        return [f"resource {resource!r}: Redis unavailable ({exc})"]
    if not holders:
        return [f"resource {resource!r}: free now"]
    if len(holders) == 1 and holders[0].limit == 1:
        return [f"resource {resource!r}: held now by {_holder(holders[0])}"]
    used = f"{len(holders)} of its {holders[0].limit} slots held now"
    return [f"resource {resource!r}: {used}"] + [
        f"  slot {info.slot}: held by {_holder(info)}" for info in holders
    ]


def _holders_now(resource: str) -> list[LockInfo]:
    """The holders of the resource's lock now, lowest slot first. The limit of a lock with
    several holders is in each slot's hash (slot 0's is read first); slot 0 may be free while
    others are held, so the highest slot the active-lock index lists for the resource counts
    too (its :data:`INDEX_READ` soonest-to-expire entries of the family: read-only, bounded)."""
    first = lock_info(resource)
    entries = index.members([family(resource)], INDEX_READ)
    slots = [entry.slot + 1 for entry in entries if entry.resource == resource]
    limit = min(max([first.limit if first else 1, *slots]), MAX_LIMIT)
    if limit == 1:
        return [first] if first else []
    return lock_holders(resource, limit=limit)


def _holder(info: LockInfo) -> str:
    return (
        f"{info.host}:{info.pid} (job {info.job_id or '-'}), fence "
        f"{info.fence}, {info.expires_in:.1f}s of TTL left"
    )


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
    answers = (
        _delivered_twice(found, runs),
        _same_lock_key(runs),
        _ttl_and_heartbeat(found, runs),
        _lock_lost(found, runs),
        _owner_verified(),
        _effects_guarded(found, runs, sent),
        _ack_in_line(runs),
    )
    return [
        Step(number, QUESTIONS[number - 1], verdict, evidence)
        for number, (verdict, evidence) in enumerate(answers, start=1)
    ]


def _ran(runs: list[Delivery]) -> list[str]:
    """The RQ job ids of the runs whose function ran and committed (outcome ``ran``)."""
    return [run.job_id for run in runs if run.outcome == "ran"]


def _runs_by_key(runs: list[Delivery]) -> dict[str, list[Delivery]]:
    """The runs grouped by idempotency key, keys in order of first delivery."""
    by_key: dict[str, list[Delivery]] = {}
    for run in runs:
        by_key.setdefault(run.key, []).append(run)
    return by_key


def _delivered_twice(found: Diagnosis, runs: list[Delivery]) -> tuple[str, str]:
    """Step 1: the deliveries. A resource's runs are of several keys: one key delivered
    again is what counts."""
    if not runs:
        return UNKNOWN, "no delivery history for it"
    jobs = list(dict.fromkeys(run.job_id for run in runs))
    if not found.key:
        by_key = _runs_by_key(runs)
        again = [key for key, each in by_key.items() if key and len(each) > 1]
        if again:
            return INFO, (
                f"{len(jobs)} deliveries of {len(by_key)} key(s); "
                f"delivered again: {', '.join(again)}"
            )
        return OK, f"{len(jobs)} deliveries of {len(by_key)} key(s)"
    if len(jobs) > 1:
        ran = sorted(set(_ran(runs)))
        replayed = sorted({run.job_id for run in runs if run.outcome == "replayed"})
        return INFO, (
            f"yes: {len(jobs)} deliveries (RQ jobs {', '.join(jobs)}); "
            f"{', '.join(ran) or 'none'} ran, "
            f"{', '.join(replayed) or 'none'} replayed the stored result"
        )
    return OK, f"no: one delivery (job {jobs[0]})"


def _same_lock_key(runs: list[Delivery]) -> tuple[str, str]:
    """Step 2: whether every run locked the same resource."""
    if not runs:
        return UNKNOWN, "no runs to compare"
    resources = sorted({run.resource for run in runs})
    if resources == [""]:
        return INFO, "no lock: the idempotency record alone serializes the runs"
    if len(resources) == 1:
        return OK, f"every run locked {resources[0]!r}"
    return PROBLEM, f"runs of one key locked different resources: {', '.join(resources)}"


def _ttl_and_heartbeat(found: Diagnosis, runs: list[Delivery]) -> tuple[str, str]:
    """Step 3: the longest run against the job's lock TTL and heartbeat."""
    spec = registry.get(found.scope or (runs[0].func if runs else ""))
    longest = max((run.took for run in runs if run.took is not None), default=None)
    if longest is None or spec is None:
        return UNKNOWN, "no durations recorded"
    if spec.lock is None:
        return INFO, f"longest run {longest:g}s; no lock, so no TTL to outlive"
    ttl = conf.get().LOCK_TTL if spec.ttl is None else spec.ttl
    if not spec.heartbeat and longest >= ttl:
        return PROBLEM, (
            f"a run took {longest:g}s, longer than the TTL {ttl:g}s, with heartbeat off"
        )
    beat = "renewed every TTL/3" if spec.heartbeat else "heartbeat off"
    return OK, f"longest run {longest:g}s; TTL {ttl:g}s, {beat}"


def _lock_lost(found: Diagnosis, runs: list[Delivery]) -> tuple[str, str]:
    """Step 4: the runs that lost their lock mid-run, and the family's recent losses."""
    aborted = [run.job_id for run in runs if run.outcome == "aborted"]
    verdict = INFO if aborted else OK
    findings = [
        f"lost mid-run and aborted (rolled back): jobs {', '.join(aborted)}"
        if aborted
        else "no run of this key lost its lock"
    ]
    fam = family(found.resource) if found.resource else ""
    lost = metrics.window(conf.get().ALERTS["WINDOW"]).total("lost", fam) if fam else 0
    if lost:
        findings.append(f"{lost} lock(s) of family {fam!r} lost in the last alert window")
    return verdict, "; ".join(findings)


def _owner_verified() -> tuple[str, str]:
    """Step 5: always yes, by construction."""
    return OK, (
        "always: the release and renew scripts compare the owner token atomically; "
        "operator releases are in the story above"
    )


def _committed_twice(runs: list[Delivery]) -> dict[str, list[str]]:
    """The keys that more than one run committed, with those runs' RQ job ids."""
    twice: dict[str, list[str]] = {}
    for key, each in _runs_by_key(runs).items():
        ran = _ran(each)
        if key and len(ran) > 1:
            twice[key] = ran
    return twice


def _effects_guarded(found: Diagnosis, runs: list[Delivery], sent: list[Any]) -> tuple[str, str]:
    """Step 6: one commit per key, and the effects outside the database through the outbox."""
    if twice := _committed_twice(runs):
        shown = "; ".join(f"{key!r} by {', '.join(ids)}" for key, ids in twice.items())
        return PROBLEM, f"runs committed one key's effect more than once: {shown}"
    if not found.key:
        return UNKNOWN, "no idempotency key: only the lock and the fence guard it"
    ran = _ran(runs)
    committed = f"the idempotency record let one run commit ({ran[0] if ran else 'none yet'})"
    if not sent:
        return OK, (
            f"{committed}; effects outside the database (e-mail, APIs) need send_after_commit"
        )
    pending = [message.key for message in sent if message.status != OutboxStatus.DELIVERED]
    if pending:
        return INFO, (
            f"{committed}; {len(sent)} effect(s) outside the database went through the outbox, "
            f"not delivered yet: {', '.join(pending)}"
        )
    return OK, (
        f"{committed}; {len(sent)} effect(s) outside the database went through the outbox, "
        "all delivered"
    )


def _ack_in_line(runs: list[Delivery]) -> tuple[str, str]:
    """Step 7: the runs that came near their RQ job_timeout."""
    ratio = conf.get().ALERTS["TIMEOUT_RATIO"]
    near = [
        run.job_id
        for run in runs
        if run.took is not None and run.timeout and run.took >= ratio * run.timeout
    ]
    if near:
        return PROBLEM, f"runs took {ratio:.0%}+ of their job_timeout: {', '.join(near)}"
    if runs:
        return OK, "every run ended well within its RQ job_timeout"
    return UNKNOWN, "no runs"


def render(found: Diagnosis) -> str:
    lines = [f"joblock doctor: {found.target}"]
    if found.scope:
        lines.append(f"scope {found.scope}, key {found.key!r}")
    lines.extend(("", "Story:", *(found.story or ["  nothing recorded"]), "", "Steps:"))
    lines.extend(
        f"  {step.number}. {step.question} [{step.verdict}] {step.evidence}" for step in found.steps
    )
    return "\n".join(lines)
