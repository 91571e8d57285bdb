"""Recurring schedules at runtime: add, change, pause, resume, remove and "run now".

This is the one implementation the admin, the Python API and the scheduler share, so a schedule
behaves the same however it was touched. Every function validates its whole input before writing
anything and raises ``ScheduleError`` (a ``ValueError``) with a message that says what to fix.

Schedules declared in code (``@job_handler(..., cron=...)``) are written into the same table by
``sync_code_schedules`` when a runner starts. They can be paused, resumed and run now at runtime,
but not changed or removed there: the next deploy would silently put them back. Change the
decorator instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models.functions import Now

from . import bounds, conf
from .enqueuing import enqueue_scheduled_run
from .errors import ConfigurationError, EnqueueError
from .handlers import HandlerSpec, registry
from .models import PersistentJob
from .payload import prepare_payload
from .schedule_models import InactiveReason, JobSchedule, ScheduleSource, TickResult
from .schedules import (
    ScheduleError,
    Timing,
    cron_problem,
    default_timezone,
    interval_problem,
    tick_label,
    timezone_problem,
)

logger = logging.getLogger("django_persistent_jobs.scheduler")

__all__ = [
    "ScheduleError",
    "ScheduleNotFoundError",
    "add_schedule",
    "pause_schedule",
    "remove_schedule",
    "resume_schedule",
    "run_schedule_now",
    "sync_code_schedules",
    "update_schedule",
]

#: Serialises concurrent syncs by runners that start together (an advisory lock, held only for
#: the sync's own short transaction).
_SYNC_LOCK_KEY = "django_persistent_jobs.sync_schedules"
_TICK_INDEX = "pj_schedule_tick_uniq"
_UPDATABLE = ("job_type", "cron", "interval", "payload", "timezone", "queue", "priority",
              "tenant")


class ScheduleNotFoundError(LookupError):
    """No schedule has the given name."""


def _alias() -> str:
    return conf.settings.DATABASE


def db_now() -> datetime:
    """The database clock: due-ness is decided by PostgreSQL, never by this host's clock."""
    with connections[_alias()].cursor() as cursor:
        cursor.execute("SELECT now()")
        row = cursor.fetchone()
    value: datetime = row[0]
    return value


# ----------------------------------------------------------------------------- validation
@dataclass
class Definition:
    """A validated schedule definition, ready to store."""

    job_type: str
    cron: str | None
    interval_seconds: float | None
    timezone: str
    payload: Any
    queue: str | None
    priority: int | None
    tenant: str | None = None

    @property
    def timing(self) -> Timing:
        return Timing(self.cron, self.interval_seconds, self.timezone)


def _interval_seconds(interval: Any) -> float:
    if isinstance(interval, int | float) and not isinstance(interval, bool):
        seconds = bounds.seconds_of(interval)
        if seconds is None or not math.isfinite(seconds) or abs(seconds) > bounds.MAX_SECONDS:
            raise ScheduleError(f"interval must be finite seconds, at most "
                                f"{bounds.MAX_SECONDS:.0f}, got {bounds.show(interval)}.")
        interval = timedelta(seconds=seconds)
    problem = interval_problem(interval)
    if problem:
        raise ScheduleError(problem)
    assert isinstance(interval, timedelta)
    return interval.total_seconds()


def _require(problem: str | None) -> None:
    if problem is not None:
        raise ScheduleError(problem)


def _handler_for(job_type: Any) -> HandlerSpec | None:
    _require(bounds.job_type_problem(job_type))
    return registry.resolve(
        job_type, missing=ScheduleError, invalid=ScheduleError,
        hint="; a schedule for it would only produce dead letters. Register it with "
        "@job_handler first.",
    )


def validate_definition(
    job_type: Any, *, cron: Any = None, interval: Any = None, payload: Any = None,
    timezone: Any = None, queue: Any = None, priority: Any = None, tenant: Any = None,
) -> Definition:
    """Check a whole definition and return it normalised; raise ``ScheduleError`` otherwise.

    ``interval`` is a ``timedelta`` or a number of seconds; ``timezone`` defaults to
    ``settings.TIME_ZONE``; ``queue``/``priority`` left as ``None`` follow the handler;
    ``tenant`` (``None``: no tenant) is given to every run the schedule enqueues.
    """
    spec = _handler_for(job_type)
    if cron is not None and interval is not None:
        raise ScheduleError("Give either cron or interval, not both.")
    if cron is None and interval is None:
        raise ScheduleError("Give a cron expression or an interval.")
    interval_seconds = None
    if cron is not None:
        problem = cron_problem(cron)
        if problem:
            raise ScheduleError(problem)
        cron = " ".join(str(cron).split())
    else:
        interval_seconds = _interval_seconds(interval)
    zone = default_timezone() if timezone in (None, "") else timezone
    problem = timezone_problem(zone)
    if problem:
        raise ScheduleError(problem)
    if queue is not None:
        _require(bounds.queue_problem(queue))
    if priority is not None:
        _require(bounds.priority_problem(priority))
    _require(bounds.tenant_problem(tenant))
    try:
        stored, _ = prepare_payload({} if payload is None else payload)
    except EnqueueError as exc:
        raise ScheduleError(str(exc)) from exc
    if spec is not None and spec.validator is not None:
        try:
            spec.validator(stored)
        except Exception as exc:
            raise ScheduleError(
                f"payload rejected by the validator of {job_type!r}: {exc}"
            ) from exc
    return Definition(job_type, cron, interval_seconds, str(zone), stored, queue, priority,
                      tenant)


