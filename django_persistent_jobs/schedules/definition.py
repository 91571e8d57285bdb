"""Schedule definitions: validation and the stored form, shared by the public services, the
admin form and the code-schedule sync, so a schedule is checked the same way however it is
written. Every check raises ``ScheduleError`` with a message that says what to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections

from .. import bounds, conf
from ..errors import EnqueueError
from ..handlers import HandlerSpec, registry
from ..payload import prepare_payload
from .timing import (
    ScheduleError,
    Timing,
    cron_problem,
    default_timezone,
    interval_problem,
    timezone_problem,
)


def _alias() -> str:
    return conf.settings.DATABASE


def db_now() -> datetime:
    """The database clock: due-ness is decided by PostgreSQL, never by this host's clock.

    ``clock_timestamp()``, not ``now()``: called inside a long transaction (``add_schedule`` in
    the caller's ``atomic()``), the transaction's start would put a first tick in the past by
    the time it commits, and it would fire at once."""
    with connections[_alias()].cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        row = cursor.fetchone()
    value: datetime = row[0]
    return value


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
