"""Handlers for the recurring-schedule tests (tests/schedules/test_firing*.py).

They declare no schedule themselves: a code-declared schedule here would fire in every test that
starts a runner. The tests add schedules at runtime (``add_schedule``) or declare them inside
``registry.isolated()``.
"""

from __future__ import annotations

import time
from typing import Any

from django_persistent_jobs import JobContext, PermanentJobError, job_handler
from django_persistent_jobs.backoff import constant
from tests.testapp.models import LedgerEntry


@job_handler("test.recurring.tick", dedup="enqueue", max_retries=0)
def tick(payload: Any) -> None:
    """No dedup: every tick is its own run, so the tick tests count rows, not dedup decisions."""
    return None


@job_handler("test.recurring.work", max_retries=0, backoff=constant(0.1), timeout=60)
def work(payload: dict[str, Any], ctx: JobContext) -> None:
    """Skip dedup (the default). ``sleep`` makes a slow run, ``permanent`` a dead letter."""
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
    if payload.get("permanent"):
        raise PermanentJobError("planned permanent failure", code="PLANNED_PERMANENT")
    LedgerEntry.objects.create(job_id=ctx.job_id, note=str(payload.get("note", "")))


@job_handler("test.recurring.replace", dedup="replace", max_retries=0, timeout=60)
def replace(payload: dict[str, Any], ctx: JobContext) -> None:
    """Replace dedup: a newer run cancels a waiting one; a running one is never interrupted."""
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
    LedgerEntry.objects.create(job_id=ctx.job_id, note="replace")
