"""The runner-facing side of recurring schedules: inserting a tick's run, recording what a tick
did, syncing the schedules declared in code into the table, and stopping a schedule whose
stored definition cannot be computed. The runner's scheduler loop (``runner/scheduler.py``) and
``run_schedule_now`` call these; users do not.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models.functions import Now

from .. import conf
from ..enqueuing import enqueue_scheduled_run
from ..errors import ConfigurationError, EnqueueError, PreparedStatementLostError
from ..handlers import HandlerSpec, registry
from ..models import InactiveReason, JobSchedule, PersistentJob, ScheduleSource, TickResult
from ..payload import prepare_payload
from .definition import Definition, _alias, db_now
from .timing import UNCOMPUTABLE, Timing, default_timezone, tick_label

logger = logging.getLogger("django_persistent_jobs.scheduler")

__all__ = ["Fleet", "SyncReport", "code_definition", "deactivate_invalid", "insert_run",
           "payload_problem", "record_result", "sync_code_schedules"]

#: Serialises concurrent syncs by runners that start together (an advisory lock, held only for
#: the sync's own short transaction).
_SYNC_LOCK_KEY = "django_persistent_jobs.sync_schedules"
_TICK_INDEX = "pj_schedule_tick_uniq"


def insert_run(
    schedule: JobSchedule, *, tick: datetime | None, coalesced: int, fired_by: str | None,
) -> tuple[PersistentJob | None, str, str]:
    """Insert one run of ``schedule`` in a savepoint; return ``(job, result, error)``.

    ``job`` is the inserted run, or the active run Skip dedup deferred to, or ``None`` on error.
    A second run for the same tick is refused by the unique index and reported as skipped:
    that can only mean another runner already fired this tick.
    """
    info: dict[str, Any] = {
        "name": schedule.name,
        "trigger": "tick" if tick is not None else "manual",
        "tick": tick_label(tick) if tick is not None else None,
        **Timing.of(schedule).as_json(),
        "coalesced_ticks": coalesced,
        "fired_by": fired_by,
    }
    alias = _alias()

    def insert() -> tuple[PersistentJob, bool]:
        with transaction.atomic(using=alias):
            return enqueue_scheduled_run(
                schedule.job_type, schedule.payload, schedule=info, dedup_key=schedule.name,
                queue=schedule.queue, priority=schedule.priority, tenant=schedule.tenant,
            )

    try:
        try:
            job, created = insert()
        except PreparedStatementLostError:
            # Only the savepoint was lost; the insert now goes as text (``enqueuing``).
            job, created = insert()
    except IntegrityError as exc:
        if _TICK_INDEX not in str(exc):
            raise
        logger.warning("schedule %s: tick %s already has a run; not inserting another",
                       schedule.name, info["tick"],
                       extra={"event": "schedule_tick_duplicate", "schedule": schedule.name})
        return None, TickResult.SKIPPED, f"tick {info['tick']} already has a run"
    except (EnqueueError, ConfigurationError) as exc:
        return None, TickResult.ERROR, str(exc)
    return job, TickResult.ENQUEUED if created else TickResult.SKIPPED, ""


def record_result(
    schedule: JobSchedule, now: datetime, job: PersistentJob | None, result: str, error: str,
    next_run_at: datetime | None = None,
) -> None:
    """Store what a tick (or "run now") did on the schedule row."""
    values: dict[str, Any] = {
        "last_run_at": now, "last_result": result, "last_error": error, "updated_at": Now(),
    }
    if job is not None:
        values["last_job_id"] = job.id
    if next_run_at is not None:
        values["next_run_at"] = next_run_at
    JobSchedule.objects.using(_alias()).filter(pk=schedule.pk).update(**values)


# ----------------------------------------------------------------------------- code sync
@dataclass
class SyncReport:
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    deactivated: list[str] = field(default_factory=list)
    reactivated: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    rescheduled: list[str] = field(default_factory=list)


def code_definition(spec: HandlerSpec) -> Definition:
    """The definition a ``@job_handler(cron=...)`` declares, its payload prepared and validated
    as ``enqueue`` would: raises what the payload or its validator raise (the system check
    reports that as E102, so a declared schedule never silently gets no row)."""
    interval = spec.interval.total_seconds() if spec.interval is not None else None
    stored, _ = prepare_payload({} if spec.schedule_payload is None else spec.schedule_payload)
    if spec.validator is not None:
        spec.validator(stored)
    return Definition(spec.job_type, spec.cron, interval, spec.timezone or default_timezone(),
                      stored, None, None, spec.tenant)


def payload_problem(spec: HandlerSpec) -> str | None:
    """Why a declared schedule's payload would be refused (too large, not JSON, its own
    validator says no), or None. Such a schedule would get no row at all, so the system check
    (E102) and the runner's start report it. It needs the settings (payload limits, encoder),
    so it is not part of the registration-time ``check_options``."""
    try:
        code_definition(spec)
    except Exception as exc:
        return (f"handler {spec.job_type!r} ({spec.origin}): its schedule payload is refused: "
                f"{type(exc).__name__}: {exc}")
    return None


_FLEET_SQL = """
SELECT id, started_at, job_types::text, schedules::text FROM persistent_jobs_runners
WHERE heartbeat_at >= now() - %s * interval '1 second' OR id = %s
"""


@dataclass
class Fleet:
    """The live runners a sync must not overrule.

    Runners of two releases overlap during a rolling deploy, and either may start last. So a
    sync switches off a schedule only when no live runner declares it (or, for a missing
    handler, lists its job type), and rewrites a declared schedule only when no live runner
    that also declares it started after this one: the newest declaration wins, and when its
    runner stops, the next periodic sync of the runners left applies theirs.
    """

    runner_id: str | None = None
    started: tuple[datetime, str] | None = None
    #: Schedule name -> ``(started_at, id)`` of the other live runners that declare it.
    declared: dict[str, list[tuple[datetime, str]]] = field(default_factory=dict)
    #: Job types other live runners with a scheduler have handlers for (a runner started with
    #: ``--no-scheduler`` fires no schedule); None: one of them predates the list.
    handled: set[str] | None = field(default_factory=set)
    #: ``(started_at, id)`` of the other live runners that run a scheduler.
    schedulers: list[tuple[datetime, str]] = field(default_factory=list)

    @classmethod
    def load(cls, cursor: Any, runner_id: str | None) -> Fleet:
        fleet = cls(runner_id)
        if runner_id is None:
            return fleet  # an explicit call (tests, a shell) speaks for the code it runs
        cursor.execute(_FLEET_SQL, [conf.settings.STALE_LOCK_TIMEOUT, runner_id])
        for other, started_at, types_json, schedules_json in cursor.fetchall():
            job_types = None if types_json is None else json.loads(types_json)
            schedules = None if schedules_json is None else json.loads(schedules_json)
            if other == runner_id:
                fleet.started = (started_at, other)
                continue
            if job_types is None:  # a row from before the column: it handles every type
                fleet.handled = None
            if schedules is None:
                continue  # runs no scheduler: it neither declares nor fires a schedule
            fleet.schedulers.append((started_at, other))
            for name in schedules:
                fleet.declared.setdefault(name, []).append((started_at, other))
            if fleet.handled is not None and job_types is not None:
                fleet.handled.update(job_types)
        return fleet

    @property
    def lost(self) -> bool:
        """A runner whose row is gone (another runner presumed it dead) decides nothing until
        its heartbeat has registered it again: its view of the fleet is not the fleet's."""
        return self.runner_id is not None and self.started is None

    def speaks_for(self, name: str) -> bool:
        """Whether this runner's declaration of ``name`` is the newest live one."""
        if self.started is None:
            return self.runner_id is None  # an explicit call speaks for the code it runs
        return all(other < self.started for other in self.declared.get(name, ()))

    def is_newest(self) -> bool:
        """Whether no other live scheduler started after this one (one runner does the
        fleet-wide chores of a sync, not every runner every time)."""
        if self.started is None:
            return self.runner_id is None
        return all(other < self.started for other in self.schedulers)

    def declared_elsewhere(self, name: str) -> bool:
        return bool(self.declared.get(name))

    def handled_elsewhere(self, job_type: str) -> bool:
        return self.handled is None or job_type in self.handled


