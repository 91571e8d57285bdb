"""Every number the operator console shows, computed in one place.

The admin dashboard, the HTTP API's ``stats`` endpoint and ``manage.py jobs stats`` all read
``dashboard_stats()`` so that they can never disagree about what "stuck", "stale" or "failed"
means (the Prometheus scrape reads its few gauges with one cheaper statement, ``metrics.py``).
Each figure answers one of an operator's questions: what failed and how often (the time series
and the failure groups), is it stuck (queues, stuck jobs, runners) and who owns it (tenants).
The database clock decides "now", as it does for the runner.

Definitions, kept here rather than in templates:

- A runner is **live** while its heartbeat is younger than ``late_after`` (two heartbeat
  intervals), **late** until ``STALE_LOCK_TIMEOUT`` and **dead** beyond it (another runner will
  reap it and rescue its jobs). Late and dead runners are flagged ``stale``. A live or late
  runner still serves its queues.
- A job is **due** when ``models.due(now)`` says so: what ``PersistentJob.objects.claimable()``
  lists plus the jobs ``models.held_by_dedup()`` holds back behind a running job with their
  dedup key. Those count here (in a queue's ``due``, its oldest due job, and as "unclaimed"
  once late) because they are late work all the same: each runs as soon as its blocker ends,
  and a blocker that never ends is exactly what an operator must see.
- Time series: *completed* and *dead-lettered* count jobs by the time they finished (their
  current status), *failed* counts attempts that ended in an error (failed, timed out, rescued
  or dead-lettered), so a job retried three times counts three failures.
- A **failure group** is a job type and an error code; its count is the failed attempts in the
  window, and ``dead_letters`` the jobs of the group dead-lettered now (whenever that happened:
  they are what "retry every dead letter of this group" would retry).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import (
    Case,
    Count,
    DateTimeField,
    Exists,
    ExpressionWrapper,
    F,
    Func,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Coalesce
from django.db.models.lookups import LessThan
from django.utils import timezone

from . import conf
from .handlers import registry
from .models import AttemptOutcome, JobAttempt, JobRunnerRecord, JobStatus, PersistentJob, due

#: Waiting or running jobs, spelled as two conditions that match the partial indexes
#: (``pj_claim_idx`` holds the waiting, ``pj_locked_by_idx`` the running): one
#: ``status IN (three)`` matches neither, and PostgreSQL read the whole table for it.
ACTIVE = Q(status__in=JobStatus.waiting()) | Q(status=JobStatus.RUNNING)

#: Attempt outcomes that count as a failure in the time series and the failure groups.
FAILED_OUTCOMES: tuple[str, ...] = (
    AttemptOutcome.FAILED, AttemptOutcome.DEAD_LETTERED, AttemptOutcome.TIMED_OUT,
    AttemptOutcome.RESCUED,
)
#: A due job nobody claimed for this long is listed as stuck (runners poll every second or so).
DEFAULT_UNCLAIMED_AFTER = timedelta(minutes=1)
#: The history a caller may ask the rates to cover, in seconds (a minute to 90 days): the
#: API and the ``jobs`` command refuse anything else rather than scan months of attempts.
WINDOW_MIN_SECONDS = 60
WINDOW_MAX_SECONDS = 90 * 86400
#: At most this many rows in each list (stuck jobs, failure groups, tenants, job types).
LIST_LIMIT = 50

STUCK_KINDS: dict[str, str] = {
    "past_timeout": "running past its timeout",
    "stale_runner": "held by a runner whose heartbeat is stale",
    "unclaimed": "due but unclaimed",
    "unserved_queue": "on a queue no live runner serves",
    "unhandled_type": "of a type no live runner serving its queue has a handler for",
}


def as_utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime. With ``USE_TZ = False`` Django hands out naive
    datetimes in ``TIME_ZONE`` (the connection's zone): read them there, not in the server
    process's zone, which is what ``astimezone`` would assume."""
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.get_default_timezone())
    return value.astimezone(UTC)


