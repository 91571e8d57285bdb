"""Example handlers: one that succeeds, one that fails twice then succeeds, one that never can.

Together they show the three paths a job can take: completed, retried, dead-lettered.
"""

from __future__ import annotations

import logging
from typing import Any

from django.utils import timezone

from django_persistent_jobs import (
    JobContext,
    JobHandler,
    PermanentJobError,
    TransientJobError,
    job_handler,
)
from django_persistent_jobs.backoff import constant

logger = logging.getLogger("example_project.demo")


# One-shot (the demo command enqueues it) and recurring: every runner syncs this schedule into
# the schedules table at start, and exactly one of them enqueues a run each minute.
@job_handler("demo.health_check", max_retries=1, timeout=10, cron="* * * * *",
             payload={"source": "schedule"})
class HealthCheckJob(JobHandler):
    """Logs the current timestamp: the smallest useful job, and a liveness signal for operators."""

    def execute(self, payload: dict[str, Any], ctx: JobContext) -> None:
        now = timezone.now().isoformat()
        logger.info("health check (%s) at %s", payload.get("source", "one-shot"), now)
        ctx.report_progress({"checked_at": now})


@job_handler("demo.flaky", max_retries=3, backoff=constant(1))
def flaky(payload: dict[str, Any], ctx: JobContext) -> None:
    """Fails transiently on its first two attempts (think: an upstream 503), then succeeds."""
    if ctx.attempt <= 2:
        raise TransientJobError(
            f"upstream unavailable (attempt {ctx.attempt})", code="UPSTREAM_5XX", retry_after=1
        )
    logger.info("flaky job succeeded on attempt %d", ctx.attempt)


@job_handler("demo.always_fails", max_retries=3)
def always_fails(payload: dict[str, Any]) -> None:
    """A permanent failure: retrying cannot help, so it is dead-lettered at once."""
    raise PermanentJobError(
        f"customer {payload.get('customer_id')} has no payout account", code="NOT_FOUND"
    )