def sync_code_schedules(runner_id: str | None = None) -> SyncReport:
    """Make the table match the schedules declared with ``@job_handler`` in this process.

    Upserts each declared schedule (a changed timing restarts it from the next tick; an unchanged
    one keeps its ``next_run_at``, so a deploy neither skips nor repeats a run). Code schedules
    no longer declared are deactivated, and so are runtime schedules whose job type has no
    handler here: a schedule without a handler would only fill the dead letters. Those come back
    by themselves once a runner with the handler syncs. With ``ALLOW_UNREGISTERED`` (another
    service runs some job types) schedules of unknown types are left alone.

    A runner (``runner_id``) syncs at start and then periodically, and defers to the other live
    runners as ``Fleet`` describes; it records what its code declares on its runner row.
    """
    report = SyncReport()
    alias = _alias()
    known = set(registry.job_types())
    allow_unknown = conf.settings.ALLOW_UNREGISTERED
    declared = {spec.job_type: spec for spec in registry if spec.is_recurring}
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [_SYNC_LOCK_KEY])
            fleet = Fleet.load(cursor, runner_id)
        if fleet.lost:
            logger.info("runner %s: not syncing schedules while it is not registered",
                        runner_id, extra={"event": "schedule_sync_skipped"})
            return report
        now = db_now()
        # (payloads are read only for the schedules this code declares: ``_sync_one``)
        existing = {s.name: s for s in JobSchedule.objects.using(alias).defer("payload")}
        synced = []
        for name, spec in declared.items():
            if spec.errors:
                continue  # the system check reports it; the runner refuses to start
            if _sync_one(name, spec, existing.get(name), now, fleet, report):
                synced.append(name)
        for schedule in existing.values():
            _check_handler(schedule, declared, known, allow_unknown, now, fleet, report)
        if fleet.is_newest():
            _unstrand(report)
        if runner_id is not None:
            with connections[alias].cursor() as cursor:
                cursor.execute(
                    "UPDATE persistent_jobs_runners SET schedules = %s::jsonb WHERE id = %s",
                    [json.dumps(sorted(synced)), runner_id])
    for name in report.created + report.updated:
        logger.info("schedule %s synced from code", name,
                    extra={"event": "schedule_synced", "schedule": name})
    return report


