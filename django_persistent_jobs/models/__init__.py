"""The app's tables, one module per table: ``jobs``, ``attempts``, ``runners``, ``schedules``.

The runner's hot paths (claim, complete, fail, rescue) use hand-written SQL in ``runner/store.py``
against these tables; the ORM models exist for the admin, the operator services and users' own
queries. Column names are therefore part of the contract with that SQL.

``ApiToken`` belongs to the HTTP API (``api/tokens.py``, kept import-light for this); it is
imported here because Django finds an app's models in its ``models`` module.
"""

from ..api.tokens import ApiToken
from .attempts import AttemptOutcome, JobAttempt
from .jobs import (
    DEDUP_ENFORCED,
    JOB_COLUMNS,
    JOB_COLUMNS_SQL,
    RUNNING_DEDUP,
    WAITING_DEDUP,
    JobDashboard,
    JobStatus,
    PersistentJob,
    PersistentJobQuerySet,
    due,
    held_by_dedup,
    job_from_row,
)
from .runners import JobRunnerRecord
from .schedules import InactiveReason, JobSchedule, ScheduleSource, TickResult

__all__ = [
    "DEDUP_ENFORCED",
    "JOB_COLUMNS",
    "JOB_COLUMNS_SQL",
    "RUNNING_DEDUP",
    "WAITING_DEDUP",
    "ApiToken",
    "AttemptOutcome",
    "InactiveReason",
    "JobAttempt",
    "JobDashboard",
    "JobRunnerRecord",
    "JobSchedule",
    "JobStatus",
    "PersistentJob",
    "PersistentJobQuerySet",
    "ScheduleSource",
    "TickResult",
    "due",
    "held_by_dedup",
    "job_from_row",
]