def _check_changes(changes: dict[str, Any]) -> None:
    """Check each changed field on its own before the row is read; the whole definition is
    checked again once merged with the stored one."""
    if "job_type" in changes:
        _handler_for(changes["job_type"])
    if changes.get("cron") is not None:
        _require(cron_problem(changes["cron"]))
    if changes.get("interval") is not None:
        _interval_seconds(changes["interval"])
    if changes.get("timezone") not in (None, ""):
        _require(timezone_problem(changes["timezone"]))
    if changes.get("queue") is not None:
        _require(bounds.queue_problem(changes["queue"]))
    if changes.get("priority") is not None:
        _require(bounds.priority_problem(changes["priority"]))
    _require(bounds.tenant_problem(changes.get("tenant")))
    if "payload" in changes:
        try:
            prepare_payload({} if changes["payload"] is None else changes["payload"])
        except EnqueueError as exc:
            raise ScheduleError(str(exc)) from exc


def _check_name(name: Any) -> str:
    limit = bounds.SCHEDULE_NAME_MAX_LENGTH
    if not isinstance(name, str) or not name.strip() or len(name) > limit:
        raise ScheduleError(f"name must be a non-blank string of at most {limit} characters, "
                            f"got {bounds.show(name)}.")
    problem = bounds.text_problem(name)
    if problem:
        raise ScheduleError(f"name {bounds.show(name)} contains {problem}.")
    return name


def _get(name: str, *, lock: bool = False) -> JobSchedule:
    _check_name(name)
    queryset = JobSchedule.objects.using(_alias())
    if lock:
        queryset = queryset.select_for_update()
    try:
        return queryset.get(name=name)
    except JobSchedule.DoesNotExist:
        raise ScheduleNotFoundError(f"No schedule named {name!r}.") from None


def _refuse_code(schedule: JobSchedule, verb: str) -> None:
    if schedule.is_code:
        raise ScheduleError(
            f"Schedule {schedule.name!r} is declared in code (@job_handler on "
            f"{schedule.job_type!r}); {verb} it there: a runtime change would be undone by the "
            "next runner start. Pausing and resuming it is fine."
        )


# ----------------------------------------------------------------------------- runtime API
def add_schedule(
    name: str, job_type: str, *, cron: str | None = None,
    interval: timedelta | float | None = None, payload: Any = None, timezone: str | None = None,
    queue: str | None = None, priority: int | None = None, tenant: str | None = None,
    paused: bool = False,
) -> JobSchedule:
    """Store a new schedule; its first run is due at the next tick after the database's now.

    Joins the caller's transaction. ``name`` must be unique; runs use it as their dedup key, so
    the handler's dedup strategy decides what a tick does while the previous run is active.
    """
    _check_name(name)
    if not isinstance(paused, bool):
        raise ScheduleError(f"paused must be True or False, got {bounds.show(paused)}.")
    definition = validate_definition(
        job_type, cron=cron, interval=interval, payload=payload, timezone=timezone, queue=queue,
        priority=priority, tenant=tenant,
    )
    alias = _alias()
    try:
        with transaction.atomic(using=alias):
            now = db_now()
            schedule = JobSchedule.objects.using(alias).create(
                name=name, job_type=definition.job_type, cron=definition.cron,
                interval_seconds=definition.interval_seconds, timezone=definition.timezone,
                payload=definition.payload, queue=definition.queue,
                priority=definition.priority, tenant=definition.tenant,
                source=ScheduleSource.DATABASE,
                paused=bool(paused), next_run_at=definition.timing.first_after(now),
            )
    except IntegrityError:
        raise ScheduleError(f"A schedule named {name!r} already exists.") from None
    logger.info("schedule %s added: %s, next run %s", name, schedule.describe(),
                schedule.next_run_at.isoformat() if schedule.next_run_at else "-",
                extra={"event": "schedule_added", "schedule": name, "job_type": job_type})
    return _get(name)