def _sync_one(name: str, spec: HandlerSpec, row: JobSchedule | None, now: datetime,
              fleet: Fleet, report: SyncReport) -> bool:
    """Upsert one declared schedule; False when its declaration is unusable."""
    alias = _alias()
    try:
        definition = code_definition(spec)
    except Exception as exc:
        message = f"the schedule payload of {name!r} is unusable: {exc}"
        logger.error("schedule %s: %s", name, message,
                     extra={"event": "schedule_invalid", "schedule": name})
        if row is not None and row.is_code and fleet.speaks_for(name):
            JobSchedule.objects.using(alias).filter(pk=row.pk).update(
                active=False, inactive_reason=InactiveReason.INVALID, last_error=message,
                updated_at=Now())
        return False
    if row is None:
        try:
            with transaction.atomic(using=alias):
                JobSchedule.objects.using(alias).create(
                    name=name, job_type=definition.job_type, cron=definition.cron,
                    interval_seconds=definition.interval_seconds, timezone=definition.timezone,
                    payload=definition.payload, tenant=definition.tenant,
                    source=ScheduleSource.CODE,
                    next_run_at=definition.timing.first_after(now),
                )
        except IntegrityError:  # added at runtime a moment ago: treat as a conflict below
            row = JobSchedule.objects.using(alias).get(name=name)
        else:
            report.created.append(name)
            return True
    if not row.is_code:
        report.conflicts.append(name)
        logger.warning(
            "schedule %s is declared in code on %s, but a runtime schedule with that name "
            "exists; the runtime one stays in charge until it is removed", name, spec.origin,
            extra={"event": "schedule_conflict", "schedule": name})
        return True
    if not fleet.speaks_for(name):
        return True  # a runner that started later declares it too: its version stands
    values: dict[str, Any] = {}
    for column in ("job_type", "cron", "interval_seconds", "timezone", "payload", "queue",
                   "priority", "tenant"):
        if getattr(row, column) != getattr(definition, column):
            values[column] = getattr(definition, column)
    if not row.active:
        values.update(active=True, inactive_reason=InactiveReason.NONE, last_error="")
        report.reactivated.append(name)
    if (not Timing.of(row).same_ticks(definition.timing) or not row.active
            or row.next_run_at is None):
        values["next_run_at"] = definition.timing.first_after(now)
    if values:
        JobSchedule.objects.using(alias).filter(pk=row.pk).update(**values, updated_at=Now())
        report.updated.append(name)
    return True


_STRANDED_SQL = """
SELECT id, name, cron, interval_seconds, timezone, next_run_at
FROM persistent_jobs_schedules
WHERE active AND NOT paused AND next_run_at > clock_timestamp() AND (
    (interval_seconds IS NOT NULL
     AND next_run_at > clock_timestamp() + interval_seconds * interval '1 second')
    OR (cron IS NOT NULL AND updated_at > clock_timestamp()))
"""


