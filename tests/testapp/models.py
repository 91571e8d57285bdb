"""Business tables the test handlers write to, so tests can see exactly-once effects."""

from django.db import models


class LedgerEntry(models.Model):
    """One row per successful handler execution (unique per job: a duplicate commit would fail)."""

    job_id = models.UUIDField(unique=True)
    note = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)


class SideEffect(models.Model):
    """Rows written by handlers that then fail, to prove their writes roll back."""

    job_id = models.UUIDField()
    attempt = models.PositiveIntegerField()