def update_schedule(name: str, **changes: Any) -> JobSchedule:
    """Change a runtime schedule: any of job_type, cron, interval, payload, timezone, queue,
    priority, tenant. Giving ``cron`` switches an interval schedule to cron and vice versa. A
    timing change moves ``next_run_at`` to the new definition's next tick after now."""
    unknown = set(changes) - set(_UPDATABLE)
    if unknown:
        raise ScheduleError(f"update_schedule got unknown fields {sorted(unknown)}; "
                            f"changeable: {list(_UPDATABLE)}.")
    _check_name(name)
    _check_changes(changes)
    alias = _alias()
    with transaction.atomic(using=alias):
        schedule = _get(name, lock=True)
        _refuse_code(schedule, "change")
        current: dict[str, Any] = {
            "job_type": schedule.job_type, "payload": schedule.payload,
            "timezone": schedule.timezone, "queue": schedule.queue,
            "priority": schedule.priority, "cron": schedule.cron,
            "interval": schedule.interval_seconds, "tenant": schedule.tenant,
        }
        if "cron" in changes and "interval" not in changes and changes["cron"] is not None:
            current["interval"] = None
        if "interval" in changes and "cron" not in changes and changes["interval"] is not None:
            current["cron"] = None
        current.update(changes)
        definition = validate_definition(**current)
        values: dict[str, Any] = {
            "job_type": definition.job_type, "cron": definition.cron,
            "interval_seconds": definition.interval_seconds, "timezone": definition.timezone,
            "payload": definition.payload, "queue": definition.queue,
            "priority": definition.priority, "tenant": definition.tenant,
            # Editing a schedule the system had stopped (handler missing, invalid) is the
            # operator fixing it: the validation above just proved it usable again.
            "active": True, "inactive_reason": InactiveReason.NONE,
        }
        if definition.timing != Timing.of(schedule) or not schedule.active:
            values["next_run_at"] = definition.timing.first_after(db_now())
        JobSchedule.objects.using(alias).filter(pk=schedule.pk).update(
            **values, updated_at=Now())
        schedule = _get(name)
    logger.info("schedule %s updated: %s", name, schedule.describe(),
                extra={"event": "schedule_updated", "schedule": name})
    return schedule


def remove_schedule(name: str) -> None:
    """Delete a runtime schedule. Its past runs stay (they carry the name in ``schedule``)."""
    _check_name(name)
    with transaction.atomic(using=_alias()):
        schedule = _get(name, lock=True)
        _refuse_code(schedule, "remove")
        schedule.delete(using=_alias())
    logger.info("schedule %s removed", name, extra={"event": "schedule_removed",
                                                    "schedule": name})


def pause_schedule(name: str) -> JobSchedule:
    """Stop firing until resumed. A run already enqueued or running is not touched."""
    _check_name(name)
    updated = JobSchedule.objects.using(_alias()).filter(name=name).update(
        paused=True, updated_at=Now())
    if not updated:
        raise ScheduleNotFoundError(f"No schedule named {name!r}.")
    logger.info("schedule %s paused", name, extra={"event": "schedule_paused", "schedule": name})
    return _get(name)


def resume_schedule(name: str) -> JobSchedule:
    """Fire again from the next tick after now: ticks that passed while paused are skipped
    (pausing was deliberate), unlike ticks missed while no runner was up, which coalesce."""
    _check_name(name)
    alias = _alias()
    with transaction.atomic(using=alias):
        schedule = _get(name, lock=True)
        now = db_now()
        timing = Timing.of(schedule)
        if schedule.next_run_at is None or schedule.next_run_at <= now:
            schedule.next_run_at = timing.next_after(now, anchor=schedule.next_run_at)
        JobSchedule.objects.using(alias).filter(pk=schedule.pk).update(
            paused=False, next_run_at=schedule.next_run_at, updated_at=Now())
    logger.info("schedule %s resumed; next run %s", name, schedule.next_run_at,
                extra={"event": "schedule_resumed", "schedule": name})
    return _get(name)


def run_schedule_now(name: str) -> PersistentJob:
    """Enqueue one run now, outside the tick grid (``schedule.trigger`` is ``"manual"``).

    The handler's dedup strategy applies as for a tick: with Skip and a run still active, that
    run is returned and nothing is inserted (the schedule's last result says ``skipped``).
    Works on a paused schedule; ``next_run_at`` is not changed.
    """
    _check_name(name)
    alias = _alias()
    with transaction.atomic(using=alias):
        schedule = _get(name, lock=True)
        now = db_now()
        job, result, error = insert_run(schedule, tick=None, coalesced=0, fired_by="operator")
        record_result(schedule, now, job, result, error)
    if job is None:
        raise ScheduleError(f"Schedule {name!r} could not enqueue a run: {error}")
    return job


