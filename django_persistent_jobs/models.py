"""The tables: jobs, one row per attempt, and live runners.

The runner's hot paths (claim, complete, fail, rescue) use hand-written SQL in ``runner/store.py``
against these tables; the ORM models exist for the admin, the operator services and users' own
queries. Column names are therefore part of the contract with that SQL.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from .ids import uuid7
from .types import Dedup


class JobStatus(models.TextChoices):
    """A job's lifecycle. ``failed`` means "an attempt failed and a retry is due at next_run_at"."""

    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed (retry scheduled)"
    DEAD_LETTERED = "dead_lettered", "Dead-lettered"
    CANCELLED = "cancelled", "Cancelled"

    @classmethod
    def terminal(cls) -> tuple[str, ...]:
        return (cls.COMPLETED, cls.DEAD_LETTERED, cls.CANCELLED)

    @classmethod
    def waiting(cls) -> tuple[str, ...]:
        """Statuses a runner may claim once ``next_run_at`` is due."""
        return (cls.PENDING, cls.FAILED)

    @classmethod
    def active(cls) -> tuple[str, ...]:
        return (cls.PENDING, cls.FAILED, cls.RUNNING)


class AttemptOutcome(models.TextChoices):
    RUNNING = "running", "Running"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed (will retry)"
    DEAD_LETTERED = "dead_lettered", "Failed (dead-lettered)"
    TIMED_OUT = "timed_out", "Timed out"
    RESCUED = "rescued", "Runner lost; rescued"
    INTERRUPTED = "interrupted", "Handed back at shutdown"
    CANCELLED = "cancelled", "Cancelled"


WAITING_DEDUP = (
    Q(status__in=["pending", "failed"]) & Q(dedup_key__isnull=False) & ~Q(dedup="enqueue")
)


class PersistentJob(models.Model):
    """One unit of work. Recurring schedules insert a new row per run, so history is kept."""

    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    job_type = models.CharField(max_length=200)
    payload = models.JSONField(default=dict)
    status = models.CharField(
        max_length=20, choices=JobStatus.choices, default=JobStatus.PENDING,
        db_default=JobStatus.PENDING,
    )
    schedule = models.JSONField(null=True, blank=True)
    queue = models.CharField(max_length=100, default="default", db_default="default")
    priority = models.SmallIntegerField(default=0, db_default=0)
    attempts = models.PositiveIntegerField(default=0, db_default=0)
    max_retries = models.PositiveIntegerField(default=3)
    next_run_at = models.DateTimeField(db_default=Now())
    locked_by = models.CharField(max_length=200, null=True, blank=True)
    locked_at = models.DateTimeField(null=True, blank=True)
    lock_token = models.BigIntegerField(
        null=True, blank=True,
        help_text="Fencing token: the id of the attempt that owns the job while it runs.",
    )
    timeout_seconds = models.FloatField(null=True, blank=True)
    dedup_key = models.CharField(max_length=255, null=True, blank=True)
    dedup = models.CharField(
        max_length=10, choices=[(d.value, d.name.title()) for d in Dedup],
        default=Dedup.SKIP, db_default=Dedup.SKIP,
    )
    last_error = models.TextField(blank=True, default="", db_default="")
    last_error_code = models.CharField(max_length=64, blank=True, default="", db_default="")
    progress = models.JSONField(null=True, blank=True)
    tenant = models.CharField(
        max_length=200, null=True, blank=True,
        help_text="The tenant or service that owns the job; kept by retries and recurring runs.",
    )
    handbacks = models.PositiveIntegerField(
        default=0, db_default=0,
        help_text="Times a runner handed the job back unfinished at shutdown.",
    )
    result = models.JSONField(
        null=True, blank=True, help_text="The handler's JSON return value (django.tasks results).",
    )
    cancel_requested = models.BooleanField(default=False, db_default=False)
    created_at = models.DateTimeField(db_default=Now())
    updated_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "persistent_jobs"
        verbose_name = "persistent job"
        ordering = ["-id"]
        permissions = [
            ("retry_persistentjob", "Can retry persistent jobs"),
            ("cancel_persistentjob", "Can cancel persistent jobs"),
        ]
        indexes = [
            # The claim query walks this index in order and stops after LIMIT rows; finished rows
            # are not in it, so its cost does not grow with history.
            models.Index(
                models.F("priority").desc(), "next_run_at", "id", name="pj_claim_idx",
                condition=Q(status__in=JobStatus.waiting()),
            ),
            models.Index(
                fields=["job_type", "dedup_key"], name="pj_running_key_idx",
                condition=Q(status=JobStatus.RUNNING) & Q(dedup_key__isnull=False),
            ),
            models.Index(
                fields=["locked_by"], name="pj_locked_by_idx",
                condition=Q(status=JobStatus.RUNNING),
            ),
            models.Index(
                fields=["status", "finished_at"], name="pj_finished_idx",
                condition=Q(status__in=JobStatus.terminal()),
            ),
            models.Index(fields=["job_type", "status"], name="pj_type_status_idx"),
            models.Index(fields=["tenant", "status"], name="pj_tenant_status_idx",
                         condition=Q(tenant__isnull=False)),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["job_type", "dedup_key"], condition=WAITING_DEDUP,
                name="pj_dedup_waiting_uniq",
            ),
            models.CheckConstraint(
                condition=Q(status__in=JobStatus.values), name="pj_status_valid",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.job_type} {self.id} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in JobStatus.terminal()

    def refresh(self) -> PersistentJob:
        """Reload from the database and return self (handy in tests and shells)."""
        self.refresh_from_db()
        return self


