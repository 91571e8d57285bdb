"""django-persistent-jobs: PostgreSQL-backed persistent jobs for Django.

The public names are imported lazily: this package is listed in ``INSTALLED_APPS``, so importing
it must not touch models before the app registry is ready. No submodule shares its name with a
public export (``enqueue`` lives in ``enqueuing``, ``registry`` in ``handlers``): importing a
submodule sets a package attribute of its name, which would shadow the export.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_getattr

__version__ = "0.1.0.dev0"

_EXPORTS = {
    "enqueue": ".enqueuing",
    "enqueue_many": ".enqueuing",
    "enqueue_as_tenant": ".enqueuing",
    "job_handler": ".handlers",
    "JobHandler": ".handlers",
    "registry": ".handlers",
    "JobContext": ".context",
    "JobError": ".errors",
    "TransientJobError": ".errors",
    "PermanentJobError": ".errors",
    "JobCancelledError": ".errors",
    "EnqueueError": ".errors",
    "DedupKeyTakenError": ".errors",
    "PayloadError": ".errors",
    "UnknownJobTypeError": ".errors",
    "PreparedStatementLostError": ".errors",
    "ConfigurationError": ".errors",
    "InvalidJobStateError": ".errors",
    "JobNotFoundError": ".errors",
    "Dedup": ".types",
    "retry_job": ".services",
    "cancel_job": ".services",
    "Runner": ".runner",
    "add_schedule": ".schedules.services",
    "update_schedule": ".schedules.services",
    "remove_schedule": ".schedules.services",
    "pause_schedule": ".schedules.services",
    "resume_schedule": ".schedules.services",
    "run_schedule_now": ".schedules.services",
    "ScheduleError": ".errors",
    "ScheduleNotFoundError": ".errors",
    "next_tick": ".schedules.timing",
}

__all__ = [
    "ConfigurationError",
    "Dedup",
    "DedupKeyTakenError",
    "EnqueueError",
    "InvalidJobStateError",
    "JobCancelledError",
    "JobContext",
    "JobError",
    "JobHandler",
    "JobNotFoundError",
    "PayloadError",
    "PermanentJobError",
    "PreparedStatementLostError",
    "Runner",
    "ScheduleError",
    "ScheduleNotFoundError",
    "TransientJobError",
    "UnknownJobTypeError",
    "add_schedule",
    "cancel_job",
    "enqueue",
    "enqueue_as_tenant",
    "enqueue_many",
    "job_handler",
    "next_tick",
    "pause_schedule",
    "registry",
    "remove_schedule",
    "resume_schedule",
    "retry_job",
    "run_schedule_now",
    "update_schedule",
]

if TYPE_CHECKING:
    from .context import JobContext
    from .enqueuing import enqueue, enqueue_as_tenant, enqueue_many
    from .errors import (
        ConfigurationError,
        DedupKeyTakenError,
        EnqueueError,
        InvalidJobStateError,
        JobCancelledError,
        JobError,
        JobNotFoundError,
        PayloadError,
        PermanentJobError,
        PreparedStatementLostError,
        ScheduleError,
        ScheduleNotFoundError,
        TransientJobError,
        UnknownJobTypeError,
    )
    from .handlers import JobHandler, job_handler, registry
    from .runner import Runner
    from .schedules.services import (
        add_schedule,
        pause_schedule,
        remove_schedule,
        resume_schedule,
        run_schedule_now,
        update_schedule,
    )
    from .schedules.timing import next_tick
    from .services import cancel_job, retry_job
    from .types import Dedup


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