# ----------------------------------------------------------------------------- firing
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
    try:
        with transaction.atomic(using=alias):
            job, created = enqueue_scheduled_run(
                schedule.job_type, schedule.payload, schedule=info, dedup_key=schedule.name,
                queue=schedule.queue, priority=schedule.priority, tenant=schedule.tenant,
            )
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


def _code_definition(spec: HandlerSpec) -> Definition:
    interval = spec.interval.total_seconds() if spec.interval is not None else None
    stored, _ = prepare_payload({} if spec.schedule_payload is None else spec.schedule_payload)
    if spec.validator is not None:
        spec.validator(stored)
    return Definition(spec.job_type, spec.cron, interval, spec.timezone or default_timezone(),
                      stored, None, None, spec.tenant)


def sync_code_schedules() -> SyncReport:
    """Make the table match the schedules declared with ``@job_handler`` in this process.

    Upserts each declared schedule (a changed timing restarts it from the next tick; an unchanged
    one keeps its ``next_run_at``, so a deploy neither skips nor repeats a run). Code schedules
    no longer declared are deactivated, and so are runtime schedules whose job type has no
    handler here: a schedule without a handler would only fill the dead letters. Those come back
    by themselves once a runner with the handler starts. With ``ALLOW_UNREGISTERED`` (another
    service runs some job types) schedules of unknown types are left alone.
    """
    report = SyncReport()
    alias = _alias()
    known = set(registry.job_types())
    allow_unknown = conf.settings.ALLOW_UNREGISTERED
    declared = {spec.job_type: spec for spec in registry if spec.is_recurring}
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", [_SYNC_LOCK_KEY])
        now = db_now()
        existing = {s.name: s for s in JobSchedule.objects.using(alias)}
        for name, spec in declared.items():
            if spec.errors:
                continue  # the system check reports it; the runner refuses to start
            _sync_one(name, spec, existing.get(name), now, report)
        for schedule in existing.values():
            _check_handler(schedule, declared, known, allow_unknown, now, report)
    for name in report.created + report.updated:
        logger.info("schedule %s synced from code", name,
                    extra={"event": "schedule_synced", "schedule": name})
    return report


def _sync_one(name: str, spec: HandlerSpec, row: JobSchedule | None, now: datetime,
              report: SyncReport) -> None:
    alias = _alias()
    try:
        definition = _code_definition(spec)
    except Exception as exc:
        message = f"the schedule payload of {name!r} is unusable: {exc}"
        logger.error("schedule %s: %s", name, message,
                     extra={"event": "schedule_invalid", "schedule": name})
        if row is not None and row.is_code:
            JobSchedule.objects.using(alias).filter(pk=row.pk).update(
                active=False, inactive_reason=InactiveReason.INVALID, last_error=message,
                updated_at=Now())
        return
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
            return
    if not row.is_code:
        report.conflicts.append(name)
        logger.warning(
            "schedule %s is declared in code on %s, but a runtime schedule with that name "
            "exists; the runtime one stays in charge until it is removed", name, spec.origin,
            extra={"event": "schedule_conflict", "schedule": name})
        return
    values: dict[str, Any] = {}
    for column in ("job_type", "cron", "interval_seconds", "timezone", "payload", "queue",
                   "priority", "tenant"):
        if getattr(row, column) != getattr(definition, column):
            values[column] = getattr(definition, column)
    if not row.active:
        values.update(active=True, inactive_reason=InactiveReason.NONE, last_error="")
        report.reactivated.append(name)
    if Timing.of(row) != definition.timing or not row.active or row.next_run_at is None:
        values["next_run_at"] = definition.timing.first_after(now)
    if values:
        JobSchedule.objects.using(alias).filter(pk=row.pk).update(**values, updated_at=Now())
        report.updated.append(name)


def _check_handler(schedule: JobSchedule, declared: dict[str, HandlerSpec], known: set[str],
                   allow_unknown: bool, now: datetime, report: SyncReport) -> None:
    alias = _alias()
    has_handler = schedule.job_type in known
    if schedule.is_code:
        if schedule.name in declared or not schedule.active:
            return
        if not has_handler and allow_unknown:
            return  # another service may declare it
        reason = InactiveReason.REMOVED_FROM_CODE if has_handler else (
            InactiveReason.HANDLER_MISSING)
    elif schedule.active and not has_handler and not allow_unknown:
        reason = InactiveReason.HANDLER_MISSING
    elif (not schedule.active and has_handler
          and schedule.inactive_reason == InactiveReason.HANDLER_MISSING):
        timing = Timing.of(schedule)
        JobSchedule.objects.using(alias).filter(pk=schedule.pk).update(
            active=True, inactive_reason=InactiveReason.NONE,
            next_run_at=timing.next_after(now, anchor=schedule.next_run_at), updated_at=Now())
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

