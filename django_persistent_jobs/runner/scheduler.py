"""Recurring scheduler loop: turns due schedule ticks into job rows, once per tick.

Every runner runs this loop; none is a leader. Each pass is one short transaction:

1. ``SELECT ... FROM persistent_jobs_schedules WHERE active AND NOT paused AND next_run_at <=
   now() FOR UPDATE SKIP LOCKED``: a due schedule is locked by exactly one runner; the others
   skip it without waiting, and once the winner commits the row is no longer due for them
   (PostgreSQL re-checks the condition on the row's newest version before locking it).
2. Insert the run as a new ``persistent_jobs`` row through the enqueue path, labelled with its
   tick; a unique index on ``(schedule->>'name', schedule->>'tick')`` refuses a second run for a
   tick even if everything above went wrong.
3. Advance ``next_run_at`` to the first tick strictly after the database's ``now()``: however
   many ticks passed while no runner was up, they coalesce into this one run.

A schedule whose definition cannot be computed is deactivated with its error; any other error in
one schedule is recorded on it and the schedule moves on, so one bad schedule can neither stop
the others nor make the scheduler spin on it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import ProgrammingError, connections, transaction

from .. import conf
from ..errors import ConfigurationError
from ..handlers import registry
from .db import is_connection_error, run_with_retry

if TYPE_CHECKING:
    from ..models import JobSchedule
    from .lifecycle import Lifecycle

logger = logging.getLogger("django_persistent_jobs.scheduler")

#: Schedules fired per transaction; more due ones are fired by the next pass right away.
BATCH = 50
#: Shortest sleep between passes, so a tick that is due "now" is not polled in a busy loop.
MIN_SLEEP = 0.005
#: The shortest wait when a schedule is due but was not fired by the pass just made: another
#: session holds its row (another runner's pass, or ``update_schedule``/``run_schedule_now``
#: inside a caller's long transaction). Without it every runner would open a transaction every
#: ``MIN_SLEEP`` until that lock is released.
DUE_BUT_HELD_SLEEP = 0.1

_DUE_SQL = """
SELECT id, now() FROM persistent_jobs_schedules
WHERE active AND NOT paused AND next_run_at <= now() {types}
ORDER BY next_run_at
LIMIT %s
FOR UPDATE SKIP LOCKED
"""
_NEXT_DUE_SQL = """
SELECT EXTRACT(EPOCH FROM (min(next_run_at) - clock_timestamp()))::float8
FROM persistent_jobs_schedules WHERE active AND NOT paused {types}
"""


@dataclass
class PassReport:
    """What one pass did; ``next_due_in`` is seconds until the earliest future tick."""

    enqueued: int = 0
    skipped: int = 0
    errors: int = 0
    more: bool = False
    next_due_in: float | None = None


def _type_filter() -> tuple[str, list[Any]]:
    """Only fire schedules this process has a handler for (unless ALLOW_UNREGISTERED): during a
    rolling deploy an old runner leaves a new schedule to the runners that can run it."""
    if conf.settings.ALLOW_UNREGISTERED:
        return "", []
    return "AND job_type = ANY(%s)", [registry.job_types()]


def fire_due(runner_id: str | None = None, limit: int = BATCH) -> PassReport:
    """Fire every due schedule this process may fire (up to ``limit``) in one transaction."""
    from ..models import JobSchedule

    alias = conf.settings.DATABASE
    report = PassReport()
    types_sql, types_params = _type_filter()
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(_DUE_SQL.format(types=types_sql), [*types_params, limit])
        rows = cursor.fetchall()
        if rows:
            now: datetime = rows[0][1]
            locked = JobSchedule.objects.using(alias).in_bulk([r[0] for r in rows])
            for schedule in sorted(locked.values(), key=lambda s: (s.next_run_at, s.pk)):
                _fire_one(schedule, now, runner_id, report)
            report.more = len(rows) == limit
        cursor.execute(_NEXT_DUE_SQL.format(types=types_sql), types_params)
        row = cursor.fetchone()
        report.next_due_in = None if row is None or row[0] is None else float(row[0])
    return report


def _fire_one(schedule: JobSchedule, now: datetime, runner_id: str | None,
              report: PassReport) -> None:
    from ..schedules.firing import deactivate_invalid, insert_run, record_result
    from ..schedules.timing import UNCOMPUTABLE, Timing

    tick = schedule.next_run_at
    assert tick is not None  # the due query only returns rows with a next_run_at
    try:
        timing = Timing.of(schedule)
        next_run_at = timing.next_after(now, anchor=tick)
        coalesced = timing.count_ticks(tick, now)
    except UNCOMPUTABLE as exc:
        report.errors += 1
        deactivate_invalid(schedule, f"cannot compute the next tick: {exc}")
        return
    try:
        job, result, error = insert_run(schedule, tick=tick, coalesced=coalesced,
                                        fired_by=runner_id)
    except Exception as exc:
        if is_connection_error(exc):
            raise  # the transaction is gone; the whole pass is retried
        logger.exception("schedule %s: inserting the run for tick %s failed", schedule.name,
                         tick, extra={"event": "schedule_error", "schedule": schedule.name})
        job, result, error = None, "error", f"{type(exc).__name__}: {exc}"
    record_result(schedule, now, job, result, error, next_run_at=next_run_at)
    extra = {"event": f"schedule_{result}", "schedule": schedule.name,
             "job_type": schedule.job_type, "tick": tick.isoformat(),
             "next_run_at": next_run_at.isoformat(), "coalesced_ticks": coalesced,
             "job_id": str(job.id) if job is not None else None, "runner_id": runner_id}
    if result == "enqueued":
        report.enqueued += 1
        logger.info("schedule %s: tick %s -> job %s%s; next %s", schedule.name, tick.isoformat(),
                    job.id if job else "-",
                    f" (coalesced {coalesced} missed tick(s))" if coalesced else "",
                    next_run_at.isoformat(), extra=extra)
    elif result == "skipped":
        report.skipped += 1
        logger.info("schedule %s: tick %s skipped (%s); next %s", schedule.name,
                    tick.isoformat(), error or f"run {job.id if job else '-'} still active",
                    next_run_at.isoformat(), extra=extra)
    else:
        report.errors += 1
        logger.error("schedule %s: tick %s could not enqueue a run: %s; next %s",
                     schedule.name, tick.isoformat(), error, next_run_at.isoformat(), extra=extra)


def scheduler_loop(alias: str, runner_id: str, interval: float, lifecycle: Lifecycle,
                   burst: bool = False, resync_interval: float | None = None) -> None:
    """Sync code-declared schedules, then fire due ticks until the runner stops.

    It sleeps until the earliest next tick, at most ``interval`` (``SCHEDULER_INTERVAL``: a
    schedule added or resumed meanwhile is noticed within that). With ``burst`` it fires what is
    due once and ends. A pass that enqueued runs sets ``lifecycle.wake``. The sync is repeated
    every ``resync_interval`` seconds (``STALE_LOCK_TIMEOUT``, how soon the fleet notices a runner
    gone): when the runner whose code declared a schedule stops, the declarations of the runners
    left take over (``schedules.firing.Fleet``), so a fleet converges on its code after a deploy.
    """
    stopping = lifecycle.stopping
    from django.conf import settings

    if not settings.USE_TZ:
        # (``manage.py check`` refuses a recurring handler then: persistent_jobs.E104.) Rows
        # stored before USE_TZ was turned off are left alone, not fired into an error each.
        from ..schedules.services import NEED_USE_TZ

        logger.error("schedules are not fired: %s", NEED_USE_TZ,
                     extra={"event": "scheduler_disabled", "runner_id": runner_id})
        return
    if not _sync(alias, runner_id, stopping):
        return
    resync_every = conf.settings.STALE_LOCK_TIMEOUT if resync_interval is None else (
        resync_interval)
    resync_at = time.monotonic() + resync_every
    while not stopping.is_set():
        if not burst and time.monotonic() >= resync_at:
            if not _sync(alias, runner_id, stopping):
                return
            resync_at = time.monotonic() + resync_every
        report = run_with_retry(alias, lambda cursor: fire_due(runner_id),
                                what="firing due schedules", interrupt=stopping)
        if report is None:
            return
        if report.enqueued:
            lifecycle.wake.set()  # NOTIFY wakes claimers anywhere; this skips the round trip
        if report.more:
            continue  # (a burst too fires every schedule due when it starts, not one page)
        if burst:
            return
        wait = min(interval, max(resync_at - time.monotonic(), MIN_SLEEP))
        if report.next_due_in is not None:
            # (Measured with the clock at the query, not at the pass's start: a long pass
            # must not make the loop sleep past a tick.)
            wait = min(wait, max(report.next_due_in, MIN_SLEEP) if report.next_due_in > 0
                       else DUE_BUT_HELD_SLEEP)
        stopping.wait(wait)


def _sync(alias: str, runner_id: str, stopping: threading.Event) -> bool:
    """Sync the code's schedules; False when the runner stopped meanwhile."""
    from ..schedules.firing import sync_code_schedules

    try:
        synced = run_with_retry(alias, lambda cursor: sync_code_schedules(runner_id),
                                what="syncing code-declared schedules", interrupt=stopping)
    except ProgrammingError as exc:
        raise ConfigurationError(
            "The persistent_jobs_schedules table is missing; run `python manage.py migrate` "
            f"(django_persistent_jobs 0003), or start the runner with --no-scheduler ({exc})."
        ) from exc
    return synced is not None