class JobAttempt(models.Model):
    """One execution attempt. Its id is the fencing token the attempt's completion must present."""

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(PersistentJob, on_delete=models.CASCADE, related_name="attempt_set")
    attempt = models.PositiveIntegerField()
    runner_id = models.CharField(max_length=200)
    started_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True, blank=True)
    duration = models.DurationField(null=True, blank=True)
    outcome = models.CharField(
        max_length=20, choices=AttemptOutcome.choices, default=AttemptOutcome.RUNNING,
        db_default=AttemptOutcome.RUNNING,
    )
    error_code = models.CharField(max_length=64, blank=True, default="", db_default="")
    error_message = models.TextField(blank=True, default="", db_default="")
    traceback = models.TextField(blank=True, default="", db_default="")
    error_class = models.CharField(
        max_length=255, blank=True, default="", db_default="",
        help_text="Dotted path of the exception class that ended the attempt, if any.",
    )

    class Meta:
        db_table = "persistent_jobs_attempts"
        ordering = ["job_id", "attempt", "id"]
        indexes = [
            models.Index(fields=["job", "attempt"], name="pj_attempt_job_idx"),
            # Failures by time, for the dashboard's charts and failure groups; completed
            # attempts (the vast majority) never enter it, so it costs the hot path nothing.
            models.Index(fields=["finished_at"], name="pj_attempt_failed_idx",
                         condition=Q(outcome__in=["failed", "dead_lettered", "timed_out",
                                                  "rescued"])),
        ]

    def __str__(self) -> str:
        return f"attempt {self.attempt} of {self.job_id}: {self.outcome}"

    @property
    def duration_seconds(self) -> float | None:
        return self.duration.total_seconds() if isinstance(self.duration, timedelta) else None


class JobRunnerRecord(models.Model):
    """A live runner process and its heartbeat. Rescue trusts this table, not elapsed time."""

    #: The fencing identity (``locked_by`` of its jobs): unique per process lifetime.
    id = models.CharField(max_length=200, primary_key=True)
    #: What the operator called it (``runjobs --name``), or ``host:pid``; several runners may
    #: share a name, never an id.
    name = models.CharField(max_length=180, blank=True, default="", db_default="")
    hostname = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField(db_default=Now())
    heartbeat_at = models.DateTimeField(db_default=Now())
    queues = models.JSONField(null=True, blank=True)
    concurrency = models.PositiveIntegerField(default=1)
    version = models.CharField(max_length=50, blank=True, default="")

    class Meta:
        db_table = "persistent_jobs_runners"
        verbose_name = "job runner"
        ordering = ["id"]

    def __str__(self) -> str:
        return self.id


class JobDashboard(PersistentJob):
    """No data of its own: gives the operator dashboard a row on the admin index.

    The admin lists models, not pages; this proxy puts "Dashboard" next to the job tables so
    that an operator reaches it in one click. It has no permissions: viewing it needs the
    permission to view jobs.
    """

    class Meta:
        proxy = True
        verbose_name = verbose_name_plural = "dashboard"
        default_permissions = ()


#: Every column of ``persistent_jobs`` in model order, for ``RETURNING`` clauses of raw SQL.
JOB_COLUMNS: tuple[str, ...] = tuple(str(f.column) for f in PersistentJob._meta.concrete_fields)
JOB_COLUMNS_SQL = ", ".join(f'"{c}"' for c in JOB_COLUMNS)
_JSON_POSITIONS = tuple(
    i for i, f in enumerate(PersistentJob._meta.concrete_fields)
    if isinstance(f, models.JSONField)
)


def job_from_row(row: tuple[Any, ...] | list[Any], db: str = "default") -> PersistentJob:
    """Build a model instance from a raw row of ``JOB_COLUMNS`` without a second query.

    Django's psycopg adapter hands jsonb back as text, so JSON columns are decoded here.
    """
    values = list(row)
    for i in _JSON_POSITIONS:
        if isinstance(values[i], str):
            values[i] = json.loads(values[i])
    return PersistentJob.from_db(db, JOB_COLUMNS, values)


# Recurring schedules live in their own module (issue 3); imported here so Django sees the model.
from .schedule_models import JobSchedule  # noqa: E402,F401
