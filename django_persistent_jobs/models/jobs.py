"""The jobs table (``persistent_jobs``): one row per job, and the raw-row helpers the hand-written
SQL uses.

The runner's hot paths (claim, complete, fail, rescue) use hand-written SQL in ``runner/store.py``
against these tables; the ORM models exist for the admin, the operator services and users' own
queries. Column names are therefore part of the contract with that SQL.
"""

from __future__ import annotations

import json
from typing import Any

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from ..ids import uuid7
from ..types import Dedup


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
