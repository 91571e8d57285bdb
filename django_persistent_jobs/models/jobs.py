"""The jobs table (``persistent_jobs``): one row per job, and the raw-row helpers the hand-written
SQL uses.

The runner's hot paths (claim, complete, fail, rescue) use hand-written SQL in ``runner/store.py``
against these tables; the ORM models exist for the admin, the operator services and users' own
queries. Column names are therefore part of the contract with that SQL.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from django.db import models
from django.db.models import Exists, OuterRef, Q
from django.db.models.expressions import BaseExpression, RawSQL
from django.db.models.fields.json import KeyTransform
from django.db.models.functions import Cast, Now

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


#: A waiting job holding an enforced dedup key: the condition of the unique index that makes
#: ``enqueue``'s ``ON CONFLICT`` find the job a new one duplicates.
WAITING_DEDUP = (
    Q(status__in=["pending", "failed"]) & Q(dedup_key__isnull=False) & ~Q(dedup="enqueue")
)
#: A job whose dedup key is enforced (any status): the key is set and the strategy is not Enqueue.
DEDUP_ENFORCED = Q(dedup_key__isnull=False) & ~Q(dedup="enqueue")
#: A running job holding an enforced dedup key: a waiting job with the same key must wait for it.
RUNNING_DEDUP = Q(status="running") & DEDUP_ENFORCED
#: Statuses ``pj_type_status_idx`` holds: all but the two every job passes through.
TYPE_STATUS_INDEXED = ("pending", "failed", "dead_lettered", "cancelled")


class _InArray(BaseExpression):
    """``column = ANY(array)``: one array parameter whatever the number of values, so a prepared
    statement keeps one text (``IN (%s, %s, ...)`` would make one per list length)."""

    conditional = True

    def __init__(self, column: str, values: Any, *, position: bool = False) -> None:
        super().__init__(output_field=models.BooleanField())
        self.column = column
        # A list, not any iterable: client-side binding adapts a tuple as a record.
        self.values = values if isinstance(values, list) else list(values)
        self.position = position

    def get_source_expressions(self) -> list[Any]:
        return [self.column_expr, self.array_expr]

    def set_source_expressions(self, exprs: Sequence[Any]) -> None:
        self.column_expr, self.array_expr = exprs

    def resolve_expression(self, query: Any = None, allow_joins: bool = True, reuse: Any = None,
                           summarize: bool = False, for_save: bool = False) -> _InArray:
        c = self.copy()
        c.is_summary = summarize
        c.column_expr = Cast(models.F(self.column), models.TextField()).resolve_expression(
            query, allow_joins, reuse, summarize, for_save)
        c.array_expr = RawSQL("%s::text[]", (self.values,), output_field=models.TextField())
        return c

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        column_sql, column_params = compiler.compile(self.column_expr)
        array_sql, array_params = compiler.compile(self.array_expr)
        if self.position:
            # As a filter rather than ``= ANY``: no index can serve ``array_position``, so the
            # planner keeps walking the ordered claim index and stops at LIMIT instead of
            # fetching every waiting job of those types from (job_type, status) for a sort.
            text = f"array_position({array_sql}, {column_sql}) IS NOT NULL"
            return text, (*array_params, *column_params)
        return f"{column_sql} = ANY({array_sql})", (*column_params, *array_params)


class _KeyAfter(BaseExpression):
    """``priority = P AND (next_run_at, id) > (T, I)``: the jobs after a key of the claim order
    within its priority, written so the claim index scan *starts* there (an index condition, not
    a filter) instead of walking everything before it."""

    conditional = True

    def __init__(self, priority: Any, next_run_at: Any, job_id: Any) -> None:
        super().__init__(output_field=models.BooleanField())
        self.key = (priority, next_run_at, job_id)

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, tuple[Any, ...]]:
        table = connection.ops.quote_name(compiler.query.get_initial_alias())
        return (f"{table}.\"priority\" = %s::smallint AND ({table}.\"next_run_at\", "
                f"{table}.\"id\") > (%s::timestamptz, %s::uuid)", self.key)


def due(now: datetime | None = None) -> Q:
    """Waiting (pending, or failed with a retry scheduled) and due by ``now``; ``None`` means the
    database clock, which is what decides for the claim.

    A due job is claimable unless ``held_by_dedup()``: ``claimable()`` is ``due()`` minus those.
    The operator views count "due" this way, blocked jobs included, because a job held back by a
    running job with its key is still late work: it runs as soon as that job ends.
    """
    return Q(status__in=JobStatus.waiting(), next_run_at__lte=Now() if now is None else now)


def held_by_dedup() -> Q:
    """Holds an enforced dedup key that a running job of the same type holds too: no runner may
    claim it until that job ends, so one job per key runs at a time.

    Written as the negation of the form the claim filters on, whose first two alternatives let
    PostgreSQL skip the ``EXISTS`` for the (usual) job without an enforced key.
    """
    return ~_free_of_dedup()


def _free_of_dedup() -> Q:
    blocker = PersistentJob.objects.filter(
        RUNNING_DEDUP, job_type=OuterRef("job_type"), dedup_key=OuterRef("dedup_key"),
    )
    return Q(dedup_key__isnull=True) | Q(dedup="enqueue") | Q(~Exists(blocker))


class PersistentJobQuerySet(models.QuerySet["PersistentJob"]):
    def claimable(
        self, queues: Collection[str] | None = None, job_types: Collection[str] | None = None,
    ) -> PersistentJobQuerySet:
        """Jobs a runner may claim now, in claim order: ``due()`` by the database clock and not
        ``held_by_dedup()``; optionally only in ``queues`` and of ``job_types`` (``None``: all).

        The one definition of "due and claimable": the runner's claim statement is compiled from
        it (``runner/store.py``), and the admin or stats can count or list exactly what a runner
        would take next.
        """
        qs = self.filter(due())
        if queues is not None:
            qs = qs.filter(_InArray("queue", queues))
        if job_types is not None:
            qs = qs.filter(_InArray("job_type", job_types, position=True))
        qs = qs.filter(_free_of_dedup())
        return qs.order_by("-priority", "next_run_at", "id")

    def after_key(self, priority: Any, next_run_at: Any, job_id: Any) -> PersistentJobQuerySet:
        """Only jobs of ``priority`` after ``(next_run_at, job_id)`` in claim order: where a
        claim that just took that job may resume (see ``runner/store.py``)."""
        return self.filter(_KeyAfter(priority, next_run_at, job_id))


PersistentJobManager = models.Manager.from_queryset(PersistentJobQuerySet)


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

    objects = PersistentJobManager()

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
            # Per-type lookups of waiting, dead-lettered and cancelled jobs (stats, failure
            # groups, the admin's filters). Running and completed rows stay out: every job
            # passes through both, and each status change would add an entry here twice per job.
            models.Index(fields=["job_type", "status"], name="pj_type_status_idx",
                         condition=Q(status__in=TYPE_STATUS_INDEXED)),
            models.Index(fields=["tenant", "status"], name="pj_tenant_status_idx",
                         condition=Q(tenant__isnull=False)),
            # A schedule's runs (the admin's "runs of X", ``?schedule__name=X``): only recurring
            # runs have a schedule, so one-shot jobs add nothing here.
            models.Index(KeyTransform("name", "schedule"), name="pj_schedule_name_idx",
                         condition=Q(schedule__isnull=False)),
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

    def is_due(self, now: datetime) -> bool:
        """``due(now)`` for this row as loaded (for display, without another query)."""
        return self.status in JobStatus.waiting() and self.next_run_at <= now

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