def _unstrand(report: SyncReport) -> None:
    """Bring back schedules whose next tick lies beyond where their timing can put it (the
    database clock ran ahead while they fired, then was set back): see ``Timing.stranded``.

    Only candidates are read: an interval schedule more than one interval away, a cron one
    written "in the future" (a firing pass stamps ``updated_at`` with the clock that computed
    its next tick). ``now`` is read after them, so a row another runner wrote meanwhile was
    computed from an earlier clock; and each update applies only to the value read, so one
    fired or changed since is left as it is.
    """
    alias = _alias()
    with connections[alias].cursor() as cursor:
        cursor.execute(_STRANDED_SQL)
        rows = cursor.fetchall()
    if not rows:
        return
    now = db_now()
    for pk, name, cron, interval_seconds, zone, next_run_at in rows:
        try:
            tick = Timing(cron or None, interval_seconds, zone or "UTC").stranded(next_run_at, now)
        except Exception:  # an unusable definition is the firing pass's to report
            continue
        if tick is None:
            continue
        moved = JobSchedule.objects.using(alias).filter(pk=pk, next_run_at=next_run_at).update(
            next_run_at=tick, updated_at=Now())
        if not moved:
            continue
        report.rescheduled.append(name)
        logger.warning(
            "schedule %s: its next tick %s lies beyond the first tick after now (the database "
            "clock was set back?); next tick is now %s", name, next_run_at.isoformat(),
            tick.isoformat(), extra={"event": "schedule_rescheduled", "schedule": name})


def _check_handler(schedule: JobSchedule, declared: dict[str, HandlerSpec], known: set[str],
                   allow_unknown: bool, now: datetime, fleet: Fleet,
                   report: SyncReport) -> None:
    alias = _alias()
    has_handler = schedule.job_type in known
    if schedule.is_code:
        if schedule.name in declared or not schedule.active:
            return
        if not has_handler and allow_unknown:
            return  # another service may declare it
        if fleet.declared_elsewhere(schedule.name):
            return  # a live runner (of another release) still declares it
        reason = InactiveReason.REMOVED_FROM_CODE if (
            has_handler or fleet.handled_elsewhere(schedule.job_type)) else (
            InactiveReason.HANDLER_MISSING)
    elif (schedule.active and not has_handler and not allow_unknown
          and not fleet.handled_elsewhere(schedule.job_type)):
        reason = InactiveReason.HANDLER_MISSING
    elif (not schedule.active and has_handler
          and schedule.inactive_reason == InactiveReason.HANDLER_MISSING):
        try:
            next_run_at = Timing.of(schedule).next_after(now, anchor=schedule.next_run_at)
        except UNCOMPUTABLE as exc:
            # Unusable on this host (a zone its tzdata does not know, say): switched off with
            # the reason, as firing it would be, rather than stopping every runner's sync.
            deactivate_invalid(schedule, f"cannot compute the next tick: {exc}")
            return
        JobSchedule.objects.using(alias).filter(pk=schedule.pk).update(
            active=True, inactive_reason=InactiveReason.NONE,
            next_run_at=next_run_at, updated_at=Now())
        report.reactivated.append(schedule.name)
        logger.info("schedule %s reactivated: a handler for %r is registered again",
                    schedule.name, schedule.job_type,
                    extra={"event": "schedule_reactivated", "schedule": schedule.name})
        return
    else:
        return
    JobSchedule.objects.using(alias).filter(pk=schedule.pk).update(
        active=False, inactive_reason=reason, updated_at=Now())
    report.deactivated.append(schedule.name)
    logger.warning(
        "schedule %s deactivated: %s (job type %r)", schedule.name,
        InactiveReason(reason).label.lower(), schedule.job_type,
        extra={"event": "schedule_deactivated", "schedule": schedule.name, "reason": reason})


def deactivate_invalid(schedule: JobSchedule, message: str) -> None:
    """Stop a schedule whose stored definition cannot be computed (say, a zone this host's
    tzdata lacks) instead of failing on it every tick."""
    JobSchedule.objects.using(_alias()).filter(pk=schedule.pk).update(
        active=False, inactive_reason=InactiveReason.INVALID, last_result=TickResult.ERROR,
        last_error=message, updated_at=Now())
    logger.error("schedule %s deactivated: %s", schedule.name, message,
                 extra={"event": "schedule_deactivated", "schedule": schedule.name,
                        "reason": InactiveReason.INVALID})
