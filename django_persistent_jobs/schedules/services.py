"""Recurring schedules at runtime: add, change, pause, resume, remove and "run now".

This is the one implementation the admin and the Python API share, so a schedule behaves the
same however it was touched. Every function validates its whole input before writing anything
and raises ``ScheduleError`` (a ``ValueError``) with a message that says what to fix.

Schedules declared in code (``@job_handler(..., cron=...)``) are written into the same table by
the runner (``firing.sync_code_schedules``). They can be paused, resumed and run now at
runtime, but not changed or removed there: the runners' next sync would silently put them
back. Change the decorator instead. Only once no live runner's code declares one any more (the
sync switched it off) can it be removed, for example to reuse its name.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from .. import bounds
from ..errors import ScheduleError, ScheduleNotFoundError
from ..models import InactiveReason, JobSchedule, PersistentJob, ScheduleSource
from .definition import (
    _alias,
    _check_changes,
    _check_name,
    db_now,
    validate_definition,
)
from .firing import insert_run, record_result
from .timing import Timing

logger = logging.getLogger("django_persistent_jobs.scheduler")

__all__ = [
    "ScheduleError",
    "ScheduleNotFoundError",
    "add_schedule",
    "pause_schedule",
    "remove_schedule",
    "resume_schedule",
    "run_schedule_now",
    "update_schedule",
]

_UPDATABLE = ("job_type", "cron", "interval", "payload", "timezone", "queue", "priority",
              "tenant")


def _get(name: str, *, lock: bool = False) -> JobSchedule:
    _check_name(name)
    queryset = JobSchedule.objects.using(_alias())
    if lock:
        queryset = queryset.select_for_update()
    try:
        return queryset.get(name=name)
    except JobSchedule.DoesNotExist:
        raise ScheduleNotFoundError(f"No schedule named {name!r}.") from None


#: Why a sync switched a code schedule off because the code no longer has it: such a row is
#: left over, and removing it (to free its name for a runtime schedule) undoes nothing.
_GONE_FROM_CODE = (InactiveReason.REMOVED_FROM_CODE, InactiveReason.HANDLER_MISSING)


def gone_from_code(schedule: JobSchedule) -> bool:
    """Whether a code schedule was switched off because no live runner's code has it any more:
    it may be removed (``remove_schedule``, the admin's delete)."""
    return (schedule.is_code and not schedule.active
            and schedule.inactive_reason in _GONE_FROM_CODE)


def _refuse_code(schedule: JobSchedule, verb: str) -> None:
    if not schedule.is_code or (verb == "remove" and gone_from_code(schedule)):
        return
    raise ScheduleError(
        f"Schedule {schedule.name!r} is declared in code (@job_handler on "
        f"{schedule.job_type!r}); {verb} it there: a runtime change would be undone by the "
        "runners' next sync. Pausing and resuming it is fine; once no runner's code declares "
        "it any more (it shows as deactivated), it can be removed."
    )


# ----------------------------------------------------------------------------- runtime API
#: Why schedules refuse to work without time zone support (the check, the services, the loop).
NEED_USE_TZ = ("Recurring schedules need USE_TZ = True: their ticks are computed in aware "
               "time (zones, DST), and with USE_TZ = False the database's times are naive.")


def require_aware_times() -> None:
    """Refuse to store or fire a schedule when Django's times are naive (``USE_TZ = False``)."""
    from django.conf import settings

    if not settings.USE_TZ:
        raise ScheduleError(NEED_USE_TZ)


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
    require_aware_times()
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
    require_aware_times()
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
        if not definition.timing.same_ticks(Timing.of(schedule)) or not schedule.active:
            values["next_run_at"] = definition.timing.first_after(db_now())
        JobSchedule.objects.using(alias).filter(pk=schedule.pk).update(
            **values, updated_at=Now())
        schedule = _get(name)
    logger.info("schedule %s updated: %s", name, schedule.describe(),
                extra={"event": "schedule_updated", "schedule": name})
    return schedule


def remove_schedule(name: str) -> None:
    """Delete a runtime schedule, or a code one no runner declares any more. Its past runs stay
    (they carry the name in ``schedule``)."""
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
        if not schedule.paused:
            # Nothing to resume: moving a due tick (one waiting for a runner, to coalesce)
            # past now would drop it.
            return schedule
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
