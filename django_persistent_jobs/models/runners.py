"""The runners table (``persistent_jobs_runners``): live runners and their heartbeats."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


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
    #: The job types it has handlers for, and so claims (refreshed with each heartbeat): a due
    #: job whose type no live runner lists waits, and the console says so. Null for a row
    #: written before the column existed: such a runner counts as handling every type.
    job_types = models.JSONField(null=True, blank=True)
    #: The schedules its code declares (``@job_handler(cron=...)``), written when it registers
    #: and by each sync of its scheduler; null when it runs no scheduler. Syncs read it to
    #: leave alone a schedule that another live runner still declares: during a rolling deploy
    #: an old runner must not switch off, or rewrite, what a newer one declared (``firing``).
    schedules = models.JSONField(null=True, blank=True)
    concurrency = models.PositiveIntegerField(default=1)
    version = models.CharField(max_length=50, blank=True, default="")

    class Meta:
        db_table = "persistent_jobs_runners"
        verbose_name = "job runner"
        ordering = ["id"]

    def __str__(self) -> str:
        return self.id
