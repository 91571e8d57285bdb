"""The schedules table: one row per recurring schedule, declared in code or added at runtime.

A schedule never *is* a job: each tick inserts a new ``persistent_jobs`` row (so each run keeps
its own history), and ``next_run_at`` here says when the next one is due. Exactly one run per
tick is enforced by the database: the scheduler locks a due row with ``FOR UPDATE SKIP LOCKED``
and advances ``next_run_at`` in the same transaction as the insert, and a unique index on the
runs' ``(schedule->>'name', schedule->>'tick')`` (migration 0003) refuses a second run for a tick
whatever happens.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from ..schedules.timing import Timing


class ScheduleSource(models.TextChoices):
    CODE = "code", "Declared in code"
    DATABASE = "database", "Added at runtime"


class TickResult(models.TextChoices):
    """What the last tick (or "run now") did."""

    ENQUEUED = "enqueued", "Enqueued a run"
    SKIPPED = "skipped", "Skipped: previous run still active"
    ERROR = "error", "Error (see last error)"


class InactiveReason(models.TextChoices):
    """Why the system (not an operator: that is ``paused``) stopped a schedule."""

    NONE = "", "-"
    HANDLER_MISSING = "handler_missing", "No handler for its job type"
    REMOVED_FROM_CODE = "removed_from_code", "No longer declared in code"
    INVALID = "invalid", "Definition unusable (see last error)"


class JobSchedule(models.Model):
    """A recurring schedule. ``active`` is the system's switch, ``paused`` the operator's."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(
        max_length=200, unique=True,
        help_text="Unique; a code-declared schedule is named after its job type. Runs use it as "
                  "their dedup key.",
    )
    job_type = models.CharField(max_length=200)
    cron = models.CharField(
        max_length=200, null=True, blank=True,
        help_text="5 fields (minute hour day month weekday), or 6 with seconds last.",
    )
    interval_seconds = models.FloatField(null=True, blank=True)
    timezone = models.CharField(
        max_length=64, help_text="IANA zone the cron expression is read in (intervals ignore it).",
    )
    payload = models.JSONField(default=dict, blank=True)
    queue = models.CharField(
        max_length=100, null=True, blank=True, help_text="Empty: the handler's queue.",
    )
    priority = models.SmallIntegerField(
        null=True, blank=True, help_text="Empty: the handler's priority.",
    )
    tenant = models.CharField(
        max_length=200, null=True, blank=True, help_text="Tenant given to every run it enqueues.",
    )
    source = models.CharField(
        max_length=10, choices=ScheduleSource.choices, default=ScheduleSource.DATABASE,
        db_default=ScheduleSource.DATABASE,
    )
    active = models.BooleanField(default=True, db_default=True)
    inactive_reason = models.CharField(
        max_length=20, choices=InactiveReason.choices, blank=True, default="", db_default="",
    )
    paused = models.BooleanField(default=False, db_default=False)
    next_run_at = models.DateTimeField(null=True, blank=True)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_job_id = models.UUIDField(
        null=True, blank=True,
        help_text="The run the last tick enqueued, or the active run that made it skip. Not a "
                  "foreign key: cleanup may delete old runs.",
    )
    last_result = models.CharField(
        max_length=10, choices=TickResult.choices, blank=True, default="", db_default="",
    )
    last_error = models.TextField(blank=True, default="", db_default="")
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "persistent_jobs_schedules"
        verbose_name = "job schedule"
        ordering = ["name"]
        indexes = [
            # The scheduler's only query: due, active, unpaused rows in next_run_at order.
            models.Index(
                fields=["next_run_at"], name="pj_schedule_due_idx",
                condition=Q(active=True) & Q(paused=False),
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=(Q(cron__isnull=False) & Q(interval_seconds__isnull=True))
                | (Q(cron__isnull=True) & Q(interval_seconds__isnull=False)),
                name="pj_schedule_cron_xor_interval",
            ),
            models.CheckConstraint(
                condition=Q(interval_seconds__isnull=True) | Q(interval_seconds__gt=0),
                name="pj_schedule_interval_positive",
            ),
            models.CheckConstraint(
                condition=Q(source__in=ScheduleSource.values), name="pj_schedule_source_valid",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_code(self) -> bool:
        return self.source == ScheduleSource.CODE

    def describe(self) -> str:
        """``cron 0 2 * * * (Europe/Berlin)`` or ``every 30s``."""
        return Timing.of(self).describe()
