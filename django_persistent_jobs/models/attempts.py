"""The attempts table (``persistent_jobs_attempts``): one row per execution of a job.

An attempt's id is the fencing token its completion must present, so a runner that lost its
claim can never settle the job.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import models
from django.db.models import Q
from django.db.models.functions import Now

from .jobs import PersistentJob


class AttemptOutcome(models.TextChoices):
    RUNNING = "running", "Running"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed (will retry)"
    DEAD_LETTERED = "dead_lettered", "Failed (dead-lettered)"
    TIMED_OUT = "timed_out", "Timed out"
    RESCUED = "rescued", "Runner lost; rescued"
    INTERRUPTED = "interrupted", "Handed back at shutdown"
    CANCELLED = "cancelled", "Cancelled"


class JobAttempt(models.Model):
    """One execution attempt. Its id is the fencing token the attempt's completion must present."""

    id = models.BigAutoField(primary_key=True)
    # No index of its own: ``pj_attempt_job_idx`` (job, attempt) serves every lookup by job,
    # and a second one would be maintained on every attempt insert and update for nothing.
    job = models.ForeignKey(PersistentJob, on_delete=models.CASCADE, related_name="attempt_set",
                            db_index=False)
    attempt = models.PositiveIntegerField()
    runner_id = models.CharField(max_length=200)
    started_at = models.DateTimeField(db_default=Now())
    # False while a claimed job waits in its runner for a free worker (``PREFETCH``): if that
    # runner dies, the job is handed back uncharged instead of being charged an attempt it
    # never ran. Rows written before this column existed, or by raw SQL, count as started.
    started = models.BooleanField(
        default=True, db_default=True,
        help_text="False while the claimed job waits in its runner for a free worker.",
    )
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
