"""Recurring schedules.

- ``timing``: cron and interval arithmetic in a time zone (pure functions, no database);
- ``definition``: validating a schedule definition into its stored form;
- ``services``: the public runtime API (add, update, remove, pause, resume, run now), which the
  admin also calls;
- ``firing``: what the runner's scheduler loop calls (insert a tick's run, record its result,
  sync the schedules declared in code).

The schedules table itself is ``django_persistent_jobs.models.JobSchedule``. The timing names
are imported eagerly (``@job_handler`` checks cron expressions at import time, before the app
registry is ready); the services, which need the models, lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_getattr
from ..errors import ScheduleError, ScheduleNotFoundError
from .timing import (
    HasTiming,
    Timing,
    cron_problem,
    default_timezone,
    interval_problem,
    next_cron_tick,
    next_interval_tick,
    next_tick,
    tick_label,
    timezone_problem,
)

_LAZY = {
    "add_schedule": ".services",
    "update_schedule": ".services",
    "remove_schedule": ".services",
    "pause_schedule": ".services",
    "resume_schedule": ".services",
    "run_schedule_now": ".services",
}

__all__ = [
    "HasTiming",
    "ScheduleError",
    "ScheduleNotFoundError",
    "Timing",
    "add_schedule",
    "cron_problem",
    "default_timezone",
    "interval_problem",
    "next_cron_tick",
    "next_interval_tick",
    "next_tick",
    "pause_schedule",
    "remove_schedule",
    "resume_schedule",
    "run_schedule_now",
    "tick_label",
    "timezone_problem",
    "update_schedule",
]

if TYPE_CHECKING:
    from .services import (
        add_schedule,
        pause_schedule,
        remove_schedule,
        resume_schedule,
        run_schedule_now,
        update_schedule,
    )


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