class _UtcHour(Func):
    """The UTC hour a ``timestamptz`` falls in, as a naive UTC timestamp: truncated in UTC
    whatever ``USE_TZ`` and the connection's time zone (Django's ``Trunc(tzinfo=UTC)`` ignores
    its ``tzinfo`` when ``USE_TZ`` is off, and truncates in ``TIME_ZONE``, whose hours need not
    be UTC's). ``_utc_hour_key`` makes the value aware."""

    template = "date_trunc('hour', %(expressions)s AT TIME ZONE 'UTC')"
    output_field = DateTimeField()


def _utc_hour_key(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if timezone.is_naive(value) else value.astimezone(UTC)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return as_utc(value).isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class _Serializable:
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: datetimes as ISO 8601 UTC strings, durations as seconds."""
        assert is_dataclass(self)
        return {f.name: _jsonable(_as_plain(getattr(self, f.name))) for f in fields(self)}


def _as_plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, list | tuple):
        return [_as_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class QueueStats(_Serializable):
    queue: str
    waiting: int  #: pending or failed (retry scheduled), due or not
    due: int  #: due now (``models.due``), dedup-held jobs included
    running: int
    oldest_due_at: datetime | None
    oldest_due_wait: timedelta | None  #: how long the oldest due job has been due
    served: bool  #: a live (or late) runner claims from this queue
    runners: list[str]


@dataclass(frozen=True)
class JobTypeStats(_Serializable):
    job_type: str
    counts: dict[str, int]  #: per status, every status present
    total: int


@dataclass(frozen=True)
class Bucket(_Serializable):
    start: datetime
    completed: int = 0
    failed: int = 0
    dead_lettered: int = 0


@dataclass(frozen=True)
class FailureGroup(_Serializable):
    job_type: str
    error_code: str
    attempts: int  #: failed attempts in the window
    jobs: int  #: distinct jobs behind them
    first_seen: datetime
    last_seen: datetime
    last_message: str
    dead_letters: int  #: jobs of this type and code dead-lettered now


@dataclass(frozen=True)
class StuckJob(_Serializable):
    id: str
    job_type: str
    queue: str
    status: str
    tenant: str | None
    kinds: list[str]  #: keys of STUCK_KINDS
    locked_by: str | None
    since: datetime | None  #: claimed at (running) or due since (waiting)
    detail: str


@dataclass(frozen=True)
class RunnerStats(_Serializable):
    id: str
    hostname: str
    pid: int | None
    queues: list[str] | None  #: None: every queue
    #: The job types it has handlers for (it claims only those); None: not known (a row of a
    #: runner from before runners listed them, or a holder with no row), counted as every type.
    job_types: list[str] | None
    concurrency: int | None
    version: str
    started_at: datetime | None
    heartbeat_at: datetime | None
    heartbeat_age: timedelta | None
    state: str  #: "live", "late", "dead"; "gone" for a holder of running jobs with no row
    stale: bool
    jobs_held: int


@dataclass(frozen=True)
class TenantStats(_Serializable):
    tenant: str | None  #: None: jobs enqueued without a tenant
    counts: dict[str, int]
    total: int
    failures: int  #: failed attempts in the window


@dataclass(frozen=True)
class DashboardStats(_Serializable):
    now: datetime
    window: timedelta
    tenant: str | None
    stale_after: timedelta
    late_after: timedelta
    unclaimed_after: timedelta
    status_counts: dict[str, int]
    queues: list[QueueStats]
    job_types: list[JobTypeStats]
    hourly: list[Bucket]  #: last 24 hours, oldest first, the current hour last
    daily: list[Bucket]  #: last 7 days (UTC), oldest first, today last
    failure_groups: list[FailureGroup]
    stuck: list[StuckJob]
    stuck_counts: dict[str, int] = field(default_factory=dict)  #: per kind, beyond the list cap
    stuck_total: int = 0  #: stuck jobs of any kind, beyond the list cap (``stuck`` is cut)
    runners: list[RunnerStats] = field(default_factory=list)
    tenants: list[TenantStats] = field(default_factory=list)

    @property
    def total_stuck(self) -> int:
        return max(self.stuck_total, len(self.stuck))


def _alias() -> str:
    return conf.settings.DATABASE


def _db_now(alias: str) -> datetime:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT now()")
        value: datetime = cursor.fetchone()[0]
    return value


def runner_thresholds() -> tuple[timedelta, timedelta]:
    """(late_after, stale_after) from the same settings the runners use to judge each other."""
    stale = conf.settings.STALE_LOCK_TIMEOUT
    heartbeat = conf.settings.HEARTBEAT_INTERVAL
    beat = stale / 3 if heartbeat is None else heartbeat
    return timedelta(seconds=min(2 * beat, stale)), timedelta(seconds=stale)


def runner_state(heartbeat_age: timedelta, late_after: timedelta, stale_after: timedelta) -> str:
    """"live", "late" or "dead" for a heartbeat of this age (see the module docstring)."""
    if heartbeat_age <= late_after:
        return "live"
    return "late" if heartbeat_age <= stale_after else "dead"


def _serves(queues: Any, queue: str) -> bool:
    return queues is None or (isinstance(queues, list) and queue in queues)


def _handled(runners: list[RunnerStats]) -> Q:
    """Jobs some live (or late) runner would claim by queue and type. A runner claims only the
    types it has handlers for (a job of a type only a newer release knows waits for a runner
    of that release, see concepts.md), so such a job is not late: nobody will claim it until a
    runner with its handler starts. The queue half is ``unserved_queue``'s business. A runner
    whose row lists no types (written before runners listed them) counts as handling every
    type on its own queues. One clause per distinct (queues, types): replicas of one
    deployment list the same, and the statement must not grow with their number."""
    handled = Q(pk__in=[])
    seen: set[tuple[tuple[str, ...] | None, tuple[str, ...] | None]] = set()
    for runner in runners:
        if runner.state not in ("live", "late"):
            continue
        queues = None if runner.queues is None else tuple(sorted(runner.queues))
        types = None if runner.job_types is None else tuple(sorted(runner.job_types))
        if (queues, types) in seen:
            continue
        seen.add((queues, types))
        cond = Q(pk__isnull=False) if types is None else Q(job_type__in=types)
        handled |= cond if queues is None else cond & Q(queue__in=queues)
    return handled


def type_unhandled(serving: Iterable[tuple[Collection[str] | None, Collection[str] | None]],
                   queue: str, job_type: str) -> bool:
    """``_handled``'s rule for one job, in Python: some of the live runners ``serving``, as
    ``(queues, job types)`` with None for every queue or for types not listed, serves
    ``queue``, and none of those lists ``job_type``. The stuck list's details and the
    ``unhandled_jobs`` metric both ask this."""
    here = [types for queues, types in serving if queues is None or queue in queues]
    return bool(here) and not any(types is None or job_type in types for types in here)


def _zero_counts() -> dict[str, int]:
    return dict.fromkeys(JobStatus.values, 0)


def dashboard_stats(
    *, now: datetime | None = None, window: timedelta = timedelta(hours=24),
    tenant: str | None = None, unclaimed_after: timedelta = DEFAULT_UNCLAIMED_AFTER,
) -> DashboardStats:
    """Compute every dashboard figure; ``tenant`` confines each one to that tenant's jobs.

    ``now`` defaults to the database's clock. ``window`` is how far back the failure groups and
    the tenants' failure counts look; the time series always cover 24 hours and 7 days.
    Runners are shared by all tenants, so with a tenant given they are still listed but
    ``jobs_held`` counts that tenant's jobs only.
    """
    alias = _alias()
    now = now or _db_now(alias)
    late_after, stale_after = runner_thresholds()
    jobs: QuerySet[PersistentJob] = PersistentJob.objects.using(alias).all()
    attempts: QuerySet[JobAttempt] = JobAttempt.objects.using(alias).all()
    if tenant is not None:
        jobs = jobs.filter(tenant=tenant)
        attempts = attempts.filter(job__tenant=tenant)

    runners = _runners(alias, jobs, now, late_after, stale_after)
    serving = {r.id: r.queues for r in runners if r.state in ("live", "late")}
    queues = _queues(jobs, now, serving)
    served_queues = {q.queue for q in queues if q.served}
    stuck, stuck_counts, stuck_total = _stuck(jobs, now, runners, served_queues,
                                              unclaimed_after)
    status_counts, job_types = _counts(jobs)
    hourly, daily = _series(jobs, attempts, now)
    return DashboardStats(
        now=now, window=window, tenant=tenant, stale_after=stale_after, late_after=late_after,
        unclaimed_after=unclaimed_after,
        status_counts=status_counts,
        queues=queues,
        job_types=job_types,
        hourly=hourly, daily=daily,
        failure_groups=_failure_groups(jobs, attempts, now - window),
        stuck=stuck, stuck_counts=stuck_counts, stuck_total=stuck_total,
        runners=runners,
        tenants=_tenants(jobs, attempts, now - window),
    )


def _counts(jobs: QuerySet[PersistentJob]) -> tuple[dict[str, int], list[JobTypeStats]]:
    """Jobs per status, and per job type and status: one scan of the table for both."""
    totals = _zero_counts()
    per_type: dict[str, dict[str, int]] = defaultdict(_zero_counts)
    for row in jobs.order_by().values("job_type", "status").annotate(n=Count("id")):
        per_type[row["job_type"]][row["status"]] = row["n"]
        totals[row["status"]] += row["n"]
    result = [JobTypeStats(job_type=t, counts=c, total=sum(c.values()))
              for t, c in per_type.items()]
    result.sort(key=lambda s: (-s.total, s.job_type))
    return totals, result[:LIST_LIMIT]


def _queues(
    jobs: QuerySet[PersistentJob], now: datetime, serving: dict[str, list[str] | None],
) -> list[QueueStats]:
    due_now = due(now)
    rows = {
        row["queue"]: row for row in jobs.filter(ACTIVE).order_by()
        .values("queue").annotate(
            waiting=Count("id", filter=Q(status__in=JobStatus.waiting())),
            due=Count("id", filter=due_now),
            running=Count("id", filter=Q(status=JobStatus.RUNNING)),
            oldest_due=Min("next_run_at", filter=due_now),
        )
    }
    names = set(rows) | {spec.effective_queue() for spec in registry}
    for queues in serving.values():
        names.update(queues or ())
    result = []
    for name in sorted(names):
        row: dict[str, Any] = dict(rows.get(name, {}))
        oldest = row.get("oldest_due")
        runner_ids = sorted(rid for rid, qs in serving.items() if _serves(qs, name))
        result.append(QueueStats(
            queue=name, waiting=row.get("waiting", 0), due=row.get("due", 0),
            running=row.get("running", 0), oldest_due_at=oldest,
            oldest_due_wait=max(now - oldest, timedelta(0)) if oldest else None,
            served=bool(runner_ids), runners=runner_ids,
        ))
    return result


def _series(
    jobs: QuerySet[PersistentJob], attempts: QuerySet[JobAttempt], now: datetime,
) -> tuple[list[Bucket], list[Bucket]]:
    """(hourly over 24 h, daily over 7 days), from one pass per table grouped by UTC hour."""
    hour = as_utc(now).replace(minute=0, second=0, microsecond=0)
    hours = [hour - timedelta(hours=23 - i) for i in range(24)]
    today = hour.replace(hour=0)
    days = [today - timedelta(days=6 - i) for i in range(7)]
    empty = {"completed": 0, "failed": 0, "dead_lettered": 0}
    per_hour: dict[datetime, dict[str, int]] = defaultdict(lambda: dict(empty))
    finished = (
        jobs.filter(status__in=(JobStatus.COMPLETED, JobStatus.DEAD_LETTERED),
                    finished_at__gte=days[0], finished_at__lte=now)
        .order_by().annotate(b=_UtcHour("finished_at"))
        .values("b", "status").annotate(n=Count("id"))
    )
    for row in finished:
        per_hour[_utc_hour_key(row["b"])][row["status"]] += row["n"]
    failed = (
        attempts.filter(outcome__in=FAILED_OUTCOMES, finished_at__gte=days[0],
                        finished_at__lte=now)
        .order_by().annotate(b=_UtcHour("finished_at"))
        .values("b").annotate(n=Count("id"))
    )
    for bucket in failed:
        per_hour[_utc_hour_key(bucket["b"])]["failed"] += bucket["n"]
    per_day: dict[datetime, dict[str, int]] = defaultdict(lambda: dict(empty))
    for start, counts in per_hour.items():
        day = per_day[start.replace(hour=0)]
        for key, n in counts.items():
            day[key] += n
    return ([Bucket(start=h, **per_hour.get(h, empty)) for h in hours],
            [Bucket(start=d, **per_day.get(d, empty)) for d in days])


def _failure_groups(
    jobs: QuerySet[PersistentJob], attempts: QuerySet[JobAttempt], since: datetime,
) -> list[FailureGroup]:
    failed = attempts.filter(outcome__in=FAILED_OUTCOMES, finished_at__gte=since)
    rows = list(
        failed.order_by().values(job_type=F("job__job_type"), code=F("error_code"))
        .annotate(n=Count("id"), jobs=Count("job_id", distinct=True),
                  first=Min("finished_at"), last=Max("finished_at"))
        .order_by("-n", "job_type", "code")[:LIST_LIMIT]
    )
    if not rows:
        return []
    types = {r["job_type"] for r in rows}
    # The latest message of each group (DISTINCT ON keeps the first row per group).
    messages = {
        (m["job__job_type"], m["error_code"]): m["error_message"]
        for m in failed.filter(job__job_type__in=types)
        .order_by("job__job_type", "error_code", "-finished_at", "-id")
        .distinct("job__job_type", "error_code")
        .values("job__job_type", "error_code", "error_message")
    }
    dead: dict[tuple[str, str], int] = {}
    for row in (jobs.filter(status=JobStatus.DEAD_LETTERED, job_type__in=types).order_by()
                .values("job_type", "last_error_code").annotate(n=Count("id"))):
        dead[(row["job_type"], row["last_error_code"])] = row["n"]
    return [
        FailureGroup(
            job_type=r["job_type"], error_code=r["code"], attempts=r["n"], jobs=r["jobs"],
            first_seen=r["first"], last_seen=r["last"],
            last_message=(messages.get((r["job_type"], r["code"])) or "")[:500],
            dead_letters=dead.get((r["job_type"], r["code"]), 0),
        )
        for r in rows
    ]


def _runners(
    alias: str, jobs: QuerySet[PersistentJob], now: datetime, late_after: timedelta,
    stale_after: timedelta,
) -> list[RunnerStats]:
    held = dict(
        jobs.filter(status=JobStatus.RUNNING, locked_by__isnull=False).order_by()
        .values("locked_by").annotate(n=Count("id")).values_list("locked_by", "n")
    )
    result = []
    for record in JobRunnerRecord.objects.using(alias).order_by("id"):
        age = max(now - record.heartbeat_at, timedelta(0))
        state = runner_state(age, late_after, stale_after)
        queues = record.queues if isinstance(record.queues, list) else None
        types = record.job_types if isinstance(record.job_types, list) else None
        result.append(RunnerStats(
            id=record.id, hostname=record.hostname, pid=record.pid, queues=queues,
            job_types=types, concurrency=record.concurrency, version=record.version,
            started_at=record.started_at, heartbeat_at=record.heartbeat_at, heartbeat_age=age,
            state=state, stale=state != "live", jobs_held=held.pop(record.id, 0),
        ))
    # Running jobs whose runner has no row (reaped, or killed before it ever registered): the
    # rescue loop of any live runner releases them; show the holder so nobody waits for it.
    for runner_id, n in sorted(held.items()):
        result.append(RunnerStats(
            id=str(runner_id), hostname="", pid=None, queues=None, job_types=None,
            concurrency=None, version="",
            started_at=None, heartbeat_at=None, heartbeat_age=None, state="gone", stale=True,
            jobs_held=n,
        ))
    return result


def run_start() -> Case:
    """When a running job's current attempt began to run: its attempt's ``started_at``, or
    NULL while the attempt only waits in its runner for a free worker (``PREFETCH``: claimed,
    its ``started`` still false) and for a job that is not running. The timeout clock starts
    when a worker starts the job, so ``locked_at`` (the claim) would count the wait for a
    worker as running time. A running job whose attempt row is missing (written by hand)
    counts from its claim, as an attempt row written before attempts recorded their start
    counts as started.

    At most two primary-key probes of the attempts table (``lock_token`` is the current
    attempt's id), and only for a running row (a CASE stops at its first true branch): the
    cost follows the running jobs, neither the waiting ones nor the attempt history."""
    current = JobAttempt.objects.filter(pk=OuterRef("lock_token"))
    return Case(
        When(~Q(status=JobStatus.RUNNING), then=Value(None)),
        When(Exists(current.filter(started=False)), then=Value(None)),
        default=Coalesce(Subquery(current.order_by().values("started_at")[:1]),
                         F("locked_at")),
        output_field=DateTimeField(),
    )


def _stuck(
    jobs: QuerySet[PersistentJob], now: datetime, runners: list[RunnerStats],
    served_queues: set[str], unclaimed_after: timedelta,
) -> tuple[list[StuckJob], dict[str, int], int]:
    stale_ids = [r.id for r in runners if r.state in ("dead", "gone")]
    running = Q(status=JobStatus.RUNNING)
    due_now = due(now)
    timeout = Func(F("timeout_seconds"), template="make_interval(secs => %(expressions)s)")
    # NULL for a job whose attempt has not started: it is not running out of time (the
    # runner starts its timeout when a worker starts it), however long ago it was claimed.
    # Spelled inline rather than as an alias: an aggregate filter on an alias that holds a
    # subquery makes Django wrap the whole aggregate in a subquery that computes it for
    # every active row.
    timeout_at = ExpressionWrapper(run_start() + timeout, output_field=DateTimeField())
    past_timeout = running & Q(LessThan(timeout_at, Value(now, output_field=DateTimeField())))
    stale_runner = running & Q(locked_by__in=stale_ids)
    unclaimed = due_now & Q(next_run_at__lt=now - unclaimed_after)
    unserved = due_now & ~Q(queue__in=served_queues)
    unhandled = due_now & Q(queue__in=served_queues) & ~_handled(runners)
    kinds = {"past_timeout": past_timeout, "stale_runner": stale_runner,
             "unclaimed": unclaimed, "unserved_queue": unserved, "unhandled_type": unhandled}
    # Every kind concerns running or waiting jobs: the partial indexes hold exactly those, so
    # the cost does not grow with the finished history.
    active = jobs.filter(ACTIVE)
    any_kind = past_timeout | stale_runner | unclaimed | unserved | unhandled
    counts = {
        kind: n for kind, n in active.order_by().aggregate(
            **{kind: Count("id", filter=cond) for kind, cond in kinds.items()},
            _any=Count("id", filter=any_kind),
        ).items()
    }
    total = counts.pop("_any")
    found = list(active.filter(any_kind).order_by("next_run_at", "id").only(
        "id", "job_type", "queue", "status", "tenant", "locked_by", "locked_at", "next_run_at",
        "timeout_seconds").annotate(run_started=run_start())[:LIST_LIMIT])
    heartbeat = {r.id: r for r in runners}
    serving = [(r.queues, r.job_types) for r in runners if r.state in ("live", "late")]
    result = []
    for job in found:
        matched: list[str] = []
        details: list[str] = []
        if job.status == JobStatus.RUNNING:
            began: datetime | None = job.run_started
            if began is not None and job.timeout_seconds is not None and (
                    now - began > timedelta(seconds=job.timeout_seconds)):
                matched.append("past_timeout")
                details.append(f"running {_short(now - began)}, timeout "
                               f"{_short(timedelta(seconds=job.timeout_seconds))}")
            if job.locked_by in stale_ids:
                matched.append("stale_runner")
                holder = heartbeat.get(job.locked_by or "")
                age = holder.heartbeat_age if holder else None
                details.append(f"runner {job.locked_by} " + (
                    f"last beat {_short(age)} ago" if age is not None else "has no row"))
                if began is None:
                    details.append("claimed, not started (it waited for a free worker)")
            since = job.locked_at
        else:
            waited = now - job.next_run_at
            if waited > unclaimed_after:
                matched.append("unclaimed")
                details.append(f"due {_short(waited)} ago")
            if job.queue not in served_queues:
                matched.append("unserved_queue")
                details.append(f"no live runner serves queue {job.queue!r}")
            elif type_unhandled(serving, job.queue, job.job_type):
                matched.append("unhandled_type")
                details.append(f"no live runner serving queue {job.queue!r} has a handler for "
                               f"{job.job_type!r}")
            since = job.next_run_at
        if not matched:  # the clock moved between the two queries
            continue
        result.append(StuckJob(
            id=str(job.id), job_type=job.job_type, queue=job.queue, status=job.status,
            tenant=job.tenant, kinds=matched, locked_by=job.locked_by, since=since,
            detail="; ".join(details),
        ))
    return result, counts, total


def _tenants(
    jobs: QuerySet[PersistentJob], attempts: QuerySet[JobAttempt], since: datetime,
) -> list[TenantStats]:
    per_tenant: dict[str | None, dict[str, int]] = defaultdict(_zero_counts)
    for row in jobs.order_by().values("tenant", "status").annotate(n=Count("id")):
        per_tenant[row["tenant"]][row["status"]] = row["n"]
    failures = dict(
        attempts.filter(outcome__in=FAILED_OUTCOMES, finished_at__gte=since).order_by()
        .values("job__tenant").annotate(n=Count("id")).values_list("job__tenant", "n")
    )
    result = [
        TenantStats(tenant=t, counts=c, total=sum(c.values()), failures=failures.get(t, 0))
        for t, c in per_tenant.items()
    ]
    result.sort(key=lambda s: (-s.failures, -s.total, s.tenant or ""))
    return result[:LIST_LIMIT]


def _short(delta: timedelta | None) -> str:
    """A compact duration for details: 45s, 12m, 3h 5m, 2d 4h."""
    if delta is None:
        return "-"
    seconds = int(max(delta.total_seconds(), 0))
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 120:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 48:
        return f"{hours}h {minutes % 60}m"
    return f"{hours // 24}d {hours % 24}h"


__all__ = [
    "FAILED_OUTCOMES", "STUCK_KINDS", "Bucket", "DashboardStats", "FailureGroup",
    "JobTypeStats", "QueueStats", "RunnerStats", "StuckJob", "TenantStats", "dashboard_stats",
    "runner_state", "runner_thresholds",
]
